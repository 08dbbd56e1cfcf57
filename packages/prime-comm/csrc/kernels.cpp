// pybind11 bindings for the prime_comm kernels. They take raw buffer addresses and lengths
// (tensor.data_ptr(), numel()) that the Python layer has validated, so the extension never
// links libtorch. Every entry point releases the GIL and splits its work into blocks that
// the thread pool runs; a block is always handled by one thread, start to end.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "quant.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace prime_comm;

namespace {

// (address, number of elements, address) triples: source and destination of one job.
using Job = std::tuple<std::uintptr_t, int64_t, std::uintptr_t>;

struct BlockRef {
  int64_t job;
  int64_t block;
};

std::vector<BlockRef> blocks_of(const std::vector<Job>& jobs) {
  std::vector<BlockRef> refs;
  for (int64_t j = 0; j < static_cast<int64_t>(jobs.size()); ++j) {
    const int64_t n = std::get<1>(jobs[j]);
    if (n < 0) throw std::invalid_argument("negative element count");
    for (int64_t b = 0; b < num_blocks(n); ++b) refs.push_back({j, b});
  }
  return refs;
}

// Quantizes each job (float32 source, n, encoded destination of encoded_bytes(n)).
// Returns the index of the first job that holds a NaN or Inf, or -1.
int64_t quantize_many(const std::vector<Job>& jobs) {
  const auto refs = blocks_of(jobs);
  std::atomic<int64_t> bad{INT64_MAX};
  {
    py::gil_scoped_release release;
    Pools::run(static_cast<int64_t>(refs.size()), [&](int64_t t) {
      const auto [src, n, dst] = jobs[refs[t].job];
      const int64_t b = refs[t].block;
      const int64_t len = std::min(kBlock, n - b * kBlock);
      const float* x = reinterpret_cast<const float*>(src) + b * kBlock;
      uint8_t* base = reinterpret_cast<uint8_t*>(dst);
      float* cb = reinterpret_cast<float*>(base + b * kCodebookBytes);
      uint8_t* codes = base + num_blocks(n) * kCodebookBytes + b * kBlock;
      if (!quantize_block(x, len, cb, codes, b + 1 < num_blocks(n))) {
        int64_t cur = bad.load();
        while (refs[t].job < cur && !bad.compare_exchange_weak(cur, refs[t].job)) {
        }
      }
    });
  }
  const int64_t first = bad.load();
  return first == INT64_MAX ? -1 : first;
}

// Decodes each job (encoded source, n, float32 destination); accumulate adds into it.
void dequantize_many(const std::vector<Job>& jobs, bool accumulate) {
  const auto refs = blocks_of(jobs);
  py::gil_scoped_release release;
  Pools::run(static_cast<int64_t>(refs.size()), [&](int64_t t) {
    const auto [src, n, dst] = jobs[refs[t].job];
    const int64_t b = refs[t].block;
    const int64_t len = std::min(kBlock, n - b * kBlock);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(src);
    const float* cb = reinterpret_cast<const float*>(base + b * kCodebookBytes);
    const uint8_t* codes = base + num_blocks(n) * kCodebookBytes + b * kBlock;
    float* out = reinterpret_cast<float*>(dst) + b * kBlock;
    if (accumulate) {
      decode_block<1>(cb, codes, len, out);
    } else {
      decode_block<0>(cb, codes, len, out);
    }
  });
}

// out[:n] += decode(src) for each encoded source in the given order, then out /= divisor
// (skipped when divisor == 1). The reduce step of the all-reduce, one pass per block.
void reduce_into(std::uintptr_t out_ptr, int64_t n, const std::vector<std::uintptr_t>& srcs,
                 float divisor) {
  if (n < 0) throw std::invalid_argument("negative element count");
  py::gil_scoped_release release;
  const int64_t nb = num_blocks(n);
  Pools::run(nb, [&](int64_t b) {
    const int64_t len = std::min(kBlock, n - b * kBlock);
    float* out = reinterpret_cast<float*>(out_ptr) + b * kBlock;
    for (const std::uintptr_t src : srcs) {
      const uint8_t* base = reinterpret_cast<const uint8_t*>(src);
      const float* cb = reinterpret_cast<const float*>(base + b * kCodebookBytes);
      decode_block<1>(cb, base + nb * kCodebookBytes + b * kBlock, len, out);
    }
    if (divisor != 1.0f) divide_block(out, len, divisor);
  });
}

// True when none of the n floats is NaN or Inf.
bool all_finite(std::uintptr_t ptr, int64_t n) {
  if (n < 0) throw std::invalid_argument("negative element count");
  std::atomic<bool> ok{true};
  py::gil_scoped_release release;
  Pools::run(num_blocks(n), [&](int64_t b) {
    float lo, hi;
    const int64_t len = std::min(kBlock, n - b * kBlock);
    if (!minmax(reinterpret_cast<const float*>(ptr) + b * kBlock, len, &lo, &hi)) ok = false;
  });
  return ok.load();
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("thread count must be at least 1");
  Pools::set_num_threads(n);
}

std::string simd() { return use_avx2() ? "avx2" : "scalar"; }

// Test hook: force the portable path (or back to AVX2 when the CPU has it).
void set_simd(const std::string& which) {
  if (which == "scalar") {
    use_avx2() = false;
  } else if (which == "avx2") {
    if (!cpu_has_avx2()) throw std::invalid_argument("this CPU has no AVX2");
    use_avx2() = true;
  } else {
    throw std::invalid_argument("simd must be 'scalar' or 'avx2'");
  }
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "prime_comm C++ kernels (raw-buffer interface, no libtorch)";
  m.attr("BLOCK") = kBlock;
  m.attr("LEVELS") = kLevels;
  m.def("encoded_bytes", &encoded_bytes, py::arg("n"));
  m.def("quantize_many", &quantize_many, py::arg("jobs"));
  m.def("dequantize_many", &dequantize_many, py::arg("jobs"), py::arg("accumulate"));
  m.def("reduce_into", &reduce_into, py::arg("out"), py::arg("n"), py::arg("srcs"),
        py::arg("divisor"));
  m.def("all_finite", &all_finite, py::arg("ptr"), py::arg("n"));
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &Pools::num_threads);
  m.def("simd", &simd);
  m.def("set_simd", &set_simd, py::arg("which"));
}
