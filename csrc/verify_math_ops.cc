// A test hook for the arithmetic of batched verification: the exp that turns logits into weights,
// as each CPU instruction set's row loops compute it (src/specdecode/verify.h, src/verify.cc).
#include <cstdint>
#include <string>

#include "array.h"
#include "registry.h"
#include "specdecode/verify_ops.h"

namespace sd {
namespace {

// out[i] = verify::exp_approx(x[i]) by the loops of `isa` (0 baseline, 1 AVX2, 2 AVX-512; capped
// to the CPU); returns the ISA that ran.
int verify_exp_binding(py::handle x_obj, py::handle out_obj, int isa) {
  Array x = Array::from_python(x_obj, "x");
  x.expect_dtype({DType::kFloat32}).expect_ndim(1).expect_contiguous();
  Array out = Array::from_python(out_obj, "out", true);
  out.expect_dtype({DType::kFloat32}).expect_shape({x.size(0)}, {"N"}).expect_contiguous();
  for (const Array* a : {&x, &out}) {
    if (a->device().kind != DeviceKind::kCPU)
      throw_value_error(std::string(a->name()) + ": expected a CPU array");
  }
  if (isa < 0 || isa > 2) throw_value_error("isa: expected 0, 1 or 2, got " + std::to_string(isa));
  const float* xp = x.data<float>();
  float* yp = out.data<float>();
  const int64_t n = x.size(0);
  py::gil_scoped_release nogil;
  return cpu::verify_exp_approx(xp, yp, n, isa);
}

}  // namespace

void register_verify_math_ops(py::module_& m) {
  m.def("verify_exp_approx", &verify_exp_binding, py::arg("x"), py::arg("out"), py::arg("isa"),
        "verify's exp of float32 x into out by the row loops of an instruction set (0 baseline, "
        "1 AVX2, 2 AVX-512; capped to the CPU); returns the one that ran. For tests.");
}

}  // namespace sd
