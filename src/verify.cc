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
// The row loops are the whole cost; compiled for AVX2 they run about twice as wide. The walk
// around them stays baseline code and calls into these methods. FMA is part of the target (and
// required at run time, see cpu_isa) so that verify::ffma is one instruction in these loops, not
// a call to fmaf that keeps them from vectorising.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SD_CPU_EXEC CpuExecAvx2
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC
// verify::exp_approx as the AVX2 row loops compile it (for verify_exp_approx).
void exp_avx2(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = verify::exp_approx(x[i]);
}
#pragma GCC pop_options

// ---- AVX-512 ---------------------------------------------------------------------------------
// The three loops that read whole rows on every visited node (the scan, the target weights with
// their chunk sums, the first residual with its chunk sums) written with AVX-512 intrinsics for
// float32 and bfloat16 rows; every other functor and element type runs the generic loops
// compiled for AVX-512. Each intrinsic loop performs exactly the operations of the shared
// SD_HOST_DEVICE definition it replaces (verify::exp_approx, RowWeight, FirstResidualWeight,
// verify::chunk_sum), element by element and in the same order: IEEE single-precision
// mul/add/sub/compare, and a fused multiply-add exactly where the definition has verify::ffma
// (never a contraction of its own), so the results are bit-identical to the generic path and to
// the CUDA kernel. Only the order-free parts differ (the max is exact in any order; the argmax is
// the first index equal to the max).
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

// The element type of a row type (Prob<E> holds E), and whether the intrinsic loops cover it.
template <class T>
struct Elem {
  using type = T;
};
template <class E>
struct Elem<verify::Prob<E>> {
  using type = E;
};
template <class T>
constexpr bool kFast = std::is_same<typename Elem<T>::type, float>::value ||
                       std::is_same<typename Elem<T>::type, verify::BFloat16>::value;

inline __m512 load16(const float* p, int64_t i) { return _mm512_loadu_ps(p + i); }
inline __m512 load16(const verify::BFloat16* p, int64_t i) {
  // bf16 -> float is the 16 bits moved to the top (verify::load_elem / bf16_to_float).
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Lanes outside m read nothing (masked loads do not fault) and hold 0.
inline __m512 load16(const float* p, int64_t i, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p + i);
}
inline __m512 load16(const verify::BFloat16* p, int64_t i, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <class T>
inline const typename Elem<T>::type* elems(const T* row) {
  // Prob<E> is a struct of one E: same size and layout as E.
  static_assert(sizeof(T) == sizeof(typename Elem<T>::type), "Prob<E> must be laid out as E");
  return reinterpret_cast<const typename Elem<T>::type*>(row);
}

inline __m512 set1(float x) { return _mm512_set1_ps(x); }

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
inline __m512 exp16(__m512 x) {
  namespace c = verify::expc;
  const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(c::kTiny), _CMP_GT_OQ);  // !tiny (NaN: tiny)
  // x < 88 ? x : 88 is MINPS(x, 88) exactly (a NaN x gives 88 here and 0 in the end).
  if constexpr (kClamp) x = _mm512_min_ps(x, set1(c::kHuge));
  const __m512 magic = set1(c::kMagic);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, set1(c::kLog2e), magic), magic);
  const __m512 r = _mm512_fmadd_ps(n, set1(-c::kLn2), x);
  __m512 p = set1(c::kC5);
  p = _mm512_fmadd_ps(p, r, set1(c::kC4));
  p = _mm512_fmadd_ps(p, r, set1(c::kC3));
  p = _mm512_fmadd_ps(p, r, set1(c::kC2));
  p = _mm512_fmadd_ps(p, r, set1(1.0f));
  p = _mm512_fmadd_ps(p, r, set1(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// verify::RowWeight<T>::local on 16 raw values of one chunk (m = that chunk's m_c, g = its g_c).
// Masked = false skips the top-k / top-p selections, which change nothing when both are off
// (kth = -inf, wmin = 0): raw >= -inf holds for every row that passed the scan, w >= 0 always.
// The parameters are copied into registers once (the functor itself sits in memory that the
// loops' stores could alias, which would force a reload per vector).
template <class T, bool Masked>
struct Local16 {
  __m512 inv_temp, kth, wmin;
  explicit Local16(const verify::RowWeight<T>& f)
      : inv_temp(set1(f.inv_temp)), kth(set1(f.kth)), wmin(set1(f.wmin)) {}
  __m512 operator()(__m512 raw, __m512 m, __m512 g) const {
    if constexpr (verify::IsProb<T>::value) {
      if constexpr (!Masked) return raw;
      const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(raw, kth, _CMP_GE_OQ), raw);
      return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, wmin, _CMP_GE_OQ), w);
    } else {
      const __m512 e = exp16<false>(_mm512_sub_ps(_mm512_mul_ps(raw, inv_temp), m));
      if constexpr (!Masked) return e;
      const __m512 kept = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(raw, kth, _CMP_GE_OQ), e);
      return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_mul_ps(kept, g), wmin, _CMP_GE_OQ),
                                 kept);
    }
  }
};

// verify::FirstResidualWeight::from_weight on 16 lanes: max(w / total - q, 0), NaN where q is
// not a probability. (fmul(q, 1) is q itself for every q that is not NaN.)
inline __m512 residual16(__m512 w, __m512 q, __m512 inv_total) {
  const __m512 d = _mm512_sub_ps(_mm512_mul_ps(w, inv_total), q);
  const __m512 r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), d);
  const __mmask16 ok = _mm512_cmp_ps_mask(q, _mm512_setzero_ps(), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(q, set1(verify::kFloatMax), _CMP_LE_OQ);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)), ok, r);
}

// Adds the 16 weights of one vector to the 8 canonical lanes of its chunk: elements i .. i+7
// first, then i+8 .. i+15, as verify::chunk_sum's lane loop does.
inline __m256 add_lanes(__m256 acc, __m512 w) {
  acc = _mm256_add_ps(acc, _mm512_castps512_ps256(w));
  return _mm256_add_ps(acc, _mm512_extractf32x8_ps(w, 1));
}

// ((0+1)+(2+3))+((4+5)+(6+7)), the canonical lane combination.
inline float combine_lanes(__m256 acc) {
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

constexpr int kVecPerChunk = verify::kChunk / 16;
// How far ahead of the exps of a logits row the scan asks for the row's next bytes (4 chunks of
// float32): about the bytes that arrive while the exps of a chunk run. 2 KiB was slower, 8 KiB
// no better (a same-load A/B of the goal row, bench/RESULTS.md).
constexpr int kPrefetchBytes = 4096;
static_assert(verify::kChunk % 16 == 0, "a chunk is a whole number of 16-lane vectors");

// The canonical lane sum of one full chunk starting at `begin`, of a weight given per vector by
// w16(i) (i the first of 16 indices). Rows stream in memory order, which the hardware prefetcher
// follows; each chunk's additions are one dependent chain in the canonical order, and consecutive
// chunks' chains are independent, so the out-of-order core overlaps them with the next chunk's
// loads and exps.
template <class W16>
inline float chunk_lane_sum(int64_t begin, const W16& w16) {
  __m256 acc = _mm256_setzero_ps();
  for (int s = 0; s < kVecPerChunk; ++s) acc = add_lanes(acc, w16(begin + s * 16));
  return combine_lanes(acc);
}

}  // namespace v512

// v512::exp16 over an array (for verify_exp_approx); the tail runs masked.
void exp_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, v512::exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, m, v512::exp16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

class CpuExecAvx512 : public CpuExecAvx512Generic {
 public:
  using CpuExecAvx512Generic::chunk_scales;
  using CpuExecAvx512Generic::chunk_sums;
  using CpuExecAvx512Generic::range_sums;
  using CpuExecAvx512Generic::scan;

  // The scan of a target row, chunk by chunk: the max of each chunk (exact in any order; kept
  // for chunk_scales and for the argmax), the bad flag, and with hint.fuse the chunk's local
  // weights and their canonical lane sum L_c while its 1 KiB is in L1 (see verify.h: for logits
  // local_i = exp(s_i - m_c) needs only the chunk's own max), so the row is read from memory
  // once. The argmax is the first index equal to the max, searched in the first chunk that
  // holds it (the index the generic loop and the GPU return).
  template <class T>
  ScanResult scan(int64_t n, const verify::RowLoad<T>& load, const verify::BadTarget& bad,
                  const verify::ScanHint& hint) {
    if constexpr (!v512::kFast<T>) {
      return CpuExecAvx512Generic::scan(n, load, bad, hint);
    } else {
      constexpr bool logits = !verify::IsProb<T>::value;
      const auto* row = v512::elems(load.row);
      const __m512 ninf = v512::set1(-verify::kInf);
      // A logit is bad if NaN or +inf; the +inf test is left to the chunk's max below (any +inf
      // that is not NaN is the max), so the loop tests NaN only.
      const auto is_bad = [&](__m512 v) -> __mmask16 {
        if constexpr (logits) {
          return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        } else {
          // !(v >= 0 && v <= FLT_MAX) in one instruction: NaN (quiet 0x01, signalling 0x80),
          // +inf (0x08), -inf (0x10) and negative non-zero finite values, denormals included
          // (0x40); -0 passes, as v >= 0 does. (FPCLASS ignores MXCSR.DAZ, so under DAZ a
          // negative denormal is still flagged here, as on the GPU, which has no DAZ.)
          return _mm512_fpclass_ps_mask(v, 0xD9);
        }
      };
      const int chunks = verify::num_chunks(n);
      const int full = static_cast<int>(n / verify::kChunk);
      raw_max_.resize(static_cast<size_t>(chunks));
      float* cmax = raw_max_.data();
      const bool fuse = hint.fuse;
      float* lsum = nullptr;
      float* local = nullptr;
      if (fuse) {
        pending_.resize(static_cast<size_t>(chunks));
        lsum = pending_.data();
        if constexpr (logits) {
          // The local weights are kept for the residual of this row (row_weights_).
          row_weights_.resize(static_cast<size_t>(n));
          local = row_weights_.data();
        }
      }
      const float inv_temp = hint.inv_temp;
      const __m512 vinv_temp = v512::set1(inv_temp);
      const bool unit_temp = inv_temp == 1.f;
      __mmask16 flag = 0;
      // The raw max of one full chunk and its bad flags.
      const auto chunk_max_of = [&](int64_t begin) {
        __m512 m = ninf;
        for (int s = 0; s < v512::kVecPerChunk; ++s) {
          const __m512 v = v512::load16(row, begin + s * 16);
          flag |= is_bad(v);
          // MAXPS(v, m) = v > m ? v : m, the generic lane update (a NaN v keeps m).
          m = _mm512_max_ps(v, m);
        }
        return _mm512_reduce_max_ps(m);
      };
      if constexpr (logits) {
        if (fuse && full > 0) {
          // Software-pipelined by one chunk: the exps of chunk c need m_c, so chunk c+1's max is
          // taken inside chunk c's exp loop (its loads and MAXPS fill the FMA-bound loop's
          // spare slots) instead of in a separate pass that the exps would wait on. The maxima
          // and flags are the same values (MAXPS is exact; the flags are OR-ed).
          cmax[0] = chunk_max_of(0);
          for (int c = 0; c < full; ++c) {
            const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
            if (cmax[c] == verify::kInf) flag |= 1;
            const __m512 mc = v512::set1(verify::fmul(cmax[c], inv_temp));
            const bool more = c + 1 < full;
            __m512 mn = ninf;
            // The loads of a later chunk are also started here (the exps keep the core busy for
            // longer than a chunk takes to arrive, and the out-of-order window does not reach
            // those loads by itself); a prefetch past the row's end is harmless.
            const auto exps = [&](auto unit) {
              lsum[c] = v512::chunk_lane_sum(begin, [&](int64_t i) {
                _mm_prefetch(reinterpret_cast<const char*>(row + i) + v512::kPrefetchBytes,
                             _MM_HINT_T0);
                if (more) {
                  const __m512 v = v512::load16(row, i + verify::kChunk);
                  flag |= is_bad(v);
                  mn = _mm512_max_ps(v, mn);
                }
                __m512 x = v512::load16(row, i);
                // fmul(raw, 1) = raw for every raw (NaN stays NaN): the multiply is left out.
                if constexpr (!decltype(unit)::value) x = _mm512_mul_ps(x, vinv_temp);
                const __m512 e = v512::exp16<false>(_mm512_sub_ps(x, mc));
                _mm512_storeu_ps(local + i, e);
                return e;
              });
            };
            if (unit_temp) {
              exps(std::true_type{});
            } else {
              exps(std::false_type{});
            }
            if (more) cmax[c + 1] = _mm512_reduce_max_ps(mn);
          }
        } else {
          for (int c = 0; c < full; ++c) {
            cmax[c] = chunk_max_of(static_cast<int64_t>(c) * verify::kChunk);
            if (cmax[c] == verify::kInf) flag |= 1;
          }
        }
      } else {
        for (int c = 0; c < full; ++c) {
          const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
          if (fuse) {
            // A probability row's unmasked weights are its values: summed in the same loop.
            __m512 m = ninf;
            lsum[c] = v512::chunk_lane_sum(begin, [&](int64_t i) {
              const __m512 v = v512::load16(row, i);
              flag |= is_bad(v);
              m = _mm512_max_ps(v, m);
              return v;
            });
            cmax[c] = _mm512_reduce_max_ps(m);
          } else {
            cmax[c] = chunk_max_of(begin);
          }
        }
      }
      if (full < chunks) {
        const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
        float m = -verify::kInf;
        bool tail_bad = false;
        for (int64_t i = begin; i < n; ++i) {
          const float v = load(i);
          tail_bad = tail_bad || bad(v);
          m = v > m ? v : m;
        }
        if (tail_bad) flag |= 1;
        cmax[full] = m;
        if (fuse) {
          if constexpr (logits) {
            const float mc = verify::fmul(m, inv_temp);
            for (int64_t i = begin; i < n; ++i) {
              local[i] = verify::local_logit_weight(load(i), inv_temp, mc);
            }
            const auto read = [local](int64_t i) { return local[i]; };
            lsum[full] = verify::chunk_sum(read, begin, n);
          } else {
            lsum[full] = verify::chunk_sum(load, begin, n);
          }
        }
      }
      ScanResult r{-verify::kInf, 0, flag != 0};
      int first = 0;
      for (int c = 0; c < chunks; ++c) {
        if (cmax[c] > r.max) {
          r.max = cmax[c];
          first = c;
        }
      }
      const int64_t begin = static_cast<int64_t>(first) * verify::kChunk;
      const int64_t end = std::min<int64_t>(begin + verify::kChunk, n);
      for (int64_t i = begin; i < end; ++i) {
        if (load(i) == r.max) {
          r.argmax = i;
          break;
        }
      }
      maxima_row_ = load.row;
      maxima_n_ = n;
      pending_row_ = fuse ? static_cast<const void*>(load.row) : nullptr;
      pending_n_ = n;
      pending_inv_temp_ = inv_temp;
      cached_row_ = nullptr;  // row_weights_ may have been overwritten
      return r;
    }
  }

  // m_c and g_c from the chunk maxima the scan of this row took (no second read of the row).
  template <class T>
  void chunk_scales(int64_t n, const verify::RowLoad<T>& load, float inv_temp, float scaled_max) {
    if (maxima_row_ != static_cast<const void*>(load.row) || maxima_n_ != n) {
      return CpuExecAvx512Generic::chunk_scales(n, load, inv_temp, scaled_max);
    }
    const int chunks = verify::num_chunks(n);
    for (int c = 0; c < chunks; ++c) {
      verify::chunk_scale_of(raw_max_[c], inv_temp, scaled_max, &chunk_max_[c], &chunk_scale_[c]);
    }
  }

  // The chunk sums S_c of the target weights. After a fused scan of this row with no masks,
  // S_c = L_c * g_c from the scan's L_c; otherwise the local weights are computed chunk by chunk
  // (kept in row_weights_ for a later residual, logits only: a probability row's weights are
  // cheaper to reload than to cache) and summed canonically in one pass.
  template <class T>
  float chunk_sums(int64_t n, const verify::RowWeight<T>& f, int which) {
    if constexpr (!v512::kFast<T>) {
      return CpuExecAvx512Generic::chunk_sums(n, f, which);
    } else {
      constexpr bool logits = !verify::IsProb<T>::value;
      float* out = sums(which);
      const int chunks = verify::num_chunks(n);
      if (pending_row_ == static_cast<const void*>(f.row) && pending_n_ == n && !f.masked() &&
          (!logits || (same_bits(pending_inv_temp_, f.inv_temp) &&
                       f.chunk_max == chunk_max_.data() && f.chunk_scale == chunk_scale_.data()))) {
        for (int c = 0; c < chunks; ++c) {
          out[c] = f.from_local(pending_[c], static_cast<int64_t>(c) * verify::kChunk);
        }
        if (logits) {
          remember_weights_of(f, n);
        } else {
          cached_row_ = nullptr;
        }
        // Used once: a later masked pass over this row (the top-p search) overwrites
        // row_weights_, which the pending sums' cache entry would then no longer describe.
        pending_row_ = nullptr;
        return verify::sequential_total(out, chunks);
      }
      if (f.masked()) return sums_of<true>(n, f, out);
      return sums_of<false>(n, f, out);
    }
  }

  // The first residual max(p - q, 0): from the cached local weights when this row's were just
  // computed (w = local * g_c, one multiply), else recomputed from the row; q read once.
  template <class T, class Q>
  float chunk_sums(int64_t n, const verify::FirstResidualWeight<T, Q>& f, int which) {
    const int chunks = verify::num_chunks(n);
    range_sums(n, f, 0, chunks, sums(which));
    return verify::sequential_total(sums(which), chunks);
  }

  // The same for chunks [c_begin, c_end) (the final draw's phase 2: a chain's correction).
  template <class T, class Q>
  void range_sums(int64_t n, const verify::FirstResidualWeight<T, Q>& f, int c_begin, int c_end,
                  float* out) {
    if constexpr (!(v512::kFast<T> && v512::kFast<Q>)) {
      CpuExecAvx512Generic::range_sums(n, f, c_begin, c_end, out);
    } else {
      if (f.weight.masked()) return residual_of<true>(n, f, c_begin, c_end, out);
      residual_of<false>(n, f, c_begin, c_end, out);
    }
  }

  // The residual at sibling level L >= 1 (a tree node whose earlier sampled children were
  // rejected): max(p_L - q_L, 0) from the cached local weights when this row's were just
  // computed, else recomputed; the levels' recursion of verify::level_pq lane by lane.
  // (This pair and the level-0 pair above have the same shape on purpose: each must have exactly
  // the signature of the generic executor's overload, which it hides; a shared template of
  // another signature loses overload resolution to the generic one, which is slower.)
  template <class T, class Q>
  float chunk_sums(int64_t n, const verify::ResidualWeight<T, Q>& f, int which) {
    const int chunks = verify::num_chunks(n);
    range_sums(n, f, 0, chunks, sums(which));
    return verify::sequential_total(sums(which), chunks);
  }

  // The same for chunks [c_begin, c_end) (the final draw's phase 2: a tree node's correction).
  template <class T, class Q>
  void range_sums(int64_t n, const verify::ResidualWeight<T, Q>& f, int c_begin, int c_end,
                  float* out) {
    if constexpr (!(v512::kFast<T> && v512::kFast<Q>)) {
      CpuExecAvx512Generic::range_sums(n, f, c_begin, c_end, out);
    } else {
      if (f.weight.masked()) return level_residual_of<true>(n, f, c_begin, c_end, out);
      level_residual_of<false>(n, f, c_begin, c_end, out);
    }
  }

  void reset(int64_t vocab) {
    CpuExecAvx512Generic::reset(vocab);
    pending_row_ = nullptr;
    pending_n_ = 0;
    maxima_row_ = nullptr;
    maxima_n_ = 0;
  }

 private:
  template <bool Masked, class T>
  float sums_of(int64_t n, const verify::RowWeight<T>& f, float* out) {
    constexpr bool logits = !verify::IsProb<T>::value;
    const auto* row = v512::elems(f.row);
    float* w = nullptr;
    if (logits) {
      row_weights_.resize(static_cast<size_t>(n));
      w = row_weights_.data();
    }
    const int chunks = verify::num_chunks(n);
    const int full = static_cast<int>(n / verify::kChunk);
    const v512::Local16<T, Masked> local16(f);
    for (int c = 0; c < full; ++c) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const __m512 m = v512::set1(logits ? f.chunk_max[c] : 0.f);
      const __m512 g = v512::set1(f.scale(begin));
      const float l = v512::chunk_lane_sum(begin, [&](int64_t i) {
        const __m512 lv = local16(v512::load16(row, i), m, g);
        if (logits) _mm512_storeu_ps(w + i, lv);
        return lv;
      });
      out[c] = f.from_local(l, begin);
    }
    if (full < chunks) {
      const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
      out[full] = verify::canonical_chunk_sum(f, begin, n);
      if (logits) {
        for (int64_t i = begin; i < n; ++i) w[i] = f.local(i);
      }
    }
    if (logits) {
      remember_weights_of(f, n);
    } else {
      cached_row_ = nullptr;
    }
    return verify::sequential_total(out, chunks);
  }

  template <bool Masked, class T, class Q>
  void residual_of(int64_t n, const verify::FirstResidualWeight<T, Q>& f, int c_begin, int c_end,
                   float* out) {
    const verify::RowWeight<T>& rw = f.weight;
    const auto* row = v512::elems(rw.row);
    const auto* qrow = v512::elems(f.qrow);
    const bool cached = holds_weights_of(rw, n);
    const float* cl = row_weights_.data();
    const int full = static_cast<int>(n / verify::kChunk);
    const int full_end = std::min(c_end, full);
    const __m512 inv_total = v512::set1(f.inv_total);
    const v512::Local16<T, Masked> local16(rw);
    constexpr bool logits = !verify::IsProb<T>::value;
    for (int c = c_begin; c < full_end; ++c) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const __m512 m = v512::set1(logits ? rw.chunk_max[c] : 0.f);
      const __m512 g = v512::set1(rw.scale(begin));
      if (cached) {
        out[c] = v512::chunk_lane_sum(begin, [&](int64_t i) {
          _mm_prefetch(reinterpret_cast<const char*>(qrow + i) + v512::kPrefetchBytes, _MM_HINT_T0);
          __m512 wv = _mm512_loadu_ps(cl + i);
          if (logits) wv = _mm512_mul_ps(wv, g);
          return v512::residual16(wv, v512::load16(qrow, i), inv_total);
        });
      } else {
        out[c] = v512::chunk_lane_sum(begin, [&](int64_t i) {
          _mm_prefetch(reinterpret_cast<const char*>(qrow + i) + v512::kPrefetchBytes, _MM_HINT_T0);
          __m512 wv = local16(v512::load16(row, i), m, g);
          if (logits) wv = _mm512_mul_ps(wv, g);
          return v512::residual16(wv, v512::load16(qrow, i), inv_total);
        });
      }
    }
    // The partial last chunk (index full, when n is not a multiple of kChunk), if in range.
    if (full < verify::num_chunks(n) && c_begin <= full && full < c_end) {
      const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
      if (cached) {
        const auto rest = [&](int64_t i) { return f.from_weight(rw.from_local(cl[i], i), i); };
        out[full] = verify::chunk_sum(rest, begin, n);
      } else {
        out[full] = verify::chunk_sum(f, begin, n);
      }
    }
  }

  template <bool Masked, class T, class Q>
  void level_residual_of(int64_t n, const verify::ResidualWeight<T, Q>& f, int c_begin, int c_end,
                         float* out) {
    const verify::RowWeight<T>& rw = f.weight;
    const verify::SiblingLevels& lv = *f.lv;
    const auto* row = v512::elems(rw.row);
    const auto* qrow = v512::elems(f.qrow);
    const bool cached = holds_weights_of(rw, n);
    const float* cl = row_weights_.data();
    const int full = static_cast<int>(n / verify::kChunk);
    const int full_end = std::min(c_end, full);
    const __m512 inv_total = v512::set1(f.inv_total);
    const v512::Local16<T, Masked> local16(rw);
    constexpr bool logits = !verify::IsProb<T>::value;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 zero = _mm512_setzero_ps();
    for (int c = c_begin; c < full_end; ++c) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const __m512 m = v512::set1(logits ? rw.chunk_max[c] : 0.f);
      const __m512 g = v512::set1(rw.scale(begin));
      out[c] = v512::chunk_lane_sum(begin, [&](int64_t i) {
        _mm_prefetch(reinterpret_cast<const char*>(qrow + i) + v512::kPrefetchBytes, _MM_HINT_T0);
        __m512 w = cached ? _mm512_loadu_ps(cl + i) : local16(v512::load16(row, i), m, g);
        if (logits) w = _mm512_mul_ps(w, g);
        const __m512 q = v512::load16(qrow, i);
        // verify::level_pq: p = w / total, then per level l: q_l = 0 once y was tried at an
        // earlier level (else q * q_scale[l]), p = max(p - q_l, 0) / beta_l (0 if not > 0).
        const __m512i y = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), lane);
        __m512 p = _mm512_mul_ps(w, inv_total);
        __mmask16 removed = 0;
        for (int l = 0; l < lv.levels; ++l) {
          const __m512 ql =
              _mm512_maskz_mul_ps(static_cast<__mmask16>(~removed), q, v512::set1(lv.q_scale[l]));
          const __m512 d = _mm512_sub_ps(p, ql);
          p = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), d,
                                  v512::set1(lv.beta[l]));
          removed |= _mm512_cmpeq_epi32_mask(y, _mm512_set1_epi32(lv.tried[l]));
        }
        const __m512 qn = _mm512_maskz_mul_ps(static_cast<__mmask16>(~removed), q,
                                              v512::set1(lv.q_scale[lv.levels]));
        const __m512 d = _mm512_sub_ps(p, qn);
        const __m512 r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), d);
        // NaN where q is not a probability (verify::bad_prob), which poisons the sum.
        const __mmask16 ok = _mm512_cmp_ps_mask(q, zero, _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(q, v512::set1(verify::kFloatMax), _CMP_LE_OQ);
        return _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)), ok, r);
      });
    }
    // The partial last chunk (index full, when n is not a multiple of kChunk), if in range.
    if (full < verify::num_chunks(n) && c_begin <= full && full < c_end) {
      const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
      out[full] = verify::chunk_sum(f, begin, n);
    }
  }

  // The largest raw value of every chunk of the last scanned row (maxima_row_, maxima_n_).
  std::vector<float> raw_max_;
  const void* maxima_row_ = nullptr;
  int64_t maxima_n_ = 0;
  // L_c of the unmasked local weights taken by a fused scan of pending_row_ at
  // pending_inv_temp_ (for logits, row_weights_ then holds those local weights).
  std::vector<float> pending_;
  const void* pending_row_ = nullptr;
  int64_t pending_n_ = 0;
  float pending_inv_temp_ = 0.f;
};
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
// taken last slice first (any order gives the same sums), as the CUDA backend runs them.
template <class Ex, class T, class Q>
void verify_one(Ex& ex, const verify::VerifyArgs& args, int64_t b, int final_slices,
                verify::FinalDraw& fd) {
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
  const Isa isa = cpu_isa();
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
#ifdef SD_VERIFY_HAVE_AVX2
    if (isa == Isa::kAvx512) return run_range<CpuExecAvx512, T, Q>(args, begin, end, final_slices);
    if (isa == Isa::kAvx2) return run_range<CpuExecAvx2, T, Q>(args, begin, end, final_slices);
#endif
    run_range<CpuExec, T, Q>(args, begin, end, final_slices);
  });
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

int verify_exp_approx(const float* x, float* y, int64_t n, int isa) {
  const int have = static_cast<int>(cpu_isa());
  const int use = isa < have ? isa : have;
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
