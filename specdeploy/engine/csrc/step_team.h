// One OpenMP team for a whole decoder step (issue 25, served overhead), shared by cpu_kernels.cpp and
// int8_kernels.cpp.
//
// A step of 30 layers makes ~180 parallel loops (every GEMV and attention). Through at::parallel_for each is an
// OpenMP region: the served stubs wait for work passively (OMP_WAIT_POLICY=PASSIVE, triton/server.py: spinning
// pools on 2 shared cores slowed a step many times over), so every region starts by waking the sleeping second
// thread (futex), a third of a one-token step (docs/stages.md "Why native kernels").
//
// Decoder::forward instead opens one region for the whole step (`run_step`): the calling thread runs the step's
// ops as before, and each parallel loop (`parallel_for`) is handed to the team's helpers, which spin for it
// between loops (a loop follows the last within microseconds) and leave at the end of the step, so between
// steps they sleep as before. Chunks are taken from a shared counter: where a helper lost its core to another
// process, the caller takes the chunks it would have done instead of waiting for it, and a helper that has
// spun past kYieldAfter yields its core on every further spin.
//
// Which thread computes a chunk changes no bits: every output element is computed whole by one call of the
// chunk's body (see cpu_kernels.cpp's row invariance).
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace specdeploy::step_team {

// One contiguous chunk per thread, as at::parallel_for splits (4 per thread measured the same, idle and with a
// busy process beside it); the shared counter still lets the caller take a missing helper's chunk.
constexpr int64_t kChunksPerThread = 1;
constexpr int64_t kYieldAfter = 1024;  // spins (PAUSE: tens to ~140 cycles each) before a waiting thread yields its core

struct Team {
  // even: the published task is `epoch`'s; odd: the caller is writing the next one (helpers keep out)
  std::atomic<uint64_t> epoch{0};
  std::atomic<int> active{0};  // helpers inside the current task
  std::atomic<bool> stop{false};
  std::atomic<int64_t> next{0};
  int64_t end = 0, chunk = 1;
  int threads = 1;  // the caller and its helpers
  // the loop's body, called through a plain pointer (no std::function to build per loop on the step's hot path)
  const void* body = nullptr;
  void (*call)(const void* body, int64_t begin, int64_t end) = nullptr;

  void take_chunks() {
    for (int64_t b = next.fetch_add(chunk); b < end; b = next.fetch_add(chunk)) call(body, b, std::min(b + chunk, end));
  }

  void helper() {
    uint64_t done = epoch.load();
    int64_t spins = 0;
    while (!stop.load()) {
      uint64_t e = epoch.load();
      if (e != done && e % 2 == 0) {
        active.fetch_add(1);
        if (epoch.load() == e) take_chunks();
        active.fetch_sub(1);
        done = e;
        spins = 0;
        continue;
      }
      _mm_pause();
      if (++spins > kYieldAfter) sched_yield();
    }
  }

  // The caller: publish [begin, end) in chunks, take chunks itself, then wait for helpers still in one.
  template <class F>
  void run(int64_t begin, int64_t stop_at, int64_t chunk_size, const F& fn) {
    epoch.fetch_add(1);  // odd: helpers that arrive now back off
    while (active.load() != 0) _mm_pause();  // only a helper that came late to the last task: it finds no chunk
    body = &fn;
    call = [](const void* f, int64_t b, int64_t e) { (*static_cast<const F*>(f))(b, e); };
    end = stop_at;
    chunk = chunk_size;
    next.store(begin);
    epoch.fetch_add(1);  // even: published
    take_chunks();
    for (int64_t spins = 0; active.load() != 0;) {
      _mm_pause();
      if (++spins > kYieldAfter) sched_yield();
    }
  }
};

// The team of the step the calling thread runs, or nullptr outside Decoder::forward.
inline thread_local Team* current = nullptr;

// As at::parallel_for(begin, end, grain, f), on the step's team where there is one.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = current;
  if (team == nullptr) return at::parallel_for(begin, end, grain, f);
  if (end <= begin) return;
  int threads = team->threads;
  // kChunksPerThread chunks per thread, none below the grain
  int64_t chunk = std::max<int64_t>({grain, 1, (end - begin + kChunksPerThread * threads - 1) / (kChunksPerThread * threads)});
  if (end - begin <= chunk) return f(begin, end);
  team->run(begin, end, chunk, f);
}

// Runs step() on the calling thread with the team of at::get_num_threads() threads behind parallel_for.
template <class Step>
void run_step(const Step& step) {
  int threads = at::get_num_threads();
  if (threads <= 1 || current != nullptr || omp_in_parallel()) return step();
  Team team;
  team.threads = threads;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      current = &team;
      try {
        step();
      } catch (...) {
        error = std::current_exception();
      }
      current = nullptr;
      team.stop.store(true);
    } else {
      team.helper();
    }
  }
  if (error) std::rethrow_exception(error);
}

// A team that outlives one step: between open() and close() on a thread, every parallel loop there (the decoder
// steps' run_step included) goes to the same helpers, which spin for it as a step's helpers do; outside, they sleep
// on a condition variable. BatchScheduler and Executor.generate open one around each engine step: the LM head,
// the requests' work between passes and the EAGLE-3 head's (a catch-up and ~2 draft passes, ~15 small parallel
// loops a round) would otherwise each open an OpenMP region, and under OMP_WAIT_POLICY=PASSIVE (the served stubs)
// each region wakes the sleeping thread again. Its helpers are std::threads made on the first open (never joined: the
// object is never destroyed, so process exit does not wait for them).
//
// While it stands, torch's own parallel loops (a logits copy, a cat: at::parallel_for on libgomp's pool) run on the
// calling thread alone (omp_set_num_threads(1) until close()): a libgomp worker they woke would spin on for its
// GOMP_SPINCOUNT after each loop (OMP_WAIT_POLICY's default), taking the second core from this team's helper: in
// process that made a step with a team slower than one without, and kept on the caller they are alike
// (docs/benchmarks.md "Rows, attention and the head on an AVX-512 EPYC"); under PASSIVE (the served stubs) it saves
// the futex wake of each such loop.
class Standing {
 public:
  static Standing& get() {
    static Standing* standing = new Standing();  // leaked on purpose (see above)
    return *standing;
  }

  // true where this call opened it (close() only then); false inside a step or another open team
  bool open() {
    int threads = at::get_num_threads();
    if (current != nullptr || omp_in_parallel() || threads <= 1) return false;
    while (static_cast<int>(helpers_.size()) < threads - 1) helpers_.emplace_back([this] { helper_main(); }).detach();
    team_.threads = threads;
    team_.stop.store(false);
    saved_threads_ = omp_get_max_threads();
    omp_set_num_threads(1);  // torch's loops on this thread alone while the team stands (see above)
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = true;
      ++generation_;
    }
    wake_.notify_all();
    current = &team_;
    return true;
  }

  // Does not wait for the helpers to leave: each finished the step's last loop before it returned (Team::run waits
  // for them), and one that lost its core in its spin leaves when it gets the core back and sees `stop`. Waiting for
  // that here put the whole wait on the step's critical path when another process held a core (docs/benchmarks.md
  // "Batched decode steps"). A helper still spinning
  // when the next open() comes simply stays: it serves the new steps' loops (Team::helper's epoch check keeps it off
  // a task it saw being published late).
  void close() {
    current = nullptr;
    omp_set_num_threads(saved_threads_);
    team_.stop.store(true);
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
  }

 private:
  void helper_main() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return running_ && generation_ != seen; });
        seen = generation_;
      }
      if (!team_.stop.load()) team_.helper();
    }
  }

  Team team_;
  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool running_ = false;
  int saved_threads_ = 1;  // the opening thread's OpenMP team size, restored by close()
  uint64_t generation_ = 0;
};

}  // namespace specdeploy::step_team
