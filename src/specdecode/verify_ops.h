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

// The sampling distribution of every row of `args` (verify::distribution_sequence), threaded
// over the rows; `rows` is the element type of args.rows.
void sampling_distribution(const verify::DistributionArgs& args, VerifyDType rows);

// The row loops verify runs on this CPU: "avx512", "avx2" or "baseline" (the portable loops,
// the only ones off x86), after SPECDECODE_CPU_ISA's cap.
const char* verify_isa();

// y[i] = verify::exp_approx(x[i]) computed by the exp of the row loops of ISA `isa` (0 baseline,
// 1 AVX2, 2 AVX-512), capped to what this CPU runs (and to SPECDECODE_CPU_ISA); returns the ISA
// used. For the tests of the exp's accuracy and of its bit-equality across ISAs.
int verify_exp_approx(const float* x, float* y, int64_t n, int isa);

// The work of verify::top_p_settling_search as one CUDA block does it (cuda/verify.cu), counted
// on one thread: the threshold it ends on (top_p_bisect's), its tries, its histogram passes and
// the 256-token chunks read by both (one thread's loop over a chunk in the kernel).
struct TopPWork {
  uint32_t threshold;
  int tries;
  int histograms;
  int64_t chunk_reads;
};

// That work for a row of n weights (finite, >= 0, one at least > 0) and a wanted mass > 0, with
// the histograms' first tries (histograms = true, as the kernel runs it) or without them.
TopPWork top_p_search_work(const float* weights, int64_t n, float wanted, bool histograms);

}  // namespace cpu
}  // namespace sd
