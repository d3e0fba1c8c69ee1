// Test hook for the math shared by the CPU core and the CUDA kernels (host_device.h): the 16-bit
// float conversions, which the device computes with its own instructions and the host with bit
// code. The tests compare the two on every fp16 pattern.
#include <cstdint>
#include <string>

#include "array.h"
#include "dispatch.h"
#include "registry.h"
#include "specdecode/host_device.h"

#ifdef SPECDECODE_WITH_CUDA
#include "halves.cuh"
#endif

namespace sd {
namespace {

// float16 src [N] -> float32 out [N] by half_to_float, or float32 src -> float16 out by
// float_to_half, on the arrays' device.
void convert_16bit(py::handle src_obj, py::handle out_obj, std::intptr_t stream) {
  Array src = Array::from_python(src_obj, "src");
  src.expect_dtype({DType::kFloat16, DType::kFloat32}).expect_ndim(1).expect_contiguous();
  Array out = Array::from_python(out_obj, "out", true);
  const bool to_float = src.dtype() == DType::kFloat16;
  out.expect_dtype({to_float ? DType::kFloat32 : DType::kFloat16})
      .expect_shape({src.size(0)}, {"N"})
      .expect_contiguous()
      .expect_same_device(src);
  const int64_t n = src.size(0);
  const DeviceScope device_scope = prepare_device(src);
  const bool on_cuda = device_scope.on_cuda();
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    if (to_float) {
      const uint16_t* in = src.data<uint16_t>();
      float* o = out.data<float>();
      for (int64_t i = 0; i < n; ++i) o[i] = half_to_float(in[i]);
    } else {
      const float* in = src.data<float>();
      uint16_t* o = out.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = float_to_half(in[i]);
    }
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::convert_halves(src.raw(), out.raw(), n, to_float, as_stream(stream)),
             "convert_16bit");
#endif
}

}  // namespace

void register_host_device_ops(py::module_& m) {
  m.def("convert_16bit", &convert_16bit, py::arg("src"), py::arg("out"), py::arg("stream") = 0,
        "float16 src -> float32 out (or float32 -> float16) by the conversions the kernels use, on "
        "the arrays' device (the host's bit code, the GPU's cvt instructions). For tests.");
}

}  // namespace sd
