"""Write build/draft_prompts/tasks.jsonl: code, step-by-step arithmetic, everyday chat requests and summaries of
emails, reviews, notes and news for an EAGLE-3 head's training data.

The calibration passages and self-instructed turns hold no code, no worked arithmetic, few of the everyday
requests people type into a chat and no summaries of everyday messages; on the built-in validation prompts of those
categories the head accepted least. These prompts cover the same kinds of request with other tasks, topics and
texts: none of the validation prompts' functions, puzzles, questions or texts appears here, and
`specdeploy draft data` refuses a prompt file holding a validation prompt (tests check that no prompt here is a
validation prompt with other words). Seeded: the same file every run.

    python build/draft_prompts/make_tasks.py        # rewrites tasks.jsonl beside this script
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 0

# (name, arguments, what it does): Python functions other than the validation set's
FUNCTIONS = [
    ("count_vowels", "text", "count the vowels in a string"),
    ("rotate_list", "items, k", "rotate a list to the right by k positions"),
    ("transpose", "matrix", "transpose a matrix given as a list of rows"),
    ("word_lengths", "sentence", "map every word of a sentence to its length"),
    ("median", "numbers", "return the median of a list of numbers"),
    ("mode", "numbers", "return the most common value in a list"),
    ("capitalize_words", "text", "capitalize the first letter of every word"),
    ("remove_punctuation", "text", "remove punctuation characters from a string"),
    ("is_anagram", "a, b", "check whether two strings are anagrams of each other"),
    ("dot_product", "u, v", "compute the dot product of two vectors"),
    ("matrix_multiply", "a, b", "multiply two matrices given as lists of rows"),
    ("running_total", "numbers", "return the running totals of a list of numbers"),
    ("group_by_length", "words", "group words into a dict keyed by their length"),
    ("invert_dict", "mapping", "swap the keys and values of a dictionary"),
    ("merge_dicts", "a, b", "merge two dictionaries, adding the values of shared keys"),
    ("clamp", "value, low, high", "clamp a number into the range [low, high]"),
    ("digits_sum", "n", "return the sum of the decimal digits of an integer"),
    ("to_binary", "n", "convert a non-negative integer to its binary string"),
    ("from_roman", "numeral", "convert a Roman numeral to an integer"),
    ("to_roman", "number", "convert an integer between 1 and 3999 to a Roman numeral"),
    ("lcm", "a, b", "return the least common multiple of two integers"),
    ("power_set", "items", "return all subsets of a list"),
    ("permutations", "items", "return all orderings of a list without using itertools"),
    ("caesar_cipher", "text, shift", "shift every letter of a text by a fixed amount"),
    ("run_length_encode", "text", "compress a string with run-length encoding"),
    ("run_length_decode", "encoded", "expand a run-length encoded string"),
    ("pairwise_sums", "numbers, target", "find all pairs of numbers that add up to a target"),
    ("max_subarray", "numbers", "return the largest sum of a contiguous sub-list"),
    ("insertion_sort", "items", "sort a list with insertion sort"),
    ("bubble_sort", "items", "sort a list with bubble sort"),
    ("quick_sort", "items", "sort a list with quicksort"),
    ("selection_sort", "items", "sort a list with selection sort"),
    ("word_frequencies_top", "text, n", "return the n most frequent words of a text"),
    ("title_case", "text", "convert a sentence to title case, keeping short words lower case"),
    ("snake_to_camel", "name", "convert a snake_case name to camelCase"),
    ("camel_to_snake", "name", "convert a camelCase name to snake_case"),
    ("validate_email", "address", "check that a string looks like an email address"),
    ("parse_query_string", "query", "parse a URL query string into a dict"),
    ("hex_to_rgb", "color", "convert a hex colour like '#ff8800' to an (r, g, b) tuple"),
    ("rgb_to_hex", "r, g, b", "convert red, green and blue values to a hex colour string"),
    ("seconds_to_hms", "seconds", "format a number of seconds as hours, minutes and seconds"),
    ("leap_year", "year", "tell whether a year is a leap year"),
    ("days_in_month", "year, month", "return the number of days in a month"),
    ("average_grade", "grades", "return the average of a dict of student grades"),
    ("triangle_area", "a, b, c", "compute the area of a triangle from its side lengths"),
    ("circle_area", "radius", "compute the area of a circle"),
    ("distance", "p, q", "return the Euclidean distance between two points"),
    ("mean_and_std", "numbers", "return the mean and standard deviation of a list"),
    ("histogram", "numbers, bins", "count how many numbers fall into each of n equal bins"),
    ("moving_average", "numbers, window", "return the moving averages over a sliding window"),
    ("find_duplicates", "items", "return the values that appear more than once"),
    ("intersection", "a, b", "return the elements two lists have in common"),
    ("zip_to_dict", "keys, values", "build a dictionary from a list of keys and a list of values"),
    ("longest_word", "sentence", "return the longest word of a sentence"),
    ("longest_common_prefix", "words", "return the longest prefix shared by all words"),
    ("count_lines", "path", "count the lines of a text file"),
    ("write_csv", "path, rows", "write a list of rows to a CSV file"),
    ("retry", "func, attempts", "call a function again until it succeeds or the attempts run out"),
    ("memoize", "func", "cache a function's results by its arguments"),
    ("timer", "func", "measure how long a function call takes"),
    ("pascal_triangle", "n", "return the first n rows of Pascal's triangle"),
    ("collatz_steps", "n", "count the steps of the Collatz sequence from n down to 1"),
    ("primes_up_to", "n", "list all prime numbers up to n with the sieve of Eratosthenes"),
    ("is_sorted", "items", "check whether a list is sorted in ascending order"),
    ("swap_case", "text", "swap upper and lower case letters of a string"),
    ("char_histogram", "text", "count how often each character appears"),
    ("safe_divide", "a, b", "divide two numbers and return None when dividing by zero"),
    ("shopping_total", "prices, quantities", "compute the total cost of a shopping list"),
    ("temperature_stats", "readings", "return the lowest, highest and average temperature"),
    ("matrix_trace", "matrix", "return the sum of the diagonal of a square matrix"),
]

# JavaScript / other languages: (comment, opening line)
OTHER_LANGUAGES = [
    ("// JavaScript: return the largest number in an array", "function maxOf(values) {"),
    ("// JavaScript: capitalize the first letter of a string", "function capitalize(text) {"),
    ("// JavaScript: count how many times each word appears", "function wordCounts(text) {"),
    ("// JavaScript: remove duplicate values from an array", "function dedupe(values) {"),
    ("// JavaScript: throttle a function so it runs at most once per interval", "function throttle(fn, interval) {"),
    ("// JavaScript: fetch JSON from a URL and log it", "async function loadJson(url) {"),
    ("// JavaScript: shuffle an array in place", "function shuffle(values) {"),
    (
        "// TypeScript: a function that sums the prices of cart items",
        "function cartTotal(items: { price: number; qty: number }[]): number {",
    ),
    ("# Bash: count the lines of every .py file in this folder", ""),
    ("# Bash: back up a folder into a dated tar.gz archive", ""),
    ("-- SQL: the ten most expensive products", "SELECT name, price"),
    ("-- SQL: number of orders per month in 2024", "SELECT"),
    ("// C: compute the average of an array of integers", "double average(const int *values, int n) {"),
    ("// C: reverse a string in place", "void reverse(char *s) {"),
    ("// Java: check whether a number is even", "public static boolean isEven(int n) {"),
    ("// Go: sum a slice of integers", "func sum(values []int) int {"),
    ("// Rust: return the length of the longest word", "fn longest_word_len(text: &str) -> usize {"),
]

NAMES = ["Maya", "Leo", "Priya", "Omar", "Chen", "Sofia", "Jonas", "Amara", "Diego", "Hana", "Felix", "Zara"]
ITEMS = ["pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards", "shells"]
SUFFIXES = [
    "Let's think step by step.",
    "Explain your reasoning.",
    "Show your steps.",
    "Solve it step by step.",
    "Show the calculation.",
    "Explain how you got the answer.",
]


def _reasoning(rng: random.Random) -> str:
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    kinds = [
        lambda: f"{n} has {a} {item} and gives {c} to {m}. Then {n} buys {b} more. How many {item} does {n} have now?",
        lambda: (
            f"A jacket costs {a * 5} dollars. It is discounted by {rng.choice([10, 15, 20, 30, 40])} percent. What does"
            " it cost now?"
        ),
        lambda: f"A triangle has a base of {b} cm and a height of {c * 2} cm. What is its area?",
        lambda: (
            f"A square garden has sides of {b} metres. How much fencing is needed to go around it, and what is its"
            " area?"
        ),
        lambda: f"{n} saves {c} dollars every week. How many weeks does it take to save {c * a} dollars?",
        lambda: f"The average of three numbers is {a}. Two of them are {a - c} and {a + b}. What is the third?",
        lambda: f"A tank holds {a * 10} litres and drains {b} litres per minute. How long until it is empty?",
        lambda: (
            f"{n} is {b} years older than {m}. In {c} years their ages will add up to {2 * a + b + 2 * c}. How old is"
            f" {m} now?"
        ),
        lambda: (
            f"A box has {a} red and {b} green marbles. If you pick one marble without looking, what is the chance it is"
            " green?"
        ),
        lambda: (
            f"Two workers can paint a fence in {c * 2} hours together. One alone needs {c * 3} hours. How long does the"
            " other need alone?"
        ),
        lambda: (
            f"A film starts at {rng.randint(1, 8)}:{rng.choice(['10', '25', '40'])} pm and lasts {a + 80} minutes. At"
            " what time does it end?"
        ),
        lambda: (
            f"A map uses a scale of 1 cm to {c} km. Two towns are {b}.5 cm apart on the map. How far apart are they?"
        ),
        lambda: f"If {b} notebooks cost {b * c} dollars, how much do {a} notebooks cost?",
        lambda: (
            "All roses in the shop are red, and some red flowers in the shop are tulips. Can we conclude that some"
            " roses are tulips?"
        ),
        lambda: f"{n} runs faster than {m}, and {m} runs faster than {rng.choice(NAMES)}. Who is the slowest?",
        lambda: (
            f"It is {rng.choice(['March', 'July', 'October', 'January'])} now. Which month will it be in {a} months?"
        ),
        lambda: (
            f"A pizza is cut into {b + 4} slices. {n} eats {c // 2 + 1} and {m} eats {c}. What fraction of the pizza is"
            " left?"
        ),
        lambda: f"How many grams are there in {c}.{b % 10} kilograms, and how many kilograms in {a * 25} grams?",
        lambda: f"A class of {a + 10} students goes on a trip. Each van seats {c + 4}. How many vans are needed?",
        lambda: (
            f"{n} walks {c} kilometres on Monday and twice as far on each following day. How far does {n} walk on"
            " Thursday?"
        ),
        lambda: (
            f"A bus leaves at {rng.randint(6, 11)}:{rng.choice(['05', '20', '35', '50'])} and the trip takes {a + 30}"
            " minutes. When does it arrive?"
        ),
        lambda: (
            f"A rectangle has a perimeter of {2 * (a + b)} cm and one side of {a} cm. What is the other side and the"
            " area?"
        ),
    ]
    return f"{rng.choice(kinds)()} {rng.choice(SUFFIXES)}"


# Everyday chat requests: (template or templates, fillers); every filler makes a prompt with each template
CHAT = [
    (
        "Can you give me {} tips for {}?",
        [
            "saving money on groceries",
            "studying for a maths test",
            "running my first 5k race",
            "staying focused while working from home",
            "writing a cover letter",
            "learning a new language as an adult",
            "taking better photos with my phone",
            "getting along with a new roommate",
            "cooking for just one person",
            "travelling with a toddler",
            "starting a vegetable garden on a balcony",
            "making friends in a new city",
            "surviving a long-haul flight",
            "spending less time on my phone",
            "speaking up in team meetings",
            "keeping a daily journal",
            "painting a small bedroom",
            "getting up earlier in the morning",
        ],
    ),
    (
        ("How do I {}?", "What is the easiest way to {}?"),
        [
            "get a coffee stain out of a white shirt",
            "fix a flat bicycle tyre",
            "make cold brew coffee at home",
            "back up the photos on my phone",
            "boil an egg so the yolk stays soft",
            "unclog a bathroom sink without chemicals",
            "fold a fitted sheet",
            "ask my manager for a raise",
            "start running if I have never exercised",
            "keep fresh basil alive indoors",
            "clean a cast iron pan",
            "introduce a new kitten to my dog",
            "write a polite complaint to my landlord",
            "stop procrastinating on a big project",
            "make my small living room look bigger",
            "choose a good watermelon",
        ],
    ),
    (
        "Write a short {}.",
        [
            "birthday message for my best friend who just turned thirty",
            "apology text to a friend for missing her party",
            "congratulations card for a neighbour who had a baby",
            "welcome email for a new member of our book club",
            "farewell note for a colleague who is retiring",
            "good luck message for my brother before his driving test",
            "message inviting my team to a Friday lunch",
            "note asking my neighbours to keep the noise down after ten",
            "get-well-soon card for my grandfather",
            "toast for my parents' anniversary dinner",
        ],
    ),
    (
        "Tell me {} interesting facts about {}.",
        [
            "penguins",
            "the Moon",
            "elephants",
            "the Roman Empire",
            "sharks",
            "the human heart",
            "rainbows",
            "owls",
            "the Sahara desert",
            "coffee",
            "the Eiffel Tower",
            "dolphins",
            "volcanoes in Iceland",
            "the Olympic Games",
        ],
    ),
    (
        "Why {}?",
        [
            "do cats purr",
            "do leaves change colour in autumn",
            "do we get hiccups",
            "do onions make people cry",
            "do stars twinkle at night",
            "does ice float on water",
            "do we yawn when we are tired",
            "does bread go stale",
            "do our fingers wrinkle in the bath",
            "do birds fly south for the winter",
            "is the ocean salty",
            "do we dream",
        ],
    ),
    (
        ("Explain {} in simple terms.", "Could you tell me {}? I am not an expert."),
        [
            "how a refrigerator keeps food cold",
            "what compound interest is",
            "how vaccines protect us",
            "what an API is",
            "how tides work",
            "how a credit score works",
            "what machine learning is",
            "how airplanes stay in the air",
            "how the internet sends a web page to my laptop",
            "what a recession is",
            "how solar panels make electricity",
            "why we have leap years",
        ],
    ),
    (
        "Can you recommend {}?",
        [
            "a board game for a family with young kids",
            "a podcast for a long car drive",
            "a houseplant that survives in low light",
            "a movie for a cosy rainy evening",
            "a hobby I can do in twenty minutes a day",
            "a gift for a friend who loves cooking",
            "a weekend project for a beginner woodworker",
            "a song to learn on the piano",
            "some easy snacks for a hiking day",
            "a way to relax after a stressful workday",
        ],
    ),
    (
        ("I want to {}. What are the first steps?", "Is it realistic to {} within a year? How?"),
        [
            "learn to code",
            "run a half marathon next year",
            "start my own small bakery",
            "get better at public speaking",
            "read more books this year",
            "learn to draw portraits",
            "save for a trip to Japan",
            "become a volunteer at an animal shelter",
            "switch careers into nursing",
            "write a short novel",
        ],
    ),
    (
        ("Help me plan {}.", "I need to organise {}. Can you make me a checklist?"),
        [
            "a picnic for eight people",
            "a weekend trip to the mountains",
            "a study schedule for the next two weeks",
            "a surprise dinner for my parents' anniversary",
            "a budget for my first month living alone",
            "a week of simple vegetarian dinners",
            "a children's party for ten six-year-olds",
            "a morning routine that starts at 6 am",
            "a day in Rome with a small budget",
            "a small garden party in June",
        ],
    ),
    (
        ("Give me an easy recipe for {}.", "What do I need to make {}, and how long does it take?"),
        [
            "banana bread",
            "a quick vegetable stir-fry",
            "pancakes without eggs",
            "a simple lentil soup",
            "guacamole",
            "overnight oats",
            "a lemon and garlic chicken",
            "homemade pizza dough",
            "a fresh Greek salad",
            "chocolate chip cookies",
        ],
    ),
    (
        "Is it better to {}?",
        [
            "rent or buy a house",
            "study in the morning or at night",
            "stretch before or after running",
            "pay off debt first or start saving",
            "buy a new or a used car",
            "read e-books or paper books",
            "shower in the morning or in the evening",
            "learn Python or JavaScript first",
            "walk or cycle to work",
        ],
    ),
    (
        "How do you say '{}' in {}?",
        [
            "thank you very much",
            "where is the train station",
            "I would like a coffee, please",
            "see you tomorrow",
            "how much does this cost",
            "nice to meet you",
        ],
    ),
    (
        "{}",
        [
            "How much water should I drink in a day?",
            "How many hours of sleep does a teenager need?",
            "What can I cook for friends on Saturday that is easy but looks impressive?",
            "My laptop has become very slow. What can I do?",
            "I keep forgetting to water my plants. Any ideas?",
            "What should I look for when buying running shoes?",
            "How can I be more productive in the afternoon?",
            "Could you explain how to read a nutrition label?",
            "What are good questions to ask at the end of a job interview?",
            "My neighbour's dog barks all night. How should I bring it up?",
            "How do I know if a mushroom is safe to eat?",
            "What is the best way to learn touch typing?",
            "Can you suggest a name for my bakery that sells bread and cakes?",
            "How long should I boil pasta?",
            "What are some cheap date ideas?",
            "How do I stop my glasses from fogging up?",
            "What is a healthy snack I can take to work?",
            "How often should I wash my bed sheets?",
            "What's a polite way to remind a friend that they owe me money?",
            "Where do rainbows come from?",
            "How do I deal with a coworker who takes credit for my work?",
            "What are the symptoms of dehydration?",
            "How can I teach my child to ride a bike?",
            "What is the healthiest way to cook vegetables?",
        ],
    ),
]
CHAT_COUNTS = ["three", "five", "a few", "some"]
LANGUAGES = ["Italian", "Portuguese", "Japanese", "Dutch", "Swedish"]


def _chat() -> list[str]:
    out = []
    for templates, fillers in CHAT:
        for template in (templates,) if isinstance(templates, str) else templates:
            for i, filler in enumerate(fillers):
                if template.count("{}") == 1:
                    out.append(template.format(filler))
                elif "facts" in template or "tips" in template:
                    out.append(template.format(CHAT_COUNTS[i % len(CHAT_COUNTS)], filler))
                else:
                    out.extend(template.format(filler, lang) for lang in LANGUAGES[i % 2 :: 2])
    return out


# Everyday texts to summarize, built from parts: emails and messages, reviews, meeting notes, news items
SENDERS = ["Anna", "Tom", "Ravi", "Lucia", "Ben", "Keiko", "Marco", "Ines"]
EMAILS = [
    (
        "the team offsite planned for next week is postponed by one month because the venue flooded. We will keep the"
        " same agenda, and the hotel bookings have been moved for everyone. Please update your calendars and let me"
        " know if the new date does not work for you"
    ),
    (
        "the office kitchen will be renovated from Monday to Wednesday. During those days the coffee machine and fridge"
        " will not be available, so please bring your lunch in a cool bag. The new kitchen will have a second"
        " dishwasher"
    ),
    (
        "our client asked for the design drafts two days earlier than agreed. Could you send me your part by Wednesday "
        "evening? I will put the slides together on Thursday morning and send them before noon"
    ),
    (
        "I found a wallet in the car park this morning with a library card inside. I left it at the front desk with "
        "security. If it is yours, you can pick it up there until 6 pm"
    ),
    (
        "the payroll system is being updated this weekend, so payslips will be sent on Tuesday instead of Monday."
        " Payments themselves are not affected and will arrive on the usual date"
    ),
    (
        "thank you all for the help with the charity run. We raised 3,200 euros for the children's hospital, which is"
        " almost twice last year's amount. Photos from the day are in the shared folder"
    ),
    (
        "the printer on the second floor is out of order again. A technician will come on Thursday. Until then please"
        " use the printer near the reception and remember that colour prints need a code"
    ),
    (
        "I will be on holiday from the 3rd to the 17th with no access to email. Priya will handle urgent questions"
        " about the website, and Omar will approve invoices while I am away"
    ),
]
REVIEWS = [
    (
        "I bought these wireless earbuds for running. They stay in place and the sound is clear, but the battery lasts"
        " only about four hours and the charging case feels cheap. For the price they are fine, not great"
    ),
    (
        "We stayed three nights at this small hotel by the lake. The room was spotless and breakfast was generous, with"
        " local cheese and fresh bread. The walls are thin, though, and the parking costs extra. We would still come"
        " back"
    ),
    (
        "This blender is powerful enough for frozen fruit and cleans easily, but it is very loud and the lid leaks if"
        " you fill it past the top line. Customer service replaced the lid quickly when I complained"
    ),
    (
        "The new sci-fi series starts slowly, and the first two episodes are confusing. From episode three it gets"
        " gripping, the effects are beautiful and the lead actor is excellent. The ending leaves too many questions"
        " open"
    ),
    (
        "I have used this budgeting app for six months. It sorts spending automatically and the charts are helpful. The"
        " free version shows a lot of ads, and syncing with my second bank often fails"
    ),
    (
        "The cafe on the corner has the best croissants in town and friendly staff. It is tiny, so there is usually a"
        " queue, and it only takes cash. Go early on weekends"
    ),
    (
        "This tent was easy to set up alone and stayed dry during a night of heavy rain. It is heavier than the product"
        " page suggests and a bit cramped for two adults with backpacks"
    ),
    (
        "The online Spanish course is well organised, with short daily lessons and good pronunciation exercises. The"
        " grammar explanations are too brief, so I needed a book alongside it"
    ),
]
NOTES = [
    (
        "Attendees: the whole design team. We agreed to move the launch to 14 May so testing can finish. Sara will"
        " write the release notes by Friday. The budget for user interviews was approved. Next meeting: Tuesday at 11"
    ),
    (
        "Parents' evening planning. The school hall is booked for 20 March from 5 to 8 pm. Teachers will have"
        " ten-minute slots. Mr Patel will send the sign-up link on Monday. Volunteers are still needed for the"
        " refreshments table"
    ),
    (
        "Sprint review: the search feature is done, the export to PDF is delayed by a week because of a font problem. "
        "Two bugs reported by customers were fixed. Leo will look into the slow login page before the next sprint"
    ),
    (
        "Neighbourhood association. The street party will take place on 6 July. We need a permit from the council,"
        " which Hana will request. Everyone agreed to ban single-use plastic cups. The next meeting is in two weeks"
    ),
    (
        "Book club: we discussed the first half of the novel. Most members liked the setting but found the main"
        " character hard to like. Next time we finish the book and pick the next one; Jonas will bring three"
        " suggestions"
    ),
    (
        "Kitchen staff meeting: the new menu starts on Monday. Two dishes were removed because suppliers raised prices."
        " Everyone must finish the allergy training by the end of the month. The walk-in fridge will be cleaned on"
        " Sundays"
    ),
]
NEWS = [
    (
        "The city zoo welcomed two red panda cubs this week, the first born there in ten years. The cubs will stay with"
        " their mother indoors until the spring, when visitors will be able to see them in the new forest enclosure"
    ),
    (
        "A heatwave is expected to reach the region on Thursday, with temperatures up to 38 degrees. Authorities advise"
        " people to drink plenty of water, avoid the midday sun and check on elderly neighbours. Public pools will open"
        " longer"
    ),
    (
        "The local library launched a program that lends tools such as drills, ladders and sewing machines. Members can"
        " borrow up to three tools for a week. The idea came from residents who wanted to save money and reduce waste"
    ),
    (
        "After two years of work the old railway bridge reopened as a walking and cycling path. The bridge links two"
        " parks and shortens the walk to the city centre by twenty minutes. It is lit at night by solar-powered lamps"
    ),
    (
        "A high school team won the national robotics competition with a robot that sorts recycling by material. The"
        " students built it from spare parts over eight months and plan to share the design online for free"
    ),
    (
        "The ferry company announced new summer timetables with boats every thirty minutes instead of every hour."
        " Tickets can now be bought with a phone app, and children under six travel for free"
    ),
    (
        "Farmers in the valley report a record apple harvest after a mild spring and a wet summer. Prices at local"
        " markets have dropped, and several farms are inviting the public to pick their own fruit at weekends"
    ),
    (
        "The museum of natural history will close its dinosaur hall for six months to install a new skeleton found last"
        " year. The rest of the museum stays open, and a temporary exhibition on fossils opens in the east wing"
    ),
]
SUMMARY_ASKS = {
    "email": [
        "Summarize this email in one sentence:",
        "What does this email ask me to do? Keep it short.",
        "Give me the key points of this message:",
        "Write a two-line summary of this email for my manager:",
    ],
    "review": [
        "Summarize this customer review, with the good and the bad points:",
        "Write a one-sentence summary of this review:",
        "Would the writer recommend this? Summarize the review briefly:",
        "Sum up this review in three bullet points:",
    ],
    "notes": [
        "Summarize these meeting notes, listing decisions and action items:",
        "Turn these notes into a short summary:",
        "What was decided in this meeting? Summarize:",
        "Write a brief recap of these notes for someone who was absent:",
    ],
    "news": [
        "Summarize this news story in two sentences:",
        "Write a headline and a one-paragraph summary of this news item:",
        "Summarize this article for a ten-year-old:",
        "What are the main facts in this news item?",
    ],
}
PASSAGE_ASKS = [
    "Summarize this passage in one sentence.",
    "Write a short summary of this text in bullet points.",
    "Give a brief summary of the passage below, then name its tone.",
    "Summarize the text below in about fifty words.",
]


def _summaries(rng: random.Random) -> list[str]:
    out = []
    for kind, texts in (("email", EMAILS), ("review", REVIEWS), ("notes", NOTES), ("news", NEWS)):
        for i, text in enumerate(texts):
            for ask in SUMMARY_ASKS[kind]:
                body = (
                    f"Hi all,\n{text[0].upper() + text[1:]}.\nBest, {SENDERS[i % len(SENDERS)]}"
                    if kind == "email"
                    else text + "."
                )
                out.append(f"{ask}\n\n{body}")
    calibration = Path(__file__).resolve().parents[2] / "specdeploy" / "data" / "calib" / "calibration.jsonl"
    passages = [
        json.loads(line)["text"] for line in calibration.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    for text in rng.sample(passages, 120):
        out.append(f"{rng.choice(PASSAGE_ASKS)}\n\n{text}")
    return out


def prompts() -> list[dict]:
    rng = random.Random(SEED)
    out = []
    for name, args, what in FUNCTIONS:
        out.append({"prompt": f'def {name}({args}):\n    """{what[0].upper() + what[1:]}."""\n', "category": "code"})
        out.append({"prompt": f"Write a Python function to {what}.", "category": "code"})
        out.append({"prompt": f"# Python: {what}\n\ndef {name}({args}):\n", "category": "code"})
    for comment, opening in OTHER_LANGUAGES:
        out.append({"prompt": f"{comment}\n{opening}\n" if opening else f"{comment}\n", "category": "code"})
    seen = set()
    while len(seen) < 400:
        text = _reasoning(rng)
        if text not in seen:
            seen.add(text)
            out.append({"prompt": text, "category": "reasoning"})
    out.extend({"prompt": text, "category": "chat"} for text in _chat())
    out.extend({"prompt": text, "category": "summarization"} for text in _summaries(rng))
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("tasks.jsonl")
    rows = prompts()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    counts = {c: sum(r["category"] == c for r in rows) for c in ("code", "reasoning", "chat", "summarization")}
    print(f"{path}: {len(rows)} prompts ({', '.join(f'{n} {c}' for c, n in counts.items())})")
