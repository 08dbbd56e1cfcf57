// A small cache of large output buffers for the allocating forms, quantize(x) and
// dequantize(q). Fresh memory costs a page fault and a kernel zero-fill per page on first
// touch, about as much as writing the data itself, and glibc returns large blocks to the
// kernel on free, so every call would pay it again. Freed buffers are kept (up to a byte
// limit, the most recently freed first) and handed out again; new ones are 2 MiB aligned
// and marked for transparent huge pages, so even a first touch faults 512x less often.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>

namespace prime_comm {

class BufferPool {
 public:
  static constexpr size_t kHuge = size_t(1) << 21;

  // A buffer of at least `bytes`; *cap receives its real size (pass it back to release).
  static void* acquire(size_t bytes, size_t* cap) {
    State& s = state();
    {
      std::lock_guard<std::mutex> lk(s.mu);
      // The smallest cached buffer that fits without wasting more than an eighth.
      auto best = s.cached.end();
      for (auto it = s.cached.begin(); it != s.cached.end(); ++it) {
        if (it->cap >= bytes && it->cap <= bytes + bytes / 8 + kHuge &&
            (best == s.cached.end() || it->cap < best->cap)) {
          best = it;
        }
      }
      if (best != s.cached.end()) {
        void* p = best->ptr;
        *cap = best->cap;
        s.total -= best->cap;
        s.cached.erase(best);
        return p;
      }
    }
    const size_t align = bytes >= kHuge ? kHuge : 4096;
    *cap = (bytes + align - 1) / align * align;
    void* p = nullptr;
    if (posix_memalign(&p, align, *cap) != 0) throw std::bad_alloc();
    if (align == kHuge) madvise(p, *cap, MADV_HUGEPAGE);  // a hint: ignored where THP is off
    return p;
  }

  static void release(void* p, size_t cap) {
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    if (cap > s.limit) {
      free(p);
      return;
    }
    s.cached.push_front({p, cap});
    s.total += cap;
    while (s.total > s.limit) {  // drop the least recently freed
      s.total -= s.cached.back().cap;
      free(s.cached.back().ptr);
      s.cached.pop_back();
    }
  }

  // Bytes of freed buffers the cache may keep; 0 frees them all and keeps none.
  static void set_limit(size_t bytes) {
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    s.limit = bytes;
    while (s.total > s.limit) {
      s.total -= s.cached.back().cap;
      free(s.cached.back().ptr);
      s.cached.pop_back();
    }
  }

  static size_t limit() { return state().limit; }

  static size_t cached_bytes() {
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    return s.total;
  }

 private:
  struct Entry {
    void* ptr;
    size_t cap;
  };
  struct State {
    std::mutex mu;
    std::deque<Entry> cached;
    size_t total = 0;
    size_t limit = size_t(512) << 20;
  };
  static State& state() {
    static State* s = new State();  // never destroyed: buffers may be freed at exit
    static pid_t owner = getpid();
    if (owner != getpid()) {
      // A forked child: the mutex may have been held by a thread that no longer exists.
      new (&s->mu) std::mutex();
      owner = getpid();
    }
    return *s;
  }
};

// The memory behind one allocating call's result; Python keeps it alive through the
// tensor made from it (torch.frombuffer) and returns it to the pool when that dies.
class Buffer {
 public:
  explicit Buffer(int64_t bytes) : size_(static_cast<size_t>(bytes)) {
    ptr_ = BufferPool::acquire(size_, &cap_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { BufferPool::release(ptr_, cap_); }
  void* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  size_t size_;
  size_t cap_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace prime_comm
