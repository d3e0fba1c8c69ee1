#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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
#define SD_VERIFY_HAVE_AVX512 1
// The row loops are the whole cost. Each vector ISA gets the generic executor compiled for it
// (the walk and every functor the intrinsic loops do not cover) and, derived from it, the
// executor of src/verify_cpu_simd.inc, whose hot row loops are written once over a small vector
// layer (v256 for AVX2, v512 for AVX-512) with the same operation names. FMA is part of both
// targets (and required at run time, see cpu_isa) so that verify::ffma is one instruction in
// these loops, not a call to fmaf that keeps them from vectorising.

// ---- AVX2 ------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SD_CPU_EXEC CpuExecAvx2Generic
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC

// verify::combine_lanes of the 8 canonical lanes held in a register (both vector layers; AVX-512
// code may inline it, its target being a subset of theirs).
inline float combine_lanes(__m256 acc) {
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  return verify::combine_lanes(l);
}

namespace v256 {

using Vec = __m256;
using Mask = __m256;  // all-ones / all-zeros lanes, as the compares give them
using Index = __m256i;
constexpr int kWidth = 8;

inline Vec vload(const float* p, int64_t i) { return _mm256_loadu_ps(p + i); }
inline Vec vload(const verify::BFloat16* p, int64_t i) {
  // bf16 -> float is the 16 bits moved to the top (verify::load_elem / bf16_to_float).
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec set1_bits(uint32_t b) {
  return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(b)));
}
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
// MAXPS(v, m) = v > m ? v : m (a NaN v keeps m), the generic lane update.
inline Vec vmax(Vec v, Vec m) { return _mm256_max_ps(v, m); }
inline Mask gt(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask ge(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline Mask le(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline Mask unord(Vec v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
// verify::bad_prob: !(v >= 0 && v <= FLT_MAX), as two unordered-true compares.
inline Mask not_prob(Vec v) {
  return _mm256_or_ps(_mm256_cmp_ps(v, zero(), _CMP_NGE_UQ),
                      _mm256_cmp_ps(v, set1(verify::kFloatMax), _CMP_NLE_UQ));
}
inline Mask no_lanes() { return _mm256_setzero_ps(); }
inline Mask m_or(Mask a, Mask b) { return _mm256_or_ps(a, b); }
inline Mask m_and(Mask a, Mask b) { return _mm256_and_ps(a, b); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline Vec zero_unless(Mask m, Vec x) { return _mm256_and_ps(m, x); }
inline Vec select(Mask m, Vec if_set, Vec if_clear) {
  return _mm256_blendv_ps(if_clear, if_set, m);
}
// a * b where a lane is not in `removed`, else 0 (the product is taken in every lane; the values
// kept are the same).
inline Vec mul_unless(Mask removed, Vec a, Vec b) { return _mm256_andnot_ps(removed, mul(a, b)); }
inline Vec div_if(Mask m, Vec a, Vec b) { return _mm256_and_ps(m, _mm256_div_ps(a, b)); }
inline Index lane_index(int64_t i) {
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)),
                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Mask index_is(Index y, int32_t t) {
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(y, _mm256_set1_epi32(t)));
}
inline float reduce_max(Vec v) {
  // Exact in any order: the lanes hold no NaN (MAXPS keeps the running max over a NaN).
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// verify::exp_approx on 8 lanes, operation for operation (FMA = verify::ffma, one rounding),
// 2^n built from n's bits and one multiply as the definition does. A tiny x (<= -87, -inf or
// NaN) computes garbage here (no FP exception is ever inspected) and the final AND zeroes it, so
// the other lanes see exactly the definition's x. kClamp = false leaves the clamp to 88 out, for
// callers whose x is never above 88 (see v512::exp_v).
template <bool kClamp = true>
inline Vec exp_v(Vec x) {
  namespace c = verify::expc;
  const Mask keep = gt(x, set1(c::kTiny));  // !tiny (NaN: tiny)
  if constexpr (kClamp) x = _mm256_min_ps(x, set1(c::kHuge));
  const Vec magic = set1(c::kMagic);
  const Vec n = sub(_mm256_fmadd_ps(x, set1(c::kLog2e), magic), magic);
  const Vec r = _mm256_fmadd_ps(n, set1(-c::kLn2), x);
  Vec p = set1(c::kC5);
  p = _mm256_fmadd_ps(p, r, set1(c::kC4));
  p = _mm256_fmadd_ps(p, r, set1(c::kC3));
  p = _mm256_fmadd_ps(p, r, set1(c::kC2));
  p = _mm256_fmadd_ps(p, r, set1(1.0f));
  p = _mm256_fmadd_ps(p, r, set1(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
  const Vec scale = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  return zero_unless(keep, mul(p, scale));
}

// Adds the 8 weights of one vector to the 8 canonical lanes of its chunk (element i into lane
// i % 8), as verify::chunk_sum's lane loop does.
inline __m256 add_lanes(__m256 acc, Vec w) { return _mm256_add_ps(acc, w); }

#define SD_SIMD_BASE CpuExecAvx2Generic
#include "verify_cpu_simd.inc"
#undef SD_SIMD_BASE

}  // namespace v256

using CpuExecAvx2 = v256::SimdExec;

// v256::exp_v over an array (for verify_exp_approx); the tail runs through a padded vector.
void exp_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v256::vstore(y + i, v256::exp_v(v256::vload(x, i)));
  if (i < n) {
    alignas(32) float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = i; j < n; ++j) t[j - i] = x[j];
    v256::vstore(t, v256::exp_v(v256::vload(t, 0)));
    for (int64_t j = i; j < n; ++j) y[j] = t[j - i];
  }
}
#pragma GCC pop_options

// ---- AVX-512 ---------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
// GCC 12's AVX-512 intrinsics (_mm512_min_ps, _mm512_castps512_ps256 via extractf64x4,
// _mm512_cvtepu16_epi32, _mm512_slli_epi32, ...) pass _mm512_undefined_ps() & co., a
// self-initialised `__Y = __Y`, as the merge operand of a builtin whose mask is all ones, so that
// operand is never read; -Wmaybe-uninitialized still flags it once inlined here (GCC bug 105593,
// fixed in GCC 13). No value of this code depends on it, so the warning is off for this section.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define SD_CPU_EXEC CpuExecAvx512Generic
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC

namespace v512 {

using Vec = __m512;
using Mask = __mmask16;
using Index = __m512i;
constexpr int kWidth = 16;

inline Vec vload(const float* p, int64_t i) { return _mm512_loadu_ps(p + i); }
inline Vec vload(const verify::BFloat16* p, int64_t i) {
  // bf16 -> float is the 16 bits moved to the top (verify::load_elem / bf16_to_float).
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec set1_bits(uint32_t b) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(b)));
}
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// MAXPS(v, m) = v > m ? v : m (a NaN v keeps m), the generic lane update.
inline Vec vmax(Vec v, Vec m) { return _mm512_max_ps(v, m); }
inline Mask gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask ge(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Mask le(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline Mask unord(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
// verify::bad_prob, !(v >= 0 && v <= FLT_MAX), in one instruction: NaN (quiet 0x01, signalling
// 0x80), +inf (0x08), -inf (0x10) and negative non-zero finite values, denormals included
// (0x40); -0 passes, as v >= 0 does. (FPCLASS ignores MXCSR.DAZ, so under DAZ a negative
// denormal is still flagged here, as on the GPU, which has no DAZ.)
inline Mask not_prob(Vec v) { return _mm512_fpclass_ps_mask(v, 0xD9); }
inline Mask no_lanes() { return 0; }
inline Mask m_or(Mask a, Mask b) { return a | b; }
inline Mask m_and(Mask a, Mask b) { return a & b; }
inline bool any(Mask m) { return m != 0; }
inline Vec zero_unless(Mask m, Vec x) { return _mm512_maskz_mov_ps(m, x); }
inline Vec select(Mask m, Vec if_set, Vec if_clear) {
  return _mm512_mask_mov_ps(if_clear, m, if_set);
}
inline Vec mul_unless(Mask removed, Vec a, Vec b) {
  return _mm512_maskz_mul_ps(static_cast<Mask>(~removed), a, b);
}
inline Vec div_if(Mask m, Vec a, Vec b) { return _mm512_maskz_div_ps(m, a, b); }
inline Index lane_index(int64_t i) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline Mask index_is(Index y, int32_t t) {
  return _mm512_cmpeq_epi32_mask(y, _mm512_set1_epi32(t));
}
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }

// verify::exp_approx on 16 lanes, operation for operation (FMA = verify::ffma, one rounding).
// Two steps are written differently with the same results:
// * the clamp: exp_approx replaces a tiny x (<= -87, -inf or NaN) by 0 before computing and
//   returns 0 for it; here such a lane computes garbage (possibly NaN; no FP exception is ever
//   inspected) and only the final select zeroes it, so the non-tiny lanes see exactly the same x;
// * the scaling: fmul(p, 2^n) with 2^n built from n's bits equals SCALEF(p, n) = p * 2^floor(n),
//   for n is an integer in [-126, 127] on every non-tiny lane and both round the same exact
//   product p * 2^n once.
// kClamp = false leaves the clamp to 88 out, for callers whose x is never above 88: there
// MINPS(x, 88) = x, and a NaN lane is zeroed in the end either way. Every x = s_i - m_c of the
// row loops qualifies: m_c = fmul(chunk max raw, inv_temp) >= fmul(raw_i, inv_temp) = s_i for
// inv_temp > 0 (rounding is monotone), so x <= 0 or NaN.
template <bool kClamp = true>
inline Vec exp_v(Vec x) {
  namespace c = verify::expc;
  const Mask keep = gt(x, set1(c::kTiny));  // !tiny (NaN: tiny)
  // x < 88 ? x : 88 is MINPS(x, 88) exactly (a NaN x gives 88 here and 0 in the end).
  if constexpr (kClamp) x = _mm512_min_ps(x, set1(c::kHuge));
  const Vec magic = set1(c::kMagic);
  const Vec n = sub(_mm512_fmadd_ps(x, set1(c::kLog2e), magic), magic);
  const Vec r = _mm512_fmadd_ps(n, set1(-c::kLn2), x);
  Vec p = set1(c::kC5);
  p = _mm512_fmadd_ps(p, r, set1(c::kC4));
  p = _mm512_fmadd_ps(p, r, set1(c::kC3));
  p = _mm512_fmadd_ps(p, r, set1(c::kC2));
  p = _mm512_fmadd_ps(p, r, set1(1.0f));
  p = _mm512_fmadd_ps(p, r, set1(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// Adds the 16 weights of one vector to the 8 canonical lanes of its chunk: elements i .. i+7
// first, then i+8 .. i+15, as verify::chunk_sum's lane loop does.
inline __m256 add_lanes(__m256 acc, Vec w) {
  acc = _mm256_add_ps(acc, _mm512_castps512_ps256(w));
  return _mm256_add_ps(acc, _mm512_extractf32x8_ps(w, 1));
}

#define SD_SIMD_BASE CpuExecAvx512Generic
#include "verify_cpu_simd.inc"
#undef SD_SIMD_BASE

}  // namespace v512

using CpuExecAvx512 = v512::SimdExec;

// v512::exp_v over an array (for verify_exp_approx); the tail runs masked.
void exp_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, v512::exp_v(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, m, v512::exp_v(_mm512_maskz_loadu_ps(m, x + i)));
  }
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// SPECDECODE_CPU_ISA=baseline | avx2 caps the loops' instruction set (to check that all agree).
enum class Isa { kBaseline, kAvx2, kAvx512 };

Isa cpu_isa() {
  static const Isa isa = [] {
#ifdef SD_VERIFY_HAVE_AVX2
    const char* env = std::getenv("SPECDECODE_CPU_ISA");
    const std::string cap = env ? env : "";
    if (cap == "baseline") return Isa::kBaseline;
    // Both vector paths are compiled with FMA (verify::ffma as one instruction).
    const bool fma = __builtin_cpu_supports("fma");
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (fma && avx512 && cap != "avx2") return Isa::kAvx512;
    if (fma && __builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
    return Isa::kBaseline;
  }();
  return isa;
}

// The executor of the final draw's phases 2 and 3 as the CUDA kernels run them: each chunk's
// canonical sum taken lane by lane (verify::canonical_lane_sum for lanes 0..7, then
// verify::combine_lanes and verify::canonical_finish, which the GPU does with one thread per lane).
// Used when a call asks for final_slices >= 1, so that the CPU tests cover that arithmetic and the
// partition of the chunks into slices.
struct LaneExec {
  bool leader() const { return true; }
  template <class F>
  void range_sums(int64_t n, const F& f, int c_begin, int c_end, float* out) {
    for (int c = c_begin; c < c_end; ++c) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = std::min<int64_t>(begin + verify::kChunk, n);
      float lanes[8];
      for (int j = 0; j < 8; ++j) lanes[j] = verify::canonical_lane_sum(f, begin, end, j);
      out[c] = verify::canonical_finish(f, verify::combine_lanes(lanes), begin);
    }
  }
};

// Verifies sequence b: the walk (phase 1), the final draw's chunk sums (phase 2) and the pick
// (phase 3) of src/specdecode/verify.h, one after the other on this thread. The executor still
// holds the stop row's chunk maxima and scales and, for a draw from the row itself, its chunk
// sums in sums(0); phase 2 writes into sums(1), free once the walk is over.
// final_slices = 0: phase 2 in one range with the executor's own (vectorised) loops, the
// production path. final_slices >= 1: phases 2 and 3 with LaneExec, phase 2 in that many slices
// taken last slice first (any order gives the same sums), and the top-p search's tries by the
// shared verify::top_p_chunk_trial (exps included), as the CUDA backend runs them.
template <class Ex, class T, class Q>
void verify_one(Ex& ex, const verify::VerifyArgs& args, int64_t b, int final_slices,
                verify::FinalDraw& fd) {
  ex.set_cuda_search(final_slices >= 1);
  verify::walk_sequence<Ex, T, Q>(ex, args, b, fd);
  const verify::FinalRows rows{ex.chunk_max(), ex.chunk_scale(),
                               ex.sums(fd.form == verify::kFinalRow ? 0 : 1)};
  const int chunks = verify::num_chunks(args.vocab);
  if (final_slices == 0) {
    verify::final_chunk_sums<Ex, T, Q>(ex, args, b, fd, rows, 0, chunks);
    verify::finish_sequence<Ex, T, Q>(ex, args, b, fd, rows);
    return;
  }
  LaneExec lanes;
  for (int s = final_slices - 1; s >= 0; --s) {
    int c_begin = 0, c_end = 0;
    verify::slice_chunks(chunks, final_slices, s, &c_begin, &c_end);
    verify::final_chunk_sums<LaneExec, T, Q>(lanes, args, b, fd, rows, c_begin, c_end);
  }
  verify::finish_sequence<LaneExec, T, Q>(lanes, args, b, fd, rows);
}

template <class Ex, class T, class Q>
void run_range(const verify::VerifyArgs& args, int64_t begin, int64_t end, int final_slices) {
  // One executor per thread and ISA, reused across calls: its buffers are row-sized.
  static thread_local Ex ex;
  ex.reset(args.vocab);
  verify::FinalDraw fd;
  for (int64_t b = begin; b < end; ++b) verify_one<Ex, T, Q>(ex, args, b, final_slices, fd);
}

template <class T, class Q>
void run(const verify::VerifyArgs& args, int final_slices) {
  // A row costs a few passes over V; small vocabularies (statistical tests) batch many rows.
  const int64_t per_row = std::max<int64_t>(1, args.vocab * args.n);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_row);
  // Unused where no vector path is compiled (non-x86 targets).
  [[maybe_unused]] const Isa isa = cpu_isa();
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
#ifdef SD_VERIFY_HAVE_AVX2
    if (isa == Isa::kAvx512) return run_range<CpuExecAvx512, T, Q>(args, begin, end, final_slices);
    if (isa == Isa::kAvx2) return run_range<CpuExecAvx2, T, Q>(args, begin, end, final_slices);
#endif
    run_range<CpuExec, T, Q>(args, begin, end, final_slices);
  });
}

template <class Ex, class T>
void distribution_range(const verify::DistributionArgs& args, int64_t begin, int64_t end) {
  static thread_local Ex ex;
  ex.reset(args.vocab);
  ex.set_cuda_search(false);
  for (int64_t b = begin; b < end; ++b) verify::distribution_sequence<Ex, T>(ex, args, b);
}

template <class T>
void run_distribution(const verify::DistributionArgs& args) {
  // A row costs a few passes over V, as in run.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, args.vocab));
  // Unused where no vector path is compiled (non-x86 targets).
  [[maybe_unused]] const Isa isa = cpu_isa();
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
#ifdef SD_VERIFY_HAVE_AVX2
    if (isa == Isa::kAvx512) return distribution_range<CpuExecAvx512, T>(args, begin, end);
    if (isa == Isa::kAvx2) return distribution_range<CpuExecAvx2, T>(args, begin, end);
#endif
    distribution_range<CpuExec, T>(args, begin, end);
  });
}

template <class E>
void run_distribution_of(const verify::DistributionArgs& args) {
  if (args.logits) return run_distribution<E>(args);
  run_distribution<verify::Prob<E>>(args);
}

template <class T>
void run_draft(const verify::VerifyArgs& args, VerifyDType draft, int final_slices) {
  switch (draft) {
    case VerifyDType::kFloat16:
      return run<T, verify::Half>(args, final_slices);
    case VerifyDType::kBFloat16:
      return run<T, verify::BFloat16>(args, final_slices);
    default:
      // float32 draft, or none (null pointer, never read)
      return run<T, float>(args, final_slices);
  }
}

// Rows of probabilities are a different element type, so the logits' exp stays out of their
// loops.
template <class E>
void run_target(const verify::VerifyArgs& args, VerifyDType draft, int final_slices) {
  if (args.logits) return run_draft<E>(args, draft, final_slices);
  return run_draft<verify::Prob<E>>(args, draft, final_slices);
}

}  // namespace

void verify(const verify::VerifyArgs& args, VerifyDType target, VerifyDType draft,
            int final_slices) {
  switch (target) {
    case VerifyDType::kFloat16:
      return run_target<verify::Half>(args, draft, final_slices);
    case VerifyDType::kBFloat16:
      return run_target<verify::BFloat16>(args, draft, final_slices);
    default:
      return run_target<float>(args, draft, final_slices);
  }
}

void sampling_distribution(const verify::DistributionArgs& args, VerifyDType rows) {
  switch (rows) {
    case VerifyDType::kFloat16:
      return run_distribution_of<verify::Half>(args);
    case VerifyDType::kBFloat16:
      return run_distribution_of<verify::BFloat16>(args);
    default:
      return run_distribution_of<float>(args);
  }
}

const char* verify_isa() {
  switch (cpu_isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

int verify_exp_approx(const float* x, float* y, int64_t n, int isa) {
  const int have = static_cast<int>(cpu_isa());
  [[maybe_unused]] const int use = isa < have ? isa : have;  // unused off x86
#ifdef SD_VERIFY_HAVE_AVX2
  if (use == static_cast<int>(Isa::kAvx512)) {
    exp_avx512(x, y, n);
    return use;
  }
  if (use == static_cast<int>(Isa::kAvx2)) {
    exp_avx2(x, y, n);
    return use;
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = verify::exp_approx(x[i]);
  return static_cast<int>(Isa::kBaseline);
}

}  // namespace cpu
}  // namespace sd
