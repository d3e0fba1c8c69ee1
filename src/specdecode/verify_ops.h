// Batched verification on the CPU. See src/specdecode/verify.h for the semantics and
// python/specdecode/_ops/verify.py for the documented API.
#pragma once

#include <cstdint>

#include "specdecode/verify.h"

namespace sd {
namespace cpu {

// Element type codes of the target / draft rows.
enum class VerifyDType : int32_t { kNone = -1, kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Verifies every sequence of `args` (threaded over the batch; results do not depend on the
// number of threads). final_slices = 0 is the production path; final_slices >= 1 (a testing
// knob) runs the final draw's phases as the CUDA backend does, its chunk sums in that many
// slices (see verify_one in src/verify.cc); the results are the same.
void verify(const verify::VerifyArgs& args, VerifyDType target, VerifyDType draft,
            int final_slices = 0);

// y[i] = verify::exp_approx(x[i]) computed by the exp of the row loops of ISA `isa` (0 baseline,
// 1 AVX2, 2 AVX-512), capped to what this CPU runs (and to SPECDECODE_CPU_ISA); returns the ISA
// used. For the tests of the exp's accuracy and of its bit-equality across ISAs.
int verify_exp_approx(const float* x, float* y, int64_t n, int isa);

}  // namespace cpu
}  // namespace sd
