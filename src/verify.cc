#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "specdecode/parallel.h"
#include "specdecode/verify.h"
#include "specdecode/verify_ops.h"

namespace sd {
namespace cpu {

namespace {

using verify::ScanResult;

#define SD_CPU_EXEC CpuExec
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC

#if defined(__x86_64__) && defined(__GNUC__)
#define SD_VERIFY_HAVE_AVX2 1
// The row loops are the whole cost; compiled for AVX2 they run about twice as wide. The walk
// around them stays baseline code and calls into these methods.
#pragma GCC push_options
#pragma GCC target("avx2")
#define SD_CPU_EXEC CpuExecAvx2
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC
#pragma GCC pop_options
#endif

// SPECDECODE_CPU_ISA=baseline forces the baseline loops (to check that both agree).
bool use_avx2() {
#ifdef SD_VERIFY_HAVE_AVX2
  static const bool enabled = [] {
    const char* isa = std::getenv("SPECDECODE_CPU_ISA");
    if (isa && std::string(isa) == "baseline") return false;
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return enabled;
#else
  return false;
#endif
}

template <class T, class Q>
void run(const verify::VerifyArgs& args) {
  // A row costs a few passes over V; small vocabularies (statistical tests) batch many rows.
  const int64_t per_row = std::max<int64_t>(1, args.vocab * args.n);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_row);
  const bool avx2 = use_avx2();
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
#ifdef SD_VERIFY_HAVE_AVX2
    if (avx2) {
      CpuExecAvx2 ex(args.vocab);
      for (int64_t b = begin; b < end; ++b) verify::verify_sequence<CpuExecAvx2, T, Q>(ex, args, b);
      return;
    }
#endif
    CpuExec ex(args.vocab);
    for (int64_t b = begin; b < end; ++b) verify::verify_sequence<CpuExec, T, Q>(ex, args, b);
  });
}

template <class T>
void run_draft(const verify::VerifyArgs& args, VerifyDType draft) {
  switch (draft) {
    case VerifyDType::kFloat16:
      return run<T, verify::Half>(args);
    case VerifyDType::kBFloat16:
      return run<T, verify::BFloat16>(args);
    default:
      return run<T, float>(args);  // float32 draft, or none (null pointer, never read)
  }
}

// Rows of probabilities are a different element type, so the logits' exp stays out of their
// loops.
template <class E>
void run_target(const verify::VerifyArgs& args, VerifyDType draft) {
  if (args.logits) return run_draft<E>(args, draft);
  return run_draft<verify::Prob<E>>(args, draft);
}

}  // namespace

void verify(const verify::VerifyArgs& args, VerifyDType target, VerifyDType draft) {
  switch (target) {
    case VerifyDType::kFloat16:
      return run_target<verify::Half>(args, draft);
    case VerifyDType::kBFloat16:
      return run_target<verify::BFloat16>(args, draft);
    default:
      return run_target<float>(args, draft);
  }
}

}  // namespace cpu
}  // namespace sd
