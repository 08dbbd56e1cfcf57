// A small persistent thread pool for the kernels. Work is split into tasks (one per block),
// and each task is run start to finish by exactly one thread, so the output never depends on
// the thread count. One call runs at a time; the pool is rebuilt after fork() (threads do
// not survive a fork, so the child gets a fresh pool and the parent's copy is leaked).
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace prime_comm {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) { resize(num_threads); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Stops the current workers and starts num_threads - 1 new ones (the caller is the last).
  void resize(int num_threads) {
    stop_workers();
    for (int id = 0; id < num_threads - 1; ++id) {
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
  }

  // Runs fn(0..ntasks-1) on up to size() threads and returns when all tasks are done.
  void run(int64_t ntasks, const std::function<void(int64_t)>& fn) {
    if (ntasks <= 0) return;
    const int helpers = static_cast<int>(std::min<int64_t>(workers_.size(), ntasks - 1));
    if (helpers == 0) {
      for (int64_t i = 0; i < ntasks; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      ntasks_ = ntasks;
      next_.store(0);
      wanted_ = helpers;
      busy_ = helpers;
      ++generation_;
    }
    work_cv_.notify_all();
    drain();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

  ~ThreadPool() { stop_workers(); }

 private:
  void drain() {
    for (;;) {
      const int64_t i = next_.fetch_add(1);
      if (i >= ntasks_) return;
      (*fn_)(i);
    }
  }

  void worker_loop(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (id >= wanted_) continue;
      lk.unlock();
      drain();
      lk.lock();
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stopping_ = false;
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t ntasks_ = 0;
  uint64_t generation_ = 0;
  int wanted_ = 0;
  int busy_ = 0;
  bool stopping_ = false;
};

inline int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Process-wide pool state, rebuilt in a forked child.
struct PoolState {
  std::mutex call_mu;
  ThreadPool pool;
  pid_t pid;
  explicit PoolState(int n) : pool(n), pid(getpid()) {}
};

class Pools {
 public:
  static void set_num_threads(int n) { desired().store(n); }
  static int num_threads() { return desired().load(); }

  // Runs fn over ntasks with the configured thread count (callers are serialised).
  static void run(int64_t ntasks, const std::function<void(int64_t)>& fn) {
    if (ntasks <= 0) return;
    const int want = desired().load();
    if (want <= 1 || ntasks == 1) {
      for (int64_t i = 0; i < ntasks; ++i) fn(i);
      return;
    }
    PoolState* s = state(want);
    std::lock_guard<std::mutex> lk(s->call_mu);
    if (s->pool.size() != want) s->pool.resize(want);
    s->pool.run(ntasks, fn);
  }

 private:
  static std::atomic<int>& desired() {
    static std::atomic<int> n{available_cpus()};
    return n;
  }
  static PoolState* state(int n) {
    static std::mutex mu;
    static PoolState* s = nullptr;
    static pid_t owner = getpid();  // thread-safe static init; differs only in a forked child
    if (owner != getpid()) {
      // After fork the inherited mutex and threads are unusable: start over (leak the old).
      new (&mu) std::mutex();
      s = nullptr;
      owner = getpid();
    }
    std::lock_guard<std::mutex> lk(mu);
    if (s == nullptr) s = new PoolState(n);  // never freed: workers may outlive static dtors
    return s;
  }
};

}  // namespace prime_comm
