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

#include "buffer_pool.h"
#include "decode.h"
#include "lowbit.h"
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

void check_bits(int bits) {
  if (bits != 8 && bits != 4 && bits != 2) throw std::invalid_argument("bits must be 8, 4 or 2");
}

// Where block b of an encoding of n elements at `base` keeps its codebook and its codes.
struct BlockAt {
  int64_t len;
  int64_t cb_off;
  int64_t codes_off;
};

inline BlockAt block_at(int64_t n, int64_t b, int bits) {
  const int64_t cbb = codebook_bytes(bits);
  return {std::min(kBlock, n - b * kBlock), b * cbb, num_blocks(n) * cbb + b * kBlock * bits / 8};
}

inline bool quantize_one(int bits, const float* x, int64_t len, float* cb, uint8_t* codes,
                         bool more) {
  switch (bits) {
    case 4:
      return lowbit::quantize_block<4>(x, len, cb, codes, more);
    case 2:
      return lowbit::quantize_block<2>(x, len, cb, codes, more);
    default:
      return quantize_block(x, len, cb, codes, more);
  }
}

template <int Mode>
inline void decode_one(int bits, const float* cb, const uint8_t* codes, int64_t len, float* out,
                       bool stream = false) {
  switch (bits) {
    case 4:
      lowbit::decode_block<4, Mode>(cb, codes, len, out, stream);
      break;
    case 2:
      lowbit::decode_block<2, Mode>(cb, codes, len, out, stream);
      break;
    default:
      decode_block<Mode>(cb, codes, len, out, stream);
  }
}

// Quantizes each job (float32 source, n, encoded destination of encoded_bytes(n, bits)).
// Returns the index of the first job that holds a NaN or Inf, or -1.
int64_t quantize_many(const std::vector<Job>& jobs, int bits) {
  check_bits(bits);
  const auto refs = blocks_of(jobs);
  std::atomic<int64_t> bad{INT64_MAX};
  {
    py::gil_scoped_release release;
    Pools::run(static_cast<int64_t>(refs.size()), [&](int64_t t) {
      const auto [src, n, dst] = jobs[refs[t].job];
      const int64_t b = refs[t].block;
      const BlockAt at = block_at(n, b, bits);
      const float* x = reinterpret_cast<const float*>(src) + b * kBlock;
      uint8_t* base = reinterpret_cast<uint8_t*>(dst);
      float* cb = reinterpret_cast<float*>(base + at.cb_off);
      if (!quantize_one(bits, x, at.len, cb, base + at.codes_off, b + 1 < num_blocks(n))) {
        int64_t cur = bad.load();
        while (refs[t].job < cur && !bad.compare_exchange_weak(cur, refs[t].job)) {
        }
      }
    });
  }
  const int64_t first = bad.load();
  return first == INT64_MAX ? -1 : first;
}

// Outputs at least this large are written with streaming stores: they cannot stay in the
// cache anyway, and a plain store would first read every destination line from memory.
constexpr int64_t kStreamBytes = int64_t(16) << 20;

// Decodes each job (encoded source, n, float32 destination); accumulate adds into it.
void dequantize_many(const std::vector<Job>& jobs, bool accumulate, int bits) {
  check_bits(bits);
  const auto refs = blocks_of(jobs);
  int64_t total = 0;
  for (const auto& job : jobs) total += std::get<1>(job);
  const bool stream = !accumulate && total * int64_t(sizeof(float)) >= kStreamBytes;
  py::gil_scoped_release release;
  Pools::run(static_cast<int64_t>(refs.size()), [&](int64_t t) {
    const auto [src, n, dst] = jobs[refs[t].job];
    const int64_t b = refs[t].block;
    const BlockAt at = block_at(n, b, bits);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(src);
    const float* cb = reinterpret_cast<const float*>(base + at.cb_off);
    float* out = reinterpret_cast<float*>(dst) + b * kBlock;
    if (accumulate) {
      decode_one<1>(bits, cb, base + at.codes_off, at.len, out);
    } else {
      decode_one<0>(bits, cb, base + at.codes_off, at.len, out, stream);
      if (stream) store_fence();  // streamed stores are visible before the block is done
    }
  });
}

// out[:n] += decode(src) for each encoded source in the given order, then out /= divisor
// (skipped when divisor == 1). The reduce step of the all-reduce, one pass per block.
void reduce_into(std::uintptr_t out_ptr, int64_t n, const std::vector<std::uintptr_t>& srcs,
                 float divisor, int bits) {
  check_bits(bits);
  if (n < 0) throw std::invalid_argument("negative element count");
  py::gil_scoped_release release;
  Pools::run(num_blocks(n), [&](int64_t b) {
    const BlockAt at = block_at(n, b, bits);
    float* out = reinterpret_cast<float*>(out_ptr) + b * kBlock;
    for (const std::uintptr_t src : srcs) {
      const uint8_t* base = reinterpret_cast<const uint8_t*>(src);
      decode_one<1>(bits, reinterpret_cast<const float*>(base + at.cb_off), base + at.codes_off,
                    at.len, out);
    }
    if (divisor != 1.0f) divide_block(out, at.len, divisor);
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

std::string simd() { return simd_name(simd_level()); }

// Test hook: run a lower SIMD level (or back up to what the CPU has).
void set_simd(const std::string& which) {
  Simd want;
  if (which == "scalar") {
    want = Simd::kScalar;
  } else if (which == "avx2") {
    want = Simd::kAvx2;
  } else if (which == "avx512") {
    want = Simd::kAvx512;
  } else {
    throw std::invalid_argument("simd must be 'scalar', 'avx2' or 'avx512'");
  }
  if (static_cast<int>(want) > static_cast<int>(cpu_simd())) {
    throw std::invalid_argument(std::string("this CPU has no ") + which);
  }
  simd_level() = want;
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "prime_comm C++ kernels (raw-buffer interface, no libtorch)";
  m.attr("BLOCK") = kBlock;
  m.attr("LEVELS") = kLevels;
  m.attr("BITS") = py::make_tuple(8, 4, 2);
  m.def(
      "encoded_bytes",
      [](int64_t n, int bits) {
        check_bits(bits);
        if (n < 0) throw std::invalid_argument("negative element count");
        return encoded_bytes(n, bits);
      },
      py::arg("n"), py::arg("bits") = 8);
  m.def("quantize_many", &quantize_many, py::arg("jobs"), py::arg("bits") = 8);
  m.def("dequantize_many", &dequantize_many, py::arg("jobs"), py::arg("accumulate"),
        py::arg("bits") = 8);
  m.def("reduce_into", &reduce_into, py::arg("out"), py::arg("n"), py::arg("srcs"),
        py::arg("divisor"), py::arg("bits") = 8);
  m.def("all_finite", &all_finite, py::arg("ptr"), py::arg("n"));
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &Pools::num_threads);
  m.def("simd", &simd);
  m.def("set_simd", &set_simd, py::arg("which"));
  m.def("cpu_simd", [] { return std::string(simd_name(cpu_simd())); });
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol(),
                     "Pooled memory for one allocating call's result (see buffer_pool.h)")
      .def(py::init([](int64_t nbytes) {
             if (nbytes <= 0) throw std::invalid_argument("buffer size must be positive");
             return new Buffer(nbytes);
           }),
           py::arg("nbytes"))
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });
  m.def("set_buffer_cache_limit", [](int64_t n) {
    if (n < 0) throw std::invalid_argument("cache limit must be >= 0");
    BufferPool::set_limit(static_cast<size_t>(n));
  });
  m.def("buffer_cache_limit", [] { return static_cast<int64_t>(BufferPool::limit()); });
  m.def("cached_buffer_bytes", [] { return static_cast<int64_t>(BufferPool::cached_bytes()); });
}
