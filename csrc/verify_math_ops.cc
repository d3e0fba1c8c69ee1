// Test hooks for the arithmetic of batched verification: the exp that turns logits into weights,
// as each CPU instruction set's row loops compute it (src/specdecode/verify.h, src/verify.cc),
// and the top-p search's work as the CUDA kernel does it (src/verify_top_p_work.cc).
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

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

// (threshold bit pattern, tries, histogram passes, chunk reads) of the top-p search over a row of
// weights (float32 [V], finite, >= 0, one > 0) for a wanted mass > 0 (cpu::top_p_search_work).
std::tuple<uint32_t, int, int, int64_t> top_p_work_binding(py::handle weights_obj, double wanted,
                                                           bool histograms) {
  Array weights = Array::from_python(weights_obj, "weights");
  weights.expect_dtype({DType::kFloat32}).expect_ndim(1).expect_contiguous();
  if (weights.device().kind != DeviceKind::kCPU) throw_value_error("weights: expected a CPU array");
  const int64_t n = weights.size(0);
  if (n < 1 || n > verify::kMaxVocab) {
    throw_value_error("weights: expected 1 <= V <= " + std::to_string(verify::kMaxVocab) +
                      ", got " + std::to_string(n));
  }
  const float* w = weights.data<float>();
  bool positive = false;
  for (int64_t i = 0; i < n; ++i) {
    if (!(w[i] >= 0.f) || std::isinf(w[i])) {
      throw_value_error("weights: expected finite values >= 0, got " + std::to_string(w[i]) +
                        " at " + std::to_string(i));
    }
    positive = positive || w[i] > 0.f;
  }
  if (!positive) throw_value_error("weights: expected at least one value > 0");
  const float wanted_f = static_cast<float>(wanted);
  if (!(wanted_f > 0.f) || std::isinf(wanted_f)) {
    throw_value_error("wanted: expected a finite mass > 0, got " + std::to_string(wanted));
  }
  py::gil_scoped_release nogil;
  const cpu::TopPWork r = cpu::top_p_search_work(w, n, wanted_f, histograms);
  return {r.threshold, r.tries, r.histograms, r.chunk_reads};
}

}  // namespace

void register_verify_math_ops(py::module_& m) {
  m.def("verify_exp_approx", &verify_exp_binding, py::arg("x"), py::arg("out"), py::arg("isa"),
        "verify's exp of float32 x into out by the row loops of an instruction set (0 baseline, "
        "1 AVX2, 2 AVX-512; capped to the CPU); returns the one that ran. For tests.");
  m.def("top_p_search_work", &top_p_work_binding, py::arg("weights"), py::arg("wanted"),
        py::arg("histograms"),
        "The top-p search over float32 weights [V] as one CUDA block runs it, counted on the CPU: "
        "(threshold bit pattern, tries, histogram passes, 256-token chunk reads). For tests and "
        "bench/top_p_work.py.");
}

}  // namespace sd
