"""Write build/draft_prompts/tasks.jsonl: code and step-by-step arithmetic requests for an EAGLE-3 head's training data.

The shipped head's data (calibration passages, self-instructed turns) holds no code and no worked arithmetic, and
on the built-in validation prompts of those categories it accepted least. These prompts cover the same kinds of
request with other tasks: none of the validation prompts' functions or puzzles appears here, and
`specdeploy draft data` refuses a prompt file holding a validation prompt. Seeded: the same file every run.

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
    ("// TypeScript: a function that sums the prices of cart items", "function cartTotal(items: { price: number; qty: number }[]): number {"),
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
SUFFIXES = ["Let's think step by step.", "Explain your reasoning.", "Show your steps.", "Solve it step by step.",
            "Show the calculation.", "Explain how you got the answer."]


def _reasoning(rng: random.Random) -> str:
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    kinds = [
        lambda: f"{n} has {a} {item} and gives {c} to {m}. Then {n} buys {b} more. How many {item} does {n} have now?",
        lambda: f"A jacket costs {a * 5} dollars. It is discounted by {rng.choice([10, 15, 20, 30, 40])} percent. What does it cost now?",
        lambda: f"A triangle has a base of {b} cm and a height of {c * 2} cm. What is its area?",
        lambda: f"A square garden has sides of {b} metres. How much fencing is needed to go around it, and what is its area?",
        lambda: f"{n} saves {c} dollars every week. How many weeks does it take to save {c * a} dollars?",
        lambda: f"The average of three numbers is {a}. Two of them are {a - c} and {a + b}. What is the third?",
        lambda: f"A tank holds {a * 10} litres and drains {b} litres per minute. How long until it is empty?",
        lambda: f"{n} is {b} years older than {m}. In {c} years their ages will add up to {2 * a + b + 2 * c}. How old is {m} now?",
        lambda: f"A box has {a} red and {b} green marbles. If you pick one marble without looking, what is the chance it is green?",
        lambda: f"Two workers can paint a fence in {c * 2} hours together. One alone needs {c * 3} hours. How long does the other need alone?",
        lambda: f"A film starts at {rng.randint(1, 8)}:{rng.choice(['10', '25', '40'])} pm and lasts {a + 80} minutes. At what time does it end?",
        lambda: f"A map uses a scale of 1 cm to {c} km. Two towns are {b}.5 cm apart on the map. How far apart are they?",
        lambda: f"If {b} notebooks cost {b * c} dollars, how much do {a} notebooks cost?",
        lambda: f"All roses in the shop are red, and some red flowers in the shop are tulips. Can we conclude that some roses are tulips?",
        lambda: f"{n} runs faster than {m}, and {m} runs faster than {rng.choice(NAMES)}. Who is the slowest?",
        lambda: f"It is {rng.choice(['March', 'July', 'October', 'January'])} now. Which month will it be in {a} months?",
        lambda: f"A pizza is cut into {b + 4} slices. {n} eats {c // 2 + 1} and {m} eats {c}. What fraction of the pizza is left?",
        lambda: f"How many grams are there in {c}.{b % 10} kilograms, and how many kilograms in {a * 25} grams?",
        lambda: f"A class of {a + 10} students goes on a trip. Each van seats {c + 4}. How many vans are needed?",
        lambda: f"{n} walks {c} kilometres on Monday and twice as far on each following day. How far does {n} walk on Thursday?",
        lambda: f"A bus leaves at {rng.randint(6, 11)}:{rng.choice(['05', '20', '35', '50'])} and the trip takes {a + 30} minutes. When does it arrive?",
        lambda: f"A rectangle has a perimeter of {2 * (a + b)} cm and one side of {a} cm. What is the other side and the area?",
    ]
    return f"{rng.choice(kinds)()} {rng.choice(SUFFIXES)}"


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
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("tasks.jsonl")
    rows = prompts()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} prompts ({sum(r['category'] == 'code' for r in rows)} code, "
          f"{sum(r['category'] == 'reasoning' for r in rows)} reasoning)")
