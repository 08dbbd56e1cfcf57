// uint8 quantization kernels for prime_comm. They take raw buffers (checked by the Python
// layer), so the extension never links libtorch.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

namespace {

// Placeholder kernel until the real quantizer lands: sums a float32 buffer.
double sum_f32(std::uintptr_t ptr, std::int64_t n) {
    const float* x = reinterpret_cast<const float*>(ptr);
    double acc = 0.0;
    {
        py::gil_scoped_release release;
        for (std::int64_t i = 0; i < n; ++i) acc += x[i];
    }
    return acc;
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "prime_comm C++ kernels (raw-buffer interface, no libtorch)";
    m.def("sum_f32", &sum_f32, py::arg("ptr"), py::arg("n"));
}
