// Batched verification of draft chains and trees: the math shared by the CPU and CUDA backends.
//
// Everything that decides a token lives here: the per-element arithmetic (own exp/log built from
// correctly rounded +, -, *, / and explicit fused multiply-adds only, so both backends round
// identically; see "arithmetic" below), the canonical order of
// every floating-point sum, the acceptance tests, the residual distributions and the order of the
// random draws. A backend only supplies an "executor" with a handful of row-wide collectives whose
// results are exact or defined in a fixed order (see CpuExec in src/verify.cc and the block
// executor in cuda/verify.cu):
//
//   bool leader()                          the one thread that writes outputs
//   TreeLimits tree_limits(parents, count) tree_limits_row of the sequence's tree
//   ScanResult scan(n, load, is_bad, hint) max value, its lowest index, and whether any is bad
//   float chunk_sums(n, f, which)          canonical chunk sums of f into sums(which) (for the
//                                          row weights RowWeight: S_c below); the total
//   float* sums(which)                     the chunk sums of the last chunk_sums(., ., which)
//   int64_t count_if(n, pred)              exact count
//   float kth_largest(n, load, k)          the k-th largest value (exact, so order-free)
//   void chunk_scales(n, load, inv_temp, M) m_c and g_c (below) of every chunk of a logits row
//   float* chunk_max() / chunk_scale()     where chunk_scales put them
//   void range_sums(n, f, c_begin, c_end, out)  canonical chunk sums of f for a range of chunks
//                                          (the final draw's phases 2 and 3, below the walk)
//   uint32_t top_p_threshold(n, f, wanted, hi)  top_p_bisect's threshold (both backends run
//                                          top_p_settling_search, whose three per-chunk steps
//                                          are listed with it)
// scan() also receives a ScanHint: when hint.fuse, a backend may take the chunk maxima and the
// unmasked local weights' chunk sums during the scan and hand them to the chunk_scales() and
// chunk_sums() calls of the same row that follow (same numbers, one read of the row).
//
// Sums are canonical: the vocabulary is cut into chunks of kChunk tokens; a chunk's sum adds its
// elements into 8 lanes (element i into lane i % 8, in increasing i) and combines the lanes as
// ((0+1)+(2+3))+((4+5)+(6+7)); the row total adds the chunk sums in chunk order. Both backends
// compute exactly this, so totals, thresholds and sampled tokens agree bit for bit.
//
// The weights of a logits row are defined chunk by chunk, so that a backend can find a chunk's
// max, take its exps and sum them while the chunk is in L1 (one read of the row from memory):
//   s_i = raw_i * inv_temp,  m_c = max of s over chunk c,  M = max of m_c over the row
//   local_i = exp_approx(s_i - m_c)    (0 where raw_i < kth, the top-k threshold)
//   g_c = exp_approx(m_c - M)          (the chunk's scale; the chunk holding the argmax has 1)
//   w_i = local_i * g_c                (0 where w_i < wmin, the top-p threshold: then local_i
//                                       counts as 0 too)
//   S_c = chunk_sum(local, c) * g_c    (the chunk sum of the row weights: ONE multiply after the
//                                       canonical lane sum, not the sum of the w_i)
// Every use of the row takes these numbers: the total (sum of S_c in order), the inverse-CDF
// draw (S_c, then w_i inside the chunk), the acceptance ratios (w_x / total), the residuals
// (max(w_i / total - q_i, 0)), the entropy and the top-p search. m_c is fmul(max raw, inv_temp),
// equal to the max of the s_i since rounding a product by a positive number is monotone. A
// probability row has w_i = raw_i (masked) and S_c its plain chunk sum.
//
#pragma once

#include <cstdint>

#include "specdecode/host_device.h"
#include "specdecode/philox.h"
#include "specdecode/tree.h"

namespace sd {
namespace verify {

constexpr int kChunk = 256;
constexpr int kMaxChunks = 2048;
constexpr int64_t kMaxVocab = static_cast<int64_t>(kChunk) * kMaxChunks;  // 524288
// The tried siblings of a node (and, with q, the per-level state of recursive rejection sampling)
// live in fixed per-thread arrays, so a node may have at most this many children.
constexpr int kMaxSiblings = 64;

enum Method : int32_t {
  kExact = 0,
  kGreedy = 1,
  kTypical = 2,
  kRelaxed = 3,
  kTopKAccept = 4,
  kBlock = 5,  // block verification of sampled chains (see walk_block_chain); else as kExact
};

// Bits of the per-sequence status. The low bits flag data the walk met (the sequence's outputs
// stop at that node); the high bits are caller errors the Python layer turns into ValueError.
enum StatusBits : int32_t {
  kNonFiniteTarget = 1,  // NaN/+Inf logit, NaN/Inf/negative probability or a probability row
                         // whose float32 sum overflows, in a target row read
  kZeroMassTarget = 2,   // a target row read has no mass (all -inf logits / all-zero probabilities)
  kBadDraftRow = 4,      // NaN/Inf/negative draft probability met
  kBadTree = 16,         // invalid parents row, or num_nodes outside [1, nodes of the tree]
  kBadToken = 32,        // a draft token outside [0, V)
  kDepthOverflow = 64,   // the tree (or chain) is deeper than max_depth
  kTooManySiblings = 128,  // a node with more than kMaxSiblings children (exact / relaxed draws)
};

// ---- arithmetic that rounds identically on host and device ------------------------------------
// Every operation below is correctly rounded (IEEE binary32, round to nearest even) on both
// backends, so a result depends only on the operations and their order, never on the backend.
// nvcc contracts a * b + c into an fma by default; the _rn intrinsics forbid it. The host build
// uses -ffp-contract=off for the same reason: a fused multiply-add is only ever asked for
// explicitly, with ffma.
SD_HD_INLINE float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SD_HD_INLINE float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SD_HD_INLINE float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SD_HD_INLINE float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// a * b + c with ONE rounding. A fused multiply-add is correctly rounded wherever it exists, so
// it rounds identically everywhere: __fmaf_rn on the GPU; on the host the compiler's builtin,
// which is one vfmadd instruction in code compiled for an ISA with FMA (the AVX2 and AVX-512
// loops of src/verify.cc, whose intrinsic exp uses _mm512_fmadd_ps) and otherwise a call to the
// C library's fmaf (glibc's is exact; on x86-64 it dispatches to the FMA instruction at run
// time). The baseline x86-64 loops therefore call fmaf per operation instead of vectorising
// their exps: slower, same bits.
SD_HD_INLINE float ffma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

constexpr float kInf = __builtin_huge_valf();
constexpr float kFloatMax = 3.402823466e38f;

SD_HD_INLINE bool is_nan(float x) { return x != x; }
SD_HD_INLINE bool is_finite(float x) { return x >= -kFloatMax && x <= kFloatMax; }

// The constants of exp_approx (shared with the AVX-512 exp in src/verify.cc, which must use the
// same values). exp(r) on |r| <= ln2/2 is 1 + r + c2 r^2 + ... + c5 r^5: the degree-5 polynomial
// with c0 = c1 = 1 whose float32 coefficients minimise the largest relative error on
// |r| <= 1.002 ln2/2 (a linear-programming minimax fit in float64, each coefficient rounded to
// float from the highest down with the lower ones refitted; relative error 7.6e-8).
// The reduction r = x - n ln2 takes ONE fused multiply-add with ln 2 rounded to float (no
// Cody-Waite second constant): its error n (ln2 - kLn2) is at most 2.4e-7 relative at |n| = 127
// and 8e-8 for |x| <= 30. With the roundings of the evaluation exp_approx is within 5.4 ulp of
// exp over its whole range and 3.4 ulp for |x| <= 30 (relative 3.2e-7 at worst, far below what
// any sampling test can see; tests/test_ops_verify.py measures it against numpy's float64 exp).
// Why not 1 ulp: the logits scan is bound by this exp's fused multiply-adds on the CPU (one
// 512-bit FMA per cycle on Zen 4); the degree-6 polynomial with the two-constant reduction took
// 10 of them per 16 logits, this takes 8. The argument itself, s_i - m_c with s_i = raw *
// inv_temp rounded, already carries a relative error of |s_i| 2^-24 (1.8e-6 at |s_i| = 30).
namespace expc {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMagic = 12582912.0f;             // 1.5 * 2^23: adding it rounds to an integer
constexpr float kLn2 = 0.693147182464599609375f;  // ln 2 rounded to float
constexpr float kC2 = 0x1.fffe04p-2f;
constexpr float kC3 = 0x1.55565ap-3f;
constexpr float kC4 = 0x1.572b24p-5f;
constexpr float kC5 = 0x1.111992p-7f;
constexpr float kTiny = -87.0f;  // x <= kTiny (and NaN) gives 0
constexpr float kHuge = 88.0f;   // x is clamped to kHuge
}  // namespace expc

// exp(x) for the softmax, within 5.4 ulp of the true value (3.4 ulp for |x| <= 30; the largest
// errors measured over 5e6 inputs spread over the whole range). Results below 2^-126 (x < -87)
// flush to 0: such tokens are at least e^-87 times less likely than the most likely one and count
// as probability 0. exp_approx(0) is exactly 1 (every step is exact there), which the weights rely
// on (the most likely token of a row has weight 1). Operation for operation:
//   n = round(x log2 e)              ffma(x, kLog2e, kMagic) - kMagic (one rounding to an integer)
//   r = x - n ln2                    ffma(n, -kLn2, x)
//   p = Horner in r, c5 down to c0   five ffma
//   exp = p * 2^n                    fmul by the power of two built from n's bits
SD_HD_INLINE float exp_approx(float x) {
  const bool tiny = !(x > expc::kTiny);  // also -inf and NaN
  x = tiny ? 0.0f : (x < expc::kHuge ? x : expc::kHuge);
  // n = round(x / ln 2) with the 1.5 * 2^23 trick (exact for |n| < 2^22, no libm floor).
  const float n = fsub(ffma(x, expc::kLog2e, expc::kMagic), expc::kMagic);
  const float r = ffma(n, -expc::kLn2, x);
  float p = expc::kC5;
  p = ffma(p, r, expc::kC4);
  p = ffma(p, r, expc::kC3);
  p = ffma(p, r, expc::kC2);
  p = ffma(p, r, 1.0f);
  p = ffma(p, r, 1.0f);
  const int e = static_cast<int>(n) + 127;  // in [1, 254] by the clamps above
  const float scale = bits_to_float(static_cast<uint32_t>(e) << 23);
  // Evaluated unconditionally, then selected: with -ftrapping-math a conditional multiply would
  // keep the CPU loops from vectorising.
  const float y = fmul(p, scale);
  return tiny ? 0.0f : y;
}

// Natural log of a positive finite x, about 2 ulp. Branch-free (both sides computed, then
// selected) so that CPU loops over a row vectorise.
SD_HD_INLINE float log_approx(float x) {
  const bool subnormal = x < 1.17549435e-38f;  // scaled into the normal range
  x = subnormal ? fmul(x, 8388608.0f) : x;
  const uint32_t bits = float_to_bits(x);
  int e = static_cast<int>((bits >> 23) & 0xffu) - 127 - (subnormal ? 23 : 0);
  float f = bits_to_float((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
  const bool high = f > 1.41421356f;
  f = high ? fmul(f, 0.5f) : f;
  e += high ? 1 : 0;
  // log f = 2 atanh(s), s = (f - 1) / (f + 1), |s| < 0.172.
  const float s = fdiv(fsub(f, 1.0f), fadd(f, 1.0f));
  const float s2 = fmul(s, s);
  float p = 1.0f / 11.0f;
  p = fadd(fmul(p, s2), 1.0f / 9.0f);
  p = fadd(fmul(p, s2), 1.0f / 7.0f);
  p = fadd(fmul(p, s2), 1.0f / 5.0f);
  p = fadd(fmul(p, s2), 1.0f / 3.0f);
  p = fadd(fmul(p, s2), 1.0f);
  return fadd(fmul(fmul(2.0f, s), p), fmul(static_cast<float>(e), 0.693147180559945f));
}

// ---- element types ---------------------------------------------------------------------------
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

SD_HD_INLINE float load_elem(const float* p, int64_t i) { return p[i]; }
SD_HD_INLINE float load_elem(const Half* p, int64_t i) { return half_to_float(p[i].bits); }
SD_HD_INLINE float load_elem(const BFloat16* p, int64_t i) { return bf16_to_float(p[i].bits); }

// A target row type of element E that holds probabilities instead of logits. Making this a type
// (not a runtime flag) keeps the exp out of the probability path's loops.
template <class E>
struct Prob {
  E v;
};
template <class E>
SD_HD_INLINE float load_elem(const Prob<E>* p, int64_t i) {
  return load_elem(&p[i].v, 0);
}
template <class T>
struct IsProb {
  static constexpr bool value = false;
};
template <class E>
struct IsProb<Prob<E>> {
  static constexpr bool value = true;
};

// ---- canonical sums and inverse-CDF sampling ---------------------------------------------------
SD_HD_INLINE int num_chunks(int64_t n) { return static_cast<int>((n + kChunk - 1) / kChunk); }

// The canonical combination of a chunk's eight lane sums: ((0+1)+(2+3))+((4+5)+(6+7)).
SD_HD_INLINE float combine_lanes(const float* l) {
  return fadd(fadd(fadd(l[0], l[1]), fadd(l[2], l[3])), fadd(fadd(l[4], l[5]), fadd(l[6], l[7])));
}

template <class F>
SD_HD_INLINE float chunk_sum(const F& f, int64_t begin, int64_t end) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] = fadd(lane[j], f(i + j));
  }
  for (int j = 0; i + j < end; ++j) lane[j] = fadd(lane[j], f(i + j));
  return combine_lanes(lane);
}

SD_HD_INLINE float sequential_total(const float* sums, int chunks) {
  float total = 0.f;
  for (int c = 0; c < chunks; ++c) total = fadd(total, sums[c]);
  return total;
}

// The token whose cumulative weight first exceeds u * total, with the cumulative taken over the
// chunk sums in order and then element by element inside the chosen chunk. Only tokens with
// f(i) > 0 can be returned; -1 only if every chunk sum is 0 (the caller never asks then).
template <class F>
SD_HD_INLINE int64_t pick_by_cdf(const F& f, const float* sums, int64_t n, float total, float u) {
  const int chunks = num_chunks(n);
  const float target = fmul(u, total);
  float before = 0.f;
  int chosen = -1, last_nonzero = -1;
  for (int c = 0; c < chunks; ++c) {
    if (!(sums[c] > 0.f)) continue;
    last_nonzero = c;
    const float after = fadd(before, sums[c]);
    if (after > target) {
      chosen = c;
      break;
    }
    before = after;
  }
  if (chosen < 0) {
    // u * total rounded up to the total itself: the draw belongs to the last token with weight.
    chosen = last_nonzero;
    if (chosen < 0) return -1;
    before = -kInf;
  }
  const float rest = fsub(target, before);
  const int64_t begin = static_cast<int64_t>(chosen) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  float run = 0.f;
  int64_t last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float w = f(i);
    if (!(w > 0.f)) continue;
    run = fadd(run, w);
    last = i;
    if (run > rest) return i;
  }
  // The element-wise running sum can round below the lane-wise chunk sum.
  if (last >= 0) return last;
  // A chunk sum S_c = L_c * g_c can be positive while every w_i = local_i * g_c of the chunk
  // underflowed to 0 (weights below 2^-149, far below 2^-126 of the row's most likely token):
  // the draw goes to the nearest token with weight, after the chunk first, then before it. The
  // row's argmax always has weight 1, so a row with total > 0 always has one.
  for (int64_t i = end; i < n; ++i) {
    if (f(i) > 0.f) return i;
  }
  for (int64_t i = begin - 1; i >= 0; --i) {
    if (f(i) > 0.f) return i;
  }
  return -1;
}

struct ScanResult {
  float max;
  int64_t argmax;
  bool bad;
};

// What prepare_row will ask of the row after its scan: with fuse, the chunk maxima, then the
// chunk sums of the weights with no top-k / top-p mask (kth = -inf, wmin = 0) at inv_temp.
struct ScanHint {
  bool fuse;
  float inv_temp;
};

// local_i of a logit raw in a chunk of scaled max m (before the top-k / top-p masks).
SD_HD_INLINE float local_logit_weight(float raw, float inv_temp, float m) {
  return exp_approx(fsub(fmul(raw, inv_temp), m));
}

// m_c and g_c of a chunk whose largest raw value is raw_max (see the top of this file).
SD_HD_INLINE void chunk_scale_of(float raw_max, float inv_temp, float scaled_max, float* m,
                                 float* g) {
  *m = fmul(raw_max, inv_temp);
  *g = exp_approx(fsub(*m, scaled_max));
}

// ---- per-sequence parameters and the processed target row ------------------------------------

struct SeqParams {
  bool greedy;     // temperature 0
  float inv_temp;  // 1 / temperature (logits only)
  int64_t top_k;   // 0 = off
  float top_p;     // 1 = off
  uint64_t seed, offset;
};

// The sampling distribution of one target row, never materialised: w(i) = weight(raw(i)) and
// p(i) = w(i) / total. For logits w(i) = local_i * g_c as defined at the top of this file, so the
// most likely token has weight 1; for probabilities w(i) = raw. Top-k keeps raw >= kth (ties at
// the k-th value are all kept); top-p then keeps w >= wmin, the largest threshold whose kept mass
// is still >= top_p * (mass after top-k) (ties at the threshold are all kept).
struct RowState {
  float max_raw;
  int64_t argmax;
  float scaled_max;
  float kth;
  float wmin;
  float total;
  int32_t status;
  const float* chunk_max;    // m_c of every chunk (logits rows with a distribution)
  const float* chunk_scale;  // g_c of every chunk
};

// The thresholds are held by value (not through a RowState pointer) so that a CPU loop over the
// row keeps them in registers and vectorises.
template <class T>
struct RowWeight {
  const T* row;
  float inv_temp;
  float kth;
  float scaled_max;
  float wmin;
  const float* chunk_max;    // m_c (logits only)
  const float* chunk_scale;  // g_c (logits only)
  // Whether the top-k / top-p masks can change anything: off, they are skipped (raw >= -inf
  // holds for every row that passed the scan, and w >= 0 for every weight).
  SD_HD_INLINE bool masked() const { return kth > -kInf || wmin > 0.f; }
  SD_HD_INLINE float scale(int64_t i) const {
    if constexpr (IsProb<T>::value) {
      return 1.f;
    } else {
      return chunk_scale[i / kChunk];
    }
  }
  // local_i as summed into L_c (0 where a mask drops the token); for probabilities, w itself.
  SD_HD_INLINE float local(int64_t i) const {
    // Branch-free (computed, then selected) so that CPU loops over i vectorise.
    const float raw = load_elem(row, i);
    if constexpr (IsProb<T>::value) {
      const float w = raw >= kth ? raw : 0.f;
      return w >= wmin ? w : 0.f;
    } else {
      const float e = local_logit_weight(raw, inv_temp, chunk_max[i / kChunk]);
      const float kept = raw >= kth ? e : 0.f;
      return fmul(kept, chunk_scale[i / kChunk]) >= wmin ? kept : 0.f;
    }
  }
  // w_i from local_i (a backend that holds local_i needs no second exp).
  SD_HD_INLINE float from_local(float l, int64_t i) const {
    if constexpr (IsProb<T>::value) {
      return l;
    } else {
      return fmul(l, scale(i));
    }
  }
  SD_HD_INLINE float operator()(int64_t i) const { return from_local(local(i), i); }
};

template <class T>
SD_HD_INLINE RowWeight<T> row_weight_of(const T* row, float inv_temp, const RowState& st) {
  return RowWeight<T>{row, inv_temp, st.kth, st.scaled_max, st.wmin, st.chunk_max, st.chunk_scale};
}

// The weights whose canonical chunk sum is taken on their local weights and finished with ONE
// multiply by the chunk's scale, S_c = chunk_sum(local, c) * g_c: the row weights, and the row
// weights without some tokens (MaskedWeight, below). Such a W has local(i) and from_local(l, i).
// Every other per-token function is summed as it is.
template <class W>
struct LocalSummed {
  static constexpr bool value = false;
};
template <class T>
struct LocalSummed<RowWeight<T>> {
  static constexpr bool value = true;
};

// local_i of a weight W, as a per-token function (what S_c sums before its one multiply).
template <class W>
struct LocalOf {
  const W* f;
  SD_HD_INLINE float operator()(int64_t i) const { return f->local(i); }
};

template <class F>
SD_HD_INLINE float canonical_chunk_sum(const F& f, int64_t begin, int64_t end) {
  if constexpr (LocalSummed<F>::value) {
    return f.from_local(chunk_sum(LocalOf<F>{&f}, begin, end), begin);
  } else {
    return chunk_sum(f, begin, end);
  }
}

// The canonical chunk sum lane by lane. Lane j of chunk_sum holds the elements begin + j,
// begin + j + 8, ... of the chunk (begin is a multiple of kChunk), added in increasing order
// starting from 0; the chunk sum combines the eight lanes as ((0+1)+(2+3))+((4+5)+(6+7)). So
//   canonical_finish(f, combine_lanes(l), begin) with l[j] = canonical_lane_sum(f, begin, end, j)
// equals canonical_chunk_sum(f, begin, end) bit for bit, and a backend may give each lane of a
// chunk to its own thread (the CUDA kernels of the final draw do; the CPU runs these functions
// when asked for several slices, see final_chunk_sums).
template <class F>
SD_HD_INLINE float chunk_lane_sum(const F& f, int64_t begin, int64_t end, int j) {
  float acc = 0.f;
  for (int64_t i = begin + j; i < end; i += 8) acc = fadd(acc, f(i));
  return acc;
}
template <class F>
SD_HD_INLINE float canonical_lane_sum(const F& f, int64_t begin, int64_t end, int j) {
  if constexpr (LocalSummed<F>::value) {
    return chunk_lane_sum(LocalOf<F>{&f}, begin, end, j);
  } else {
    return chunk_lane_sum(f, begin, end, j);
  }
}
template <class F>
SD_HD_INLINE float canonical_finish(const F& f, float lanes, int64_t begin) {
  if constexpr (LocalSummed<F>::value) {
    return f.from_local(lanes, begin);
  } else {
    return lanes;
  }
}

template <class T>
struct RowLoad {
  const T* row;
  SD_HD_INLINE float operator()(int64_t i) const { return load_elem(row, i); }
};

struct BadTarget {
  bool logits;
  SD_HD_INLINE bool operator()(float v) const {
    return logits ? (is_nan(v) || v == kInf) : !(v >= 0.f && v <= kFloatMax);
  }
};

// The top-p threshold: the largest wmin >= 0 whose kept mass, mass(wmin) = the canonical total
// of the row weights with w < wmin counted as 0, is still >= wanted; f is the row's weight with
// wmin = 0, hi the bit pattern of its largest weight. mass never increases with wmin (every term
// does not, and rounding is monotone), so bisection over the bit patterns of [0, hi] finds it,
// one canonical pass over the row per step. The threshold is always one of the row's weights
// (mass is constant from just above one weight up to the next). This is the definition; both
// backends find the same value with top_p_settling_search below, and fall back to this where
// it takes no pass (nothing wanted, no positive weight).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T>
SD_HOST_DEVICE uint32_t top_p_bisect(Ex& ex, int64_t n, RowWeight<T> f, float wanted, uint32_t hi) {
  uint32_t lo = 0u;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1u) / 2u;
    f.wmin = bits_to_float(mid);
    if (ex.chunk_sums(n, f, 1) >= wanted) {
      lo = mid;
    } else {
      hi = mid - 1u;
    }
  }
  return lo;
}

// ---- the top-p threshold with settled chunks ----------------------------------------------------
// top_p_bisect's value with less work per step. The search keeps an interval [lo, hi] of bit
// patterns that holds the threshold (mass(lo) >= wanted, or lo = 0; mass(hi + 1) < wanted, or hi
// the largest weight); each step tries a threshold mid in (lo, hi] and the interval becomes
// [mid, hi] or [lo, mid - 1]. A chunk with no weight inside the new interval keeps the same kept
// set {w >= t} = {w >= mid} for every t still to be tried, so its S_c stays the one just taken at
// mid: the chunk is *settled*, and later steps add that number without reading the chunk. Every
// total is therefore top_p_bisect's canonical mass, bit for bit, and the search ends on the same
// (unique) threshold, whatever the order of the tries. Once the interval is narrow (a few hundred
// weights of a large vocabulary) most chunks are settled and a step reads only the few that
// still hold weights inside it.
//
// The executor provides the per-chunk state and the collective steps:
//   ex.top_p_unsettle(n, f)            every chunk unsettled, except those top_p_chunk_empty
//                                      names, settled with S_c = +0
//   ex.top_p_candidate(lo, hi, &mid)   optionally, the next try: true with mid in (lo, hi] (the
//                                      CPU bisects the row's weights once few chunks are left
//                                      unsettled), false for top_p_next_try's
//   ex.top_p_trial(n, f, lo, mid, hi)  for each unsettled chunk, its TopPChunkTrial at mid (the
//                                      shared top_p_chunk_trial, or a loop with the same
//                                      results); returns the canonical total of the S_c at mid,
//                                      a settled chunk adding its kept S_c
//   ex.top_p_settle(n, keep, lo, hi)   settles the chunks that top_p_settles names, keeping
//                                      their S_c at mid ([lo, hi]: the new interval)
//   ex.top_p_histogram(n, f, span)     the unsettled chunks' weights inside a TopPSpan, added
//                                      up bucket by bucket, as suffix sums (see the first
//                                      tries, below); or nullptr from an executor whose tries
//                                      cost less than a histogram's pass

// A chunk's part of a try at threshold mid: S_c as chunk_sums takes it for f with wmin = mid,
// and whether the chunk holds a weight in [lo, mid) and in [mid, hi] (zero weights left out: at
// any threshold > 0 they add 0).
struct TopPChunkTrial {
  float sum;
  bool below;
  bool above;
};

// Whether chunk c has weight 0 at every threshold: a logits row cut by top-k, whose chunk
// maximum lies below the k-th value (m_c = fmul(raw max, inv_temp) < fmul(kth, inv_temp) implies
// raw max < kth, rounding being monotone). Its canonical sum is then +0 at every try.
template <class T>
SD_HD_INLINE bool top_p_chunk_empty(const RowWeight<T>& f, int c) {
  if constexpr (IsProb<T>::value) {
    return false;
  } else {
    return f.kth > -kInf && f.chunk_max[c] < fmul(f.kth, f.inv_temp);
  }
}

// Whether a chunk with those flags settles when the try keeps `wanted` (keep) or not.
SD_HD_INLINE bool top_p_settles(bool keep, bool below, bool above) {
  return keep ? !above : !below;
}

// Written out as chunk_sum's lane loop (the same additions in the same order, so the sum is
// chunk_sums' for f with wmin = mid), with the local weight of f at wmin = mid as
// RowWeight::local takes it: f has wmin = 0, and the unmasked weight w is compared with mid as
// local() compares it. The flags are plain locals OR-ed in the loop, which keeps it a
// vectorisable reduction on the CPU and in registers on the GPU.
template <class T>
SD_HD_INLINE TopPChunkTrial top_p_chunk_trial(const RowWeight<T>& f, int64_t begin, int64_t end,
                                              uint32_t lo, uint32_t mid, uint32_t hi) {
  const float lo_f = bits_to_float(lo), t = bits_to_float(mid), hi_f = bits_to_float(hi);
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  bool below = false, above = false;
  for (int64_t i = begin; i < end; i += 8) {
    for (int j = 0; j < 8 && i + j < end; ++j) {
      const float l = f.local(i + j);
      const float w = f.from_local(l, i + j);
      below |= w > 0.f && w >= lo_f && w < t;
      above |= w >= t && w <= hi_f;
      lane[j] = fadd(lane[j], w >= t ? l : 0.f);
    }
  }
  TopPChunkTrial r;
  r.sum = f.from_local(combine_lanes(lane), begin);
  r.below = below;
  r.above = above;
  return r;
}

// The next threshold to try in [lo, hi] (lo < hi). Until a try has kept `wanted` (found = false)
// it gallops down from hi's binade in powers of two (hi's exponent, then 1, 3, 7, .. binades
// below), since the threshold of a usual top_p lies a few binades below the largest weight and
// plain bisection of [0, hi] would first try thresholds near 1e-19 that keep everything; then it
// bisects the exponents of [lo, hi], then the bit patterns.
SD_HD_INLINE uint32_t top_p_next_try(uint32_t lo, uint32_t hi, bool found, uint32_t* back) {
  const uint32_t e_lo = lo >> 23, e_hi = hi >> 23;
  if (!found) {
    const uint32_t e = *back < e_hi ? e_hi - *back : 0u;
    *back = 2u * *back + 1u;
    if (e > e_lo && (e << 23) > lo) return e << 23;
  }
  if (e_hi > e_lo + 1u) return (e_lo + (e_hi - e_lo + 1u) / 2u) << 23;
  return lo + (hi - lo + 1u) / 2u;
}

// ---- the search's first tries, from histograms of the weights ----------------------------------
// Tries from top_p_next_try halve the interval of bit patterns: about 30 of them, the first dozen
// reading every chunk (while the interval is wide, every chunk holds a weight inside it), each
// one a barrier and a serial total on the GPU. A histogram instead adds up the weights inside a
// span of bit patterns by kTopPBuckets buckets of equal width in one pass; the buckets where the
// mass above crosses `wanted` narrow the span by about a thousand, and kTopPLevels such passes
// (each over the window the last one left) place the threshold within a few bit patterns. The
// tries then go to the edges of the bucket the histogram names, which usually settle the search
// in two.
//
// A histogram's masses are approximate (any order of additions: atomics on the GPU), so it only
// proposes tries. Every try is still a canonical total, the interval's invariant is kept by the
// tries alone, and a wrong proposal costs tries, never the threshold. The mass above a bucket is
// anchored, where one is known, on a canonical total taken at the interval's ends.

constexpr int kTopPBuckets = 1024;
constexpr int kTopPLevels = 3;
// The window of a level keeps every bucket whose approximate mass above could lie within this
// fraction of `wanted` from it: float sums of the row in two orders differ by far less (about
// 1e-6) on rows of up to a few hundred thousand weights.
constexpr float kTopPWindow = 1.f / 65536.f;

// Bucket k of a span holds the weights whose bit patterns lie in
// [base + (k << shift), base + ((k + 1) << shift)), k < buckets, capped at last. `above` is the
// approximate mass of the weights above the span (0 for the first span, whose last is the
// largest weight).
struct TopPSpan {
  uint32_t base;
  uint32_t last;
  int shift;
  int buckets;
  float above;
};

// The span [a, b] (a <= b) in the fewest buckets of equal power-of-two width.
SD_HD_INLINE TopPSpan top_p_span(uint32_t a, uint32_t b, float above) {
  int shift = 0;
  while (((b - a) >> shift) >= static_cast<uint32_t>(kTopPBuckets)) ++shift;
  return TopPSpan{a, b, shift, static_cast<int>((b - a) >> shift) + 1, above};
}

// The bucket of a weight's bit pattern, or -1 outside the span (zero weights count nowhere: at
// any threshold > 0 they add nothing).
SD_HD_INLINE int top_p_bucket(const TopPSpan& sp, float w) {
  const uint32_t bits = float_to_bits(w);
  if (!(w > 0.f) || bits < sp.base || bits > sp.last) return -1;
  return static_cast<int>((bits - sp.base) >> sp.shift);
}

// The pattern at which bucket k starts (k <= buckets; below 2^32 since last < 2^31).
SD_HD_INLINE uint32_t top_p_edge(const TopPSpan& sp, int k) {
  return sp.base + (static_cast<uint32_t>(k) << sp.shift);
}

// A chunk's part of a histogram: add(k, w) for every weight w of f (wmin = 0) in bucket k. The
// GPU's threads run this; a CPU holding the local weights runs the same test on them.
template <class T, class Add>
SD_HD_INLINE void top_p_chunk_histogram(const RowWeight<T>& f, int64_t begin, int64_t end,
                                        const TopPSpan& sp, Add& add) {
  for (int64_t i = begin; i < end; ++i) {
    const float w = f(i);
    const int k = top_p_bucket(sp, w);
    if (k >= 0) add(k, w);
  }
}

// The largest k in [k_lo, k_hi] with mass(k) >= x, or k_lo - 1 if none, for a mass that does
// not increase with k (suffix sums; an executor's parallel suffix sums may break that by an ulp
// at a block's edge, which only moves a proposal).
template <class Mass>
SD_HD_INLINE int top_p_last_at_least(const Mass& mass, int k_lo, int k_hi, float x) {
  int lo = k_lo - 1, hi = k_hi;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (mass(mid) >= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The next level's span from this level's histogram (cum[k]: the mass of buckets k.. of sp,
// cum[sp.buckets] = 0): every bucket whose approximate mass above, sp.above + cum[k], lies
// within the window of `wanted`.
SD_HD_INLINE TopPSpan top_p_window(const TopPSpan& sp, const float* cum, float wanted) {
  const auto mass = [&](int k) { return fadd(sp.above, cum[k]); };
  const float reach = fmul(wanted, kTopPWindow);
  int k_lo = top_p_last_at_least(mass, 0, sp.buckets - 1, fadd(wanted, reach));
  int k_hi = top_p_last_at_least(mass, 0, sp.buckets - 1, fsub(wanted, reach));
  k_lo = k_lo < 0 ? 0 : k_lo;
  k_hi = k_hi < k_lo ? k_lo : k_hi;
  const uint32_t a = top_p_edge(sp, k_lo);
  const uint32_t end = top_p_edge(sp, k_hi + 1) - 1u;
  return top_p_span(a, end < sp.last ? end : sp.last, fadd(sp.above, cum[k_hi + 1]));
}

// What the search knows of the canonical mass at its interval's ends: mass(hi + 1) always (0
// while hi is the largest weight), mass(lo) once a try has kept `wanted`.
struct TopPKnown {
  bool lo_known;
  float at_lo;
  float above_hi;
};

// The next try in (lo, hi] proposed by the last histogram (span sp, suffix sums cum): an edge of
// the bucket where the mass above crosses `wanted` (its start, which should keep `wanted`, or,
// when that is not above lo, its end, which should not), moved into (lo, hi]. False when no
// bucket edge lies in (lo, hi]: the interval is inside one bucket, or outside the span.
SD_HD_INLINE bool top_p_histogram_try(const TopPSpan& sp, const float* cum, uint32_t lo,
                                      uint32_t hi, const TopPKnown& known, float wanted,
                                      uint32_t* mid) {
  if (cum == nullptr) return false;
  // The buckets [k_lo, k_hi] overlap (lo, hi]; the edges k_min .. k_max lie in it.
  const uint32_t l = lo + 1u > sp.base ? lo + 1u : sp.base;
  const uint32_t h = hi < sp.last ? hi : sp.last;
  if (l > h) return false;
  const int k_lo = static_cast<int>((l - sp.base) >> sp.shift);
  const int k_hi = static_cast<int>((h - sp.base) >> sp.shift);
  const int k_min = lo < sp.base ? 0 : static_cast<int>((lo - sp.base) >> sp.shift) + 1;
  const uint32_t k_top = (hi - sp.base) >> sp.shift;
  const int k_max =
      k_top < static_cast<uint32_t>(sp.buckets) ? static_cast<int>(k_top) : sp.buckets;
  if (k_min > k_max) return false;
  // The mass above each bucket's start, anchored on the nearest canonical total: mass(hi + 1)
  // when hi is inside the span, else mass(lo) when known and inside, else the histograms' own.
  const auto mass = [&](int k) {
    if (hi < sp.last) return fadd(known.above_hi, fsub(cum[k], cum[k_hi + 1]));
    if (known.lo_known && lo >= sp.base) {
      return fsub(known.at_lo, fsub(cum[(lo - sp.base) >> sp.shift], cum[k]));
    }
    return fadd(sp.above, cum[k]);
  };
  const int cross = top_p_last_at_least(mass, k_lo, k_hi, wanted);
  int k = cross >= 0 && top_p_edge(sp, cross) > lo ? cross : cross + 1;
  k = k < k_min ? k_min : (k > k_max ? k_max : k);
  *mid = top_p_edge(sp, k);
  return true;
}

// The span of the last level and its suffix sums (the executor's), after kTopPLevels histograms
// each over the window of the one before, starting from [0, hi]; nullptr from an executor
// without histograms.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T>
SD_HOST_DEVICE const float* top_p_locate(Ex& ex, int64_t n, const RowWeight<T>& f, float wanted,
                                         uint32_t hi, TopPSpan* span) {
  TopPSpan sp = top_p_span(0u, hi, 0.f);
  const float* cum = ex.top_p_histogram(n, f, sp);
  for (int level = 1; cum != nullptr && level < kTopPLevels && sp.shift > 0; ++level) {
    sp = top_p_window(sp, cum, wanted);
    cum = ex.top_p_histogram(n, f, sp);
  }
  *span = sp;
  return cum;
}

// The threshold of top_p_bisect (same arguments), by the search above: hi is the row's largest
// weight. When that weight alone holds `wanted`, so does the canonical mass at it (a sum of
// weights >= 0 that includes it is at least it, rounding being monotone): no pass is needed.
// Otherwise the histograms propose the tries; the executor's own proposal (top_p_candidate)
// comes first, and top_p_next_try's where neither has one.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T>
SD_HOST_DEVICE uint32_t top_p_settling_search(Ex& ex, int64_t n, const RowWeight<T>& f,
                                              float wanted, uint32_t hi) {
  if (bits_to_float(hi) >= wanted) return hi;
  uint32_t lo = 0u, back = 0u;
  bool found = false;
  TopPKnown known{false, 0.f, 0.f};
  ex.top_p_unsettle(n, f);
  TopPSpan sp;
  const float* cum = top_p_locate(ex, n, f, wanted, hi, &sp);
  while (lo < hi) {
    uint32_t mid = 0u;
    // A try outside (lo, hi] would leave the interval as it is and loop forever; the shared step
    // replaces it (any order of tries ends on the same threshold, so only the work changes).
    if (!ex.top_p_candidate(lo, hi, &mid) || mid <= lo || mid > hi) {
      if (!top_p_histogram_try(sp, cum, lo, hi, known, wanted, &mid) || mid <= lo || mid > hi) {
        mid = top_p_next_try(lo, hi, found, &back);
      }
    }
    const float mass = ex.top_p_trial(n, f, lo, mid, hi);
    const bool keep = mass >= wanted;
    if (keep) {
      lo = mid;
      found = true;
      known.lo_known = true;
      known.at_lo = mass;
    } else {
      hi = mid - 1u;
      known.above_hi = mass;
    }
    ex.top_p_settle(n, keep, lo, hi);
  }
  return lo;
}

// Scans a target row, and unless only the argmax is needed (greedy), finds the top-k and top-p
// thresholds and the total. Leaves the chunk sums of w in ex.sums(0).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T>
SD_HOST_DEVICE RowState prepare_row(Ex& ex, const T* row, int64_t n, const SeqParams& sp,
                                    bool need_distribution) {
  constexpr bool logits = !IsProb<T>::value;
  RowState st;
  st.max_raw = 0.f;
  st.argmax = 0;
  st.scaled_max = 0.f;
  st.kth = -kInf;
  st.wmin = 0.f;
  st.total = 0.f;
  st.status = 0;
  st.chunk_max = nullptr;
  st.chunk_scale = nullptr;
  const RowLoad<T> load{row};
  const bool top_k = sp.top_k > 0 && sp.top_k < n;
  const ScanHint hint{need_distribution && !top_k, sp.inv_temp};
  const ScanResult r = ex.scan(n, load, BadTarget{logits}, hint);
  if (r.bad) {
    st.status = kNonFiniteTarget;
    return st;
  }
  st.max_raw = r.max;
  st.argmax = r.argmax;
  if (logits ? !(r.max > -kInf) : !(r.max > 0.f)) {
    st.status = kZeroMassTarget;
    return st;
  }
  if (!need_distribution) return st;
  if (logits) {
    st.scaled_max = fmul(r.max, sp.inv_temp);
    if (!is_finite(st.scaled_max)) {
      st.status = kNonFiniteTarget;
      return st;
    }
    ex.chunk_scales(n, load, sp.inv_temp, st.scaled_max);
    st.chunk_max = ex.chunk_max();
    st.chunk_scale = ex.chunk_scale();
  }
  if (top_k) st.kth = ex.kth_largest(n, load, sp.top_k);
  float total = ex.chunk_sums(n, row_weight_of(row, sp.inv_temp, st), 0);
  // Logit weights are at most 1 each, so only a probability row's sum can overflow: its draws
  // would compare against an infinite total, so the row is flagged like an infinite entry.
  if (!logits && !(total < kInf)) {
    st.status = kNonFiniteTarget;
    return st;
  }
  if (sp.top_p < 1.f) {
    const float wanted = fmul(sp.top_p, total);
    const RowWeight<T> weight = row_weight_of(row, sp.inv_temp, st);
    st.wmin =
        bits_to_float(ex.top_p_threshold(n, weight, wanted, float_to_bits(weight(st.argmax))));
    total = ex.chunk_sums(n, row_weight_of(row, sp.inv_temp, st), 0);
  }
  st.total = total;
  if (!(total > 0.f)) st.status = kZeroMassTarget;
  return st;
}

// The parameters of sequence b from a call's [B] arrays (temperature <= 0 or NaN: greedy).
SD_HD_INLINE SeqParams sequence_params(const float* temperature, const int32_t* top_k,
                                       const float* top_p, const int64_t* seed,
                                       const int64_t* offset, int64_t b) {
  SeqParams sp;
  const float temp = temperature[b];
  sp.greedy = !(temp > 0.f);
  sp.inv_temp = sp.greedy ? 1.f : fdiv(1.f, temp);
  sp.top_k = top_k[b];
  sp.top_p = top_p[b];
  sp.seed = seed ? static_cast<uint64_t>(seed[b]) : 0u;
  sp.offset = offset ? static_cast<uint64_t>(offset[b]) : 0u;
  return sp;
}

// ---- the sampling distribution, materialised (sampling_probs) --------------------------------
// The distribution verify samples a target row's bonus or plain token from (prepare_row), written
// out: probs[i] = w(i) / total, so a drafter can sample its draft from exactly the processing the
// target gets and hand the rows to verify as draft_probs. Temperature 0: the one-hot of the
// argmax. A row with a NaN / +Inf value or no mass is left all zero, its status set.

struct DistributionArgs {
  const void* rows;          // [B, V] logits or probabilities
  const float* temperature;  // [B]
  const int32_t* top_k;      // [B]
  const float* top_p;        // [B]
  int64_t batch;
  int64_t vocab;
  bool logits;
  float* probs;     // [B, V]
  int32_t* status;  // [B]
};

// Row b of a DistributionArgs call. The executor writes the row: ex.write_probs(n, f, total,
// out) sets out[i] = fdiv(f(i), total), ex.write_one_hot(n, hot, out) sets out[hot] = 1 and the
// rest 0 (hot < 0: all 0).
template <class Ex, class T>
SD_HOST_DEVICE void distribution_sequence(Ex& ex, const DistributionArgs& a, int64_t b) {
  const SeqParams sp = sequence_params(a.temperature, a.top_k, a.top_p, nullptr, nullptr, b);
  const T* row = static_cast<const T*>(a.rows) + b * a.vocab;
  float* out = a.probs + b * a.vocab;
  const RowState st = prepare_row(ex, row, a.vocab, sp, !sp.greedy);
  if (st.status) {
    ex.write_one_hot(a.vocab, -1, out);
  } else if (sp.greedy) {
    ex.write_one_hot(a.vocab, st.argmax, out);
  } else {
    ex.write_probs(a.vocab, row_weight_of(row, sp.inv_temp, st), st.total, out);
  }
  if (ex.leader()) a.status[b] = st.status;
}

// ---- recursive rejection sampling over siblings sampled from q (without replacement) ----------
// Level 0 is (p, q). After rejecting the token x_l at level l:
//   p_{l+1} = max(p_l - q_l, 0) / beta_l,  beta_l = sum max(p_l - q_l, 0)
//   q_{l+1} = q_l without x_l, renormalised: q(y) / (1 - sum of q over the tried tokens)
// Given a rejection, p_l(x_l) <= q_l(x_l), so p_{l+1} has no mass on tried tokens either.
struct SiblingLevels {
  int levels;
  int32_t tried[kMaxSiblings];
  float beta[kMaxSiblings];
  float q_scale[kMaxSiblings + 1];  // 1 / (1 - tried q mass) at each level, 0 if none left
  float tried_q;
};

// (p_L(y), q_L(y)) at level L = levels.levels from w(y), q(y) of token y.
SD_HD_INLINE void level_pq(const SiblingLevels& lv, float w, float q, int64_t y, float inv_total,
                           float* p_out, float* q_out) {
  float p = fmul(w, inv_total);
  bool removed = false;
  for (int l = 0; l < lv.levels; ++l) {
    const float ql = removed ? 0.f : fmul(q, lv.q_scale[l]);
    const float d = fsub(p, ql);
    p = d > 0.f ? fdiv(d, lv.beta[l]) : 0.f;
    if (y == lv.tried[l]) removed = true;
  }
  *p_out = p;
  *q_out = removed ? 0.f : fmul(q, lv.q_scale[lv.levels]);
}

SD_HD_INLINE bool bad_prob(float q) { return !(q >= 0.f && q <= kFloatMax); }

// max(p_L - q_L, 0) of token y; NaN when q(y) is not a probability, which poisons the sum.
template <class T, class Q>
struct ResidualWeight {
  RowWeight<T> weight;
  const Q* qrow;
  const SiblingLevels* lv;
  float inv_total;
  SD_HD_INLINE float operator()(int64_t i) const {
    const float q = load_elem(qrow, i);
    if (bad_prob(q)) return bits_to_float(0x7fc00000u);  // quiet NaN
    float p, ql;
    level_pq(*lv, weight(i), q, i, inv_total, &p, &ql);
    const float d = fsub(p, ql);
    return d > 0.f ? d : 0.f;
  }
};

// The same at level 0 (every chain, and the first child of a tree node): branch-free, so that a
// CPU loop over the row vectorises. Bit-identical to ResidualWeight with levels == 0.
template <class T, class Q>
struct FirstResidualWeight {
  RowWeight<T> weight;
  const Q* qrow;
  float inv_total;
  // From the target weight w = weight(i): a backend that still holds w needs no second exp.
  SD_HD_INLINE float from_weight(float w, int64_t i) const {
    const float q = load_elem(qrow, i);
    const float d = fsub(fmul(w, inv_total), fmul(q, 1.f));
    const float r = d > 0.f ? d : 0.f;
    return bad_prob(q) ? bits_to_float(0x7fc00000u) : r;
  }
  SD_HD_INLINE float operator()(int64_t i) const { return from_weight(weight(i), i); }
};

// p_L itself (the fallback when the residual has no mass left).
template <class T, class Q>
struct LevelWeight {
  RowWeight<T> weight;
  const Q* qrow;
  const SiblingLevels* lv;
  float inv_total;
  SD_HD_INLINE float operator()(int64_t i) const {
    float p, ql;
    level_pq(*lv, weight(i), load_elem(qrow, i), i, inv_total, &p, &ql);
    return p;
  }
};

// w with the given tokens removed (deterministic siblings already tried): the correction's
// distribution once every deterministic child was rejected. Its canonical chunk sum is taken as
// the row's own S_c is (LocalSummed: the lane sum of the local weights, the removed tokens
// counted as 0, then one multiply by g_c), so a chunk that holds no removed token has exactly
// the row's S_c and a backend that kept the row's local weights needs no exp for it.
template <class T>
struct MaskedWeight {
  RowWeight<T> weight;
  const int32_t* removed;
  int count;
  SD_HD_INLINE bool is_removed(int64_t i) const {
    for (int k = 0; k < count; ++k) {
      if (removed[k] == i) return true;
    }
    return false;
  }
  SD_HD_INLINE float local(int64_t i) const { return is_removed(i) ? 0.f : weight.local(i); }
  SD_HD_INLINE float from_local(float l, int64_t i) const { return weight.from_local(l, i); }
  SD_HD_INLINE float operator()(int64_t i) const { return is_removed(i) ? 0.f : weight(i); }
};

template <class T>
struct LocalSummed<MaskedWeight<T>> {
  static constexpr bool value = true;
};

template <class T>
struct EntropyTerm {
  RowWeight<T> weight;
  SD_HD_INLINE float operator()(int64_t i) const {
    const float w = weight(i);
    return w > 0.f ? fmul(w, log_approx(w)) : 0.f;
  }
};

template <class T>
struct HeavierThan {
  RowWeight<T> weight;
  float than;
  SD_HD_INLINE bool operator()(int64_t i) const { return weight(i) > than; }
};

// ---- the arguments of a call, and the walk's helpers ----------------------------------------

struct VerifyArgs {
  const void* target;  // [B, N, V] logits or probabilities
  const void* draft;   // [B, N, V] or null
  // [B] or null: 1 where sequence b's children were chosen deterministically although `draft`
  // is given (a batch that mixes sampled and deterministic drafts); draft[b] is then not read.
  const uint8_t* draft_deterministic;
  const int32_t* tokens;     // [B, N]
  const int32_t* parents;    // [B, N] or null (chains)
  const int32_t* num_nodes;  // [B] or null
  const uint8_t* allow;      // [B, N] or null
  const float* temperature;  // [B]
  const int32_t* top_k;      // [B]
  const float* top_p;        // [B]
  const int64_t* seed;       // [B]
  const int64_t* offset;     // [B]
  int64_t batch;
  int n;
  int64_t vocab;
  int max_depth;
  bool logits;
  int32_t method;
  float eps;
  float alpha;
  int32_t topk_accept;
  bool correction_from_target;  // relaxed: correction from p instead of norm(max(p - q, 0))
  int32_t* emitted;             // [B, max_depth + 1]
  int32_t* num_emitted;         // [B]
  int32_t* path;                // [B, max_depth + 1]
  int32_t* status;              // [B]
  int32_t* num_accepted;        // [B]
};

// The next child of `node` after node `after` (-1: the first), or -1. Children are tried in
// ascending node order.
SD_HD_INLINE int next_child(const int32_t* parents, int node, int after, int count) {
  if (!parents) return (after < 0 && node + 1 < count) ? node + 1 : -1;
  for (int c = after < 0 ? node + 1 : after + 1; c < count; ++c) {
    if (parents[c] == node) return c;
  }
  return -1;
}

// Whether the first `count` nodes form a chain (each node has at most one child): in the tree
// format, where parents come before their children, exactly when node i's parent is i - 1.
SD_HD_INLINE bool is_chain(const int32_t* parents, int count) {
  if (!parents) return true;
  for (int i = 1; i < count; ++i) {
    if (parents[i] != i - 1) return false;
  }
  return true;
}

SD_HD_INLINE float draw_uniform(const SeqParams& sp, int node, RandPurpose purpose) {
  return uniform_from_bits(
      philox_draw(sp.seed, sp.offset, static_cast<uint32_t>(node), purpose, 0).v[0]);
}

// ---- the final draw ---------------------------------------------------------------------------
// A walk ends at the first node where no child is accepted with one token still to draw: the
// correction token from what is left of the node's target row, or the bonus token from a leaf's
// row. That draw is taken in three phases, so that a backend can spread its full-vocabulary pass
// over many workers (the CUDA backend: one thread block per (sequence, slice of chunks)):
//   1. walk_sequence: the walk. It stops before the draw's full-vocabulary pass and describes
//      the draw in a FinalDraw: which distribution (FinalForm), the row state its per-token
//      function needs, the uniform. A distribution whose chunk sums the walk already holds (the
//      row's own, kFinalRow: prepare_row took them) needs no pass: the backend copies those
//      sums (its sums(0)) to the draw's sums.
//   2. final_chunk_sums over a range [c_begin, c_end) of chunks: the canonical chunk sums of the
//      draw's distribution for those chunks. The chunk is the unit of every canonical sum, so any
//      partition of [0, chunks) into ranges, taken in any order, gives the same numbers.
//   3. finish_sequence: the total (the chunk sums added in chunk order), the checks and the rare
//      fallbacks (which take a second, whole-row pass with the same collective), the inverse-CDF
//      pick (which reads only the chosen chunk's elements) and the sequence's outputs.
// Phases 2 and 3 use one more collective of the executor:
//   void range_sums(n, f, c_begin, c_end, out)   canonical_chunk_sum of f for the chunks
//                                                [c_begin, c_end) into out[c_begin .. c_end)
// The CPU runs the three phases per sequence, phase 2 with one range (or, for tests, several;
// see src/verify.cc); the tokens equal those of the single walk that preceded the split.
enum FinalForm : int32_t {
  kFinalNone = 0,      // nothing to draw: `token` is the final token (greedy's argmax) or kPad
  kFinalRow = 1,       // w / total of the row (bonus, and corrections from p itself)
  kFinalResidual = 2,  // norm(max(p_L - q_L, 0)) at level L = lv.levels (q given)
  kFinalLevel = 3,     // p_L itself: a sibling's residual before the last had no mass left
  kFinalMasked = 4,    // w without the tried tokens (deterministic children, no q)
};

// Everything phases 2 and 3 need besides the inputs and the row's chunk data (FinalRows). The walk
// keeps its per-node sibling state in here, so the descriptor is that state at the stop node.
struct FinalDraw {
  int32_t form;      // FinalForm
  int32_t node;      // the stop node: the draw reads target[b, node] (and draft[b, node])
  int32_t accepted;  // accepted draft tokens (emitted[b, 0 .. accepted) are written)
  int32_t status;    // the walk's status bits
  int32_t token;     // kFinalNone: the final token, or kPad
  float u;           // the draw's uniform (RandPurpose::kSample at `node`)
  // The stop row's RowState, as RowWeight reads it (m_c and g_c are in FinalRows).
  float inv_temp;
  float kth;
  float scaled_max;
  float wmin;
  float total;
  // kFinalResidual at level 0: the draw is from norm(max(residual_scale * p - q, 0)); 1 except
  // for block verification, whose correction scales p by the block's p_tau (<= 1).
  float residual_scale;
  int32_t num_tried;            // kFinalMasked: tokens tried[0 .. num_tried) are removed
  int32_t tried[kMaxSiblings];  //
  SiblingLevels lv;             // kFinalResidual / kFinalLevel: the levels of p_L and q_L
};
static_assert(sizeof(FinalDraw) % 4 == 0, "FinalDraw is copied as 32-bit words");

// Where phases 2 and 3 find a sequence's per-chunk data: the stop row's m_c and g_c (logits
// rows) and the chunk sums of the draw's distribution.
struct FinalRows {
  const float* chunk_max;
  const float* chunk_scale;
  float* sums;
};

SD_HD_INLINE bool final_needs_sums(int32_t form) {
  return form == kFinalResidual || form == kFinalLevel || form == kFinalMasked;
}

// The CUDA backend's global workspace for the phases (allocated by the caller: the Python layer,
// with torch, final_workspace_bytes(batch, vocab) bytes, 16-byte aligned): a FinalDraw per
// sequence, then per sequence `chunks` floats each of m_c, g_c and the draw's chunk sums.
struct FinalWorkspace {
  FinalDraw* draws;    // [B]
  float* chunk_max;    // [B, chunks]
  float* chunk_scale;  // [B, chunks]
  float* sums;         // [B, chunks]
  int chunks;
  SD_HD_INLINE FinalRows rows(int64_t b) const {
    const int64_t at = b * chunks;
    return FinalRows{chunk_max + at, chunk_scale + at, sums + at};
  }
};

SD_HD_INLINE int64_t final_draws_bytes(int64_t batch) {
  return (batch * static_cast<int64_t>(sizeof(FinalDraw)) + 15) / 16 * 16;
}
SD_HD_INLINE int64_t final_workspace_bytes(int64_t batch, int64_t vocab) {
  return final_draws_bytes(batch) + 3 * batch * num_chunks(vocab) * static_cast<int64_t>(4);
}
SD_HD_INLINE FinalWorkspace final_workspace_at(void* base, int64_t batch, int64_t vocab) {
  FinalWorkspace ws;
  ws.chunks = num_chunks(vocab);
  ws.draws = static_cast<FinalDraw*>(base);
  float* floats = reinterpret_cast<float*>(static_cast<char*>(base) + final_draws_bytes(batch));
  const int64_t per = batch * ws.chunks;
  ws.chunk_max = floats;
  ws.chunk_scale = floats + per;
  ws.sums = floats + 2 * per;
  return ws;
}

// Chunks [*begin, *end) of slice s of `slices`: a balanced partition of [0, chunks) (a slice is
// empty when slices > chunks).
SD_HD_INLINE void slice_chunks(int chunks, int slices, int s, int* begin, int* end) {
  *begin = static_cast<int>(static_cast<int64_t>(s) * chunks / slices);
  *end = static_cast<int>(static_cast<int64_t>(s + 1) * chunks / slices);
}

template <class T>
SD_HD_INLINE RowWeight<T> final_row_weight(const VerifyArgs& a, int64_t row_index,
                                           const FinalDraw& fd, const FinalRows& rows) {
  const T* trow = static_cast<const T*>(a.target) + row_index * a.vocab;
  return RowWeight<T>{trow,    fd.inv_temp,    fd.kth,          fd.scaled_max,
                      fd.wmin, rows.chunk_max, rows.chunk_scale};
}

// Sequence b's draft rows [N, V], or null where its children were chosen deterministically (no
// draft, or a row flagged in draft_deterministic): the walk's rules and the final draw's forms
// follow from this alone.
template <class Q>
SD_HD_INLINE const Q* sequence_draft(const VerifyArgs& a, int64_t b) {
  if (!a.draft || (a.draft_deterministic && a.draft_deterministic[b])) return nullptr;
  return static_cast<const Q*>(a.draft) + b * a.n * a.vocab;
}

template <class Q>
SD_HD_INLINE const Q* final_draft_row(const VerifyArgs& a, int64_t b, int node) {
  const Q* draft = sequence_draft<Q>(a, b);
  return draft ? draft + static_cast<int64_t>(node) * a.vocab : nullptr;
}

// The final draw from node `node`'s target row (prepared as st): its form, its uniform (the
// node's kSample draw) and the row state phases 2 and 3 read.
SD_HD_INLINE void describe_final_draw(FinalDraw& fd, int32_t form, int node, const SeqParams& sp,
                                      const RowState& st) {
  fd.form = form;
  fd.node = node;
  fd.u = draw_uniform(sp, node, RandPurpose::kSample);
  fd.inv_temp = sp.inv_temp;
  fd.kth = st.kth;
  fd.scaled_max = st.scaled_max;
  fd.wmin = st.wmin;
  fd.total = st.total;
}

// ---- block verification of a sampled chain (method kBlock) -----------------------------------
// Sun et al., "Block Verification Accelerates Speculative Decoding" (ICLR 2025): the drafts
// x_1 .. x_g of a chain sampled from q are judged as one block. With P_j and Q_j the target's and
// the draft's rows at node j (node j's child is x_{j+1}):
//   p_0 = 1,   p_j = min(1, p_{j-1} P_{j-1}(x_j) / Q_{j-1}(x_j))
//   r_j = sum_y max(p_j P_j(y) - Q_j(y), 0)
//   h_j = r_j / (r_j + 1 - p_j) for 1 <= j < g (1 where p_j = 1),   h_g = p_g
// tau is the largest j >= 1 with u_j < h_j (0 if there is none): x_1 .. x_tau are accepted, and
// the last token is drawn from norm(max(p_tau P_tau - Q_tau, 0)) (tau < g) or from P_g (tau = g).
// The emitted tokens follow the target's law, as token-by-token verification's do, also when the
// drafter chose the chain's length from its own drafts; in expectation no valid rule accepts more
// of a block, and a draft that the token-by-token test would reject is still kept when a later
// test passes. Once p_j = 0 every later h is 0, so no row past it is read. The uniforms are the
// token-by-token walk's: u_j is node j's kAccept draw, the final draw node tau's (or g's) kSample.
// A bad row met on the way ends the sequence with the drafts accepted before it and no final
// token (its status says why), as the token-by-token walk does at the node it stops.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T, class Q>
SD_HOST_DEVICE int32_t walk_block_chain(Ex& ex, const VerifyArgs& a, int64_t b, int count,
                                        const SeqParams& sp, const Q* draft, FinalDraw& fd) {
  const int64_t vocab = a.vocab;
  const T* target = static_cast<const T*>(a.target) + b * a.n * vocab;
  const int32_t* tokens = a.tokens + b * a.n;
  const int g = count - 1;
  int32_t status = 0;
  float p = 1.f;  // p_j of the node j the loop is at
  int tau = 0;
  float p_tau = 1.f;
  // Row 0's state from j = 0 on (tau = 0), then row tau's: set before any return that reads it.
  RowState st_tau{};
  int last = -1;  // the row the executor's chunk data belongs to
  for (int j = 0; j <= g; ++j) {
    const T* trow = target + static_cast<int64_t>(j) * vocab;
    const RowState st = prepare_row(ex, trow, vocab, sp, true);
    if (st.status) {
      status |= st.status;
      break;
    }
    last = j;
    const RowWeight<T> weight = row_weight_of(trow, sp.inv_temp, st);
    const Q* qrow = draft + static_cast<int64_t>(j) * vocab;
    const float inv_total = fdiv(1.f, st.total);
    if (j == 0) st_tau = st;
    if (j >= 1) {
      // h_j <= p_j (r_j <= p_j), so where u_j >= p_j the test fails without the pass over the
      // rows that r_j takes: a chain whose p has fallen costs no residual passes.
      const float u = draw_uniform(sp, j, RandPurpose::kAccept);
      float h = p;  // h_g = p_g; h_j = 1 where p_j = 1
      if (j < g && p < 1.f && u < p) {
        const float r =
            ex.chunk_sums(vocab, FirstResidualWeight<T, Q>{weight, qrow, fmul(inv_total, p)}, 1);
        if (is_nan(r)) {
          status |= kBadDraftRow;
          break;
        }
        h = fdiv(r, fadd(r, fsub(1.f, p)));
      }
      if (u < h) {
        tau = j;
        p_tau = p;
        st_tau = st;
      }
    }
    if (j == g) break;
    const int32_t x = tokens[j + 1];
    const float qx = load_elem(qrow, x);
    if (bad_prob(qx)) {
      status |= kBadDraftRow;
      break;
    }
    // min(1, p P(x) / q(x)); a draft with q(x) = 0 counts as infinitely unlikely (p = 1 iff
    // p P(x) > 0), as in the token-by-token test u q(x) < p(x).
    const float num = fmul(p, fmul(weight(x), inv_total));
    p = num > 0.f ? (num >= qx ? 1.f : fdiv(num, qx)) : 0.f;
    if (!(p > 0.f)) break;
  }
  if (ex.leader()) {
    int32_t* emitted = a.emitted + b * (a.max_depth + 1);
    int32_t* path = a.path + b * (a.max_depth + 1);
    for (int i = 1; i <= tau; ++i) {
      emitted[i - 1] = tokens[i];
      path[i] = i;
    }
  }
  fd.accepted = tau;
  if (status != 0) return status;
  if (tau < g && last != tau) {
    // The correction reads row tau's chunk maxima and scales: take them again (same numbers).
    prepare_row(ex, target + static_cast<int64_t>(tau) * vocab, vocab, sp, true);
  }
  describe_final_draw(fd, tau == g ? kFinalRow : kFinalResidual, tau, sp, st_tau);
  fd.residual_scale = tau == g ? 1.f : p_tau;
  return status;
}

// ---- the walk (phase 1) -----------------------------------------------------------------------

// Walks sequence b and leaves its final draw in fd (see above). Every thread of a GPU block runs
// this with identical control flow (all decisions come from collectives whose results every
// thread sees), each with its own fd; only the leader writes outputs.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T, class Q>
SD_HOST_DEVICE void walk_sequence(Ex& ex, const VerifyArgs& a, int64_t b, FinalDraw& fd) {
  const int n = a.n;
  const int64_t vocab = a.vocab;
  const int width = a.max_depth + 1;
  int32_t* emitted = a.emitted + b * width;
  int32_t* path = a.path + b * width;
  if (ex.leader()) {
    for (int i = 0; i < width; ++i) emitted[i] = path[i] = kPad;
  }
  fd.form = kFinalNone;
  fd.node = 0;
  fd.token = kPad;
  fd.u = 0.f;
  fd.inv_temp = 1.f;
  fd.kth = -kInf;
  fd.scaled_max = 0.f;
  fd.wmin = 0.f;
  fd.total = 0.f;
  fd.residual_scale = 1.f;
  fd.num_tried = 0;
  SiblingLevels& lv = fd.lv;
  lv.levels = 0;
  lv.q_scale[0] = 1.f;
  lv.tried_q = 0.f;

  int32_t status = 0;
  int count = n;
  const int32_t* parents = a.parents ? a.parents + b * n : nullptr;
  if (parents) {
    int bad = 0;
    if (validate_tree_row(parents, n, &count, &bad) != TreeError::kOk) status |= kBadTree;
  }
  if (a.num_nodes && status == 0) {
    const int32_t given = a.num_nodes[b];
    if (given < 1 || given > count) {
      status |= kBadTree;
    } else {
      count = given;
    }
  }
  const int32_t* tokens = a.tokens + b * n;
  if (status == 0) {
    for (int i = 1; i < count; ++i) {
      if (tokens[i] < 0 || tokens[i] >= vocab) {
        status |= kBadToken;
        break;
      }
    }
  }
  const uint8_t* allow = a.allow ? a.allow + b * n : nullptr;
  const T* target = static_cast<const T*>(a.target);
  const Q* draft = sequence_draft<Q>(a, b);

  const SeqParams sp = sequence_params(a.temperature, a.top_k, a.top_p, a.seed, a.offset, b);
  const bool greedy = a.method == kGreedy || sp.greedy;
  const bool from_target = a.method == kRelaxed && a.correction_from_target;
  // The whole tree against max_depth and, where the walk keeps its tried siblings in
  // kMaxSiblings slots (exact and relaxed sampling), the children per node: so that whether a
  // row is refused depends on its tree, not on where the draws lead the walk (which checks
  // again as it goes, for the bounds of its arrays). Only where a tree could break a limit.
  const bool sibling_limit =
      !greedy && (a.method == kExact || a.method == kRelaxed || a.method == kBlock);
  if (status == 0 && !parents && count - 1 > a.max_depth) status |= kDepthOverflow;
  if (status == 0 && parents &&
      (count - 1 > a.max_depth || (sibling_limit && count - 1 > kMaxSiblings))) {
    const TreeLimits lim = ex.tree_limits(parents, count);
    if (lim.depth > a.max_depth) status |= kDepthOverflow;
    if (sibling_limit && lim.children > kMaxSiblings) status |= kTooManySiblings;
  }

  int accepted_count = 0;
  int node = 0;
  if (status == 0 && ex.leader()) path[0] = 0;
  if (status == 0 && a.method == kBlock && draft && !greedy && is_chain(parents, count)) {
    fd.status = walk_block_chain<Ex, T, Q>(ex, a, b, count, sp, draft, fd);
    return;
  }
  while (status == 0) {
    const int64_t row_index = b * n + node;
    const T* trow = target + row_index * vocab;
    const RowState st = prepare_row(ex, trow, vocab, sp, !greedy);
    if (st.status) {
      status |= st.status;
      break;
    }
    const int first = next_child(parents, node, -1, count);
    if (first >= 0 && accepted_count + 1 > a.max_depth) {
      status |= kDepthOverflow;
      break;
    }
    const RowWeight<T> weight = row_weight_of(trow, sp.inv_temp, st);
    int accepted = -1;
    int32_t form = kFinalNone;  // the draw at this node when no child is accepted

    if (greedy) {
      // The target's own choice first; an allowed child (a judge's) stands in only where no
      // child is the argmax, so that an allowed sibling never displaces the target's pick.
      int allowed = -1;
      for (int c = first; c >= 0; c = next_child(parents, node, c, count)) {
        if (tokens[c] == st.argmax) {
          accepted = c;
          break;
        }
        if (allowed < 0 && allow && allow[c]) allowed = c;
      }
      if (accepted < 0) accepted = allowed;
      if (accepted < 0) fd.token = static_cast<int32_t>(st.argmax);
    } else if (first < 0) {
      // A leaf: the bonus token from the target row.
      form = kFinalRow;
    } else if (a.method == kTypical || a.method == kTopKAccept) {
      float threshold = 0.f;
      if (a.method == kTypical) {
        // H = log Z - sum(w log w) / Z; accept p(x) > min(eps, alpha * exp(-H)).
        const float s = ex.chunk_sums(vocab, EntropyTerm<T>{weight}, 1);
        const float entropy = fsub(log_approx(st.total), fdiv(s, st.total));
        const float typical = fmul(a.alpha, exp_approx(-entropy));
        threshold = a.eps < typical ? a.eps : typical;
      }
      for (int c = first; c >= 0; c = next_child(parents, node, c, count)) {
        if (allow && allow[c]) {
          accepted = c;
          break;
        }
        const float wx = weight(tokens[c]);
        bool ok;
        if (a.method == kTypical) {
          ok = fdiv(wx, st.total) > threshold;
        } else {
          ok = wx > 0.f && ex.count_if(vocab, HeavierThan<T>{weight, wx}) < a.topk_accept;
        }
        if (ok) {
          accepted = c;
          break;
        }
      }
      if (accepted < 0) form = kFinalRow;
    } else if (draft) {
      // Exact / relaxed with siblings sampled from q = draft[b, node] without replacement.
      const Q* qrow = draft + static_cast<int64_t>(node) * vocab;
      const float inv_total = fdiv(1.f, st.total);
      lv.levels = 0;
      lv.q_scale[0] = 1.f;
      lv.tried_q = 0.f;
      bool residual_empty = false;
      for (int c = first; c >= 0; c = next_child(parents, node, c, count)) {
        if (allow && allow[c]) {
          accepted = c;
          break;
        }
        if (lv.levels == kMaxSiblings) {
          status |= kTooManySiblings;
          break;
        }
        const int32_t x = tokens[c];
        const float qraw = load_elem(qrow, x);
        if (bad_prob(qraw)) {
          status |= kBadDraftRow;
          break;
        }
        float px, qx;
        level_pq(lv, weight(x), qraw, x, inv_total, &px, &qx);
        // u * q < p handles q(x) = 0 (accept iff p(x) > 0) and p(x) = 0 (always reject).
        const float u = draw_uniform(sp, c, RandPurpose::kAccept);
        const float bound = a.method == kRelaxed ? fadd(px, fmul(a.eps, qx)) : px;
        if (fmul(u, qx) < bound) {
          accepted = c;
          break;
        }
        // The residual after the last sibling serves only the correction draw: its sums are the
        // draw's (phase 2), taken at level lv.levels as it is now. With the correction from p
        // itself they are still taken here, where a NaN in q flags the row as for any sibling.
        if (!from_target && next_child(parents, node, c, count) < 0) break;
        const float beta =
            lv.levels == 0
                ? ex.chunk_sums(vocab, FirstResidualWeight<T, Q>{weight, qrow, inv_total}, 1)
                : ex.chunk_sums(vocab, ResidualWeight<T, Q>{weight, qrow, &lv, inv_total}, 1);
        if (is_nan(beta)) {
          status |= kBadDraftRow;
          break;
        }
        if (!(beta > 0.f)) {
          // p_L <= q_L everywhere yet x was rejected (rounding): nothing is left to move, so the
          // correction comes from p_L itself.
          residual_empty = true;
          break;
        }
        bool seen = false;
        for (int l = 0; l < lv.levels; ++l) seen = seen || lv.tried[l] == x;
        if (!seen) lv.tried_q = fadd(lv.tried_q, qraw);
        lv.tried[lv.levels] = x;
        lv.beta[lv.levels] = beta;
        const float left = fsub(1.f, lv.tried_q);
        lv.q_scale[lv.levels + 1] = left > 0.f ? fdiv(1.f, left) : 0.f;
        ++lv.levels;
      }
      if (status != 0) break;
      if (accepted < 0) {
        // Without from_target or an empty residual, the loop ended at the last sibling's break
        // above (every earlier rejection continues to a next sibling).
        form = from_target ? kFinalRow : residual_empty ? kFinalLevel : kFinalResidual;
      }
    } else {
      // Exact / relaxed with deterministic children (no q): accept c with
      // p(c) / (1 - p(tried)) (+ eps for relaxed); the residual is p without the tried tokens.
      int32_t* tried = fd.tried;
      int num_tried = 0;
      float tried_w = 0.f;
      for (int c = first; c >= 0; c = next_child(parents, node, c, count)) {
        if (allow && allow[c]) {
          accepted = c;
          break;
        }
        if (num_tried == kMaxSiblings) {
          status |= kTooManySiblings;
          break;
        }
        const int32_t x = tokens[c];
        bool seen = false;
        for (int k = 0; k < num_tried; ++k) seen = seen || tried[k] == x;
        const float wx = seen ? 0.f : weight(x);
        const float left_raw = fsub(st.total, tried_w);
        const float left = left_raw > 0.f ? left_raw : 0.f;
        const float u = draw_uniform(sp, c, RandPurpose::kAccept);
        const float bound = a.method == kRelaxed ? fadd(wx, fmul(a.eps, left)) : wx;
        if (fmul(u, left) < bound) {
          accepted = c;
          break;
        }
        if (!seen) {
          tried[num_tried++] = x;
          tried_w = fadd(tried_w, wx);
        }
      }
      fd.num_tried = num_tried;
      if (status != 0) break;
      if (accepted < 0) form = (from_target || num_tried == 0) ? kFinalRow : kFinalMasked;
    }

    if (accepted >= 0) {
      if (ex.leader()) {
        emitted[accepted_count] = tokens[accepted];
        path[accepted_count + 1] = accepted;
      }
      ++accepted_count;
      node = accepted;
      continue;
    }
    if (form != kFinalNone) describe_final_draw(fd, form, node, sp, st);
    break;
  }
  fd.accepted = accepted_count;
  fd.status = status;
}

// ---- phase 2: the draw's chunk sums over a range of chunks ------------------------------------

// Canonical chunk sums of the draw's distribution for chunks [c_begin, c_end) into rows.sums;
// nothing for a draw that needs none (final_needs_sums). Every thread of a block calls it.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T, class Q>
SD_HOST_DEVICE void final_chunk_sums(Ex& ex, const VerifyArgs& a, int64_t b, const FinalDraw& fd,
                                     const FinalRows& rows, int c_begin, int c_end) {
  if (!final_needs_sums(fd.form)) return;
  const int64_t row_index = b * a.n + fd.node;
  const RowWeight<T> weight = final_row_weight<T>(a, row_index, fd, rows);
  const Q* qrow = final_draft_row<Q>(a, b, fd.node);
  const float inv_total = fdiv(1.f, fd.total);
  if (fd.form == kFinalMasked) {
    ex.range_sums(a.vocab, MaskedWeight<T>{weight, fd.tried, fd.num_tried}, c_begin, c_end,
                  rows.sums);
  } else if (fd.form == kFinalLevel) {
    ex.range_sums(a.vocab, LevelWeight<T, Q>{weight, qrow, &fd.lv, inv_total}, c_begin, c_end,
                  rows.sums);
  } else if (fd.lv.levels == 0) {
    ex.range_sums(a.vocab,
                  FirstResidualWeight<T, Q>{weight, qrow, fmul(inv_total, fd.residual_scale)},
                  c_begin, c_end, rows.sums);
  } else {
    ex.range_sums(a.vocab, ResidualWeight<T, Q>{weight, qrow, &fd.lv, inv_total}, c_begin, c_end,
                  rows.sums);
  }
}

// ---- phase 3: total, pick, outputs ------------------------------------------------------------

// Every thread of a block runs this with identical control flow (the sums it reads are the same
// for all; range_sums is a collective); only the leader writes the outputs.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Ex, class T, class Q>
SD_HOST_DEVICE void finish_sequence(Ex& ex, const VerifyArgs& a, int64_t b, const FinalDraw& fd,
                                    const FinalRows& rows) {
  const int64_t vocab = a.vocab;
  const int chunks = num_chunks(vocab);
  int32_t status = fd.status;
  int64_t token = fd.token;
  if (fd.form != kFinalNone) {
    const int64_t row_index = b * a.n + fd.node;
    const RowWeight<T> weight = final_row_weight<T>(a, row_index, fd, rows);
    const Q* qrow = final_draft_row<Q>(a, b, fd.node);
    const float inv_total = fdiv(1.f, fd.total);
    if (fd.form == kFinalRow) {
      token = pick_by_cdf(weight, rows.sums, vocab, fd.total, fd.u);
    } else if (fd.form == kFinalMasked) {
      const MaskedWeight<T> masked{weight, fd.tried, fd.num_tried};
      const float total = sequential_total(rows.sums, chunks);
      if (total > 0.f) {
        token = pick_by_cdf(masked, rows.sums, vocab, total, fd.u);
      } else {
        // The tried tokens held all the mass (only by rounding, as one would have been
        // accepted): the draw falls back to the full row, whose S_c are taken again.
        ex.range_sums(vocab, weight, 0, chunks, rows.sums);
        token = pick_by_cdf(weight, rows.sums, vocab, fd.total, fd.u);
      }
    } else {
      const LevelWeight<T, Q> level{weight, qrow, &fd.lv, inv_total};
      float total = sequential_total(rows.sums, chunks);
      bool from_level = fd.form == kFinalLevel;
      bool bad_draft = false;
      if (fd.form == kFinalResidual) {
        if (is_nan(total)) {
          // A draft probability of the row is NaN, Inf or negative: no correction token.
          status |= kBadDraftRow;
          bad_draft = true;
        } else if (!(total > 0.f)) {
          // p_L <= q_L everywhere yet the last sibling was rejected (rounding): nothing is left
          // to move, so the correction comes from p_L itself.
          ex.range_sums(vocab, level, 0, chunks, rows.sums);
          total = sequential_total(rows.sums, chunks);
          from_level = true;
        }
      }
      if (!bad_draft) {
        if (from_level) {
          token = pick_by_cdf(level, rows.sums, vocab, total, fd.u);
        } else if (fd.lv.levels == 0) {
          const float scaled = fmul(inv_total, fd.residual_scale);
          token = pick_by_cdf(FirstResidualWeight<T, Q>{weight, qrow, scaled}, rows.sums, vocab,
                              total, fd.u);
        } else {
          token = pick_by_cdf(ResidualWeight<T, Q>{weight, qrow, &fd.lv, inv_total}, rows.sums,
                              vocab, total, fd.u);
        }
      }
    }
  }
  if (ex.leader()) {
    const int width = a.max_depth + 1;
    int accepted = fd.accepted;
    const bool has_final = token >= 0 && (status & (kBadTree | kBadToken)) == 0;
    if (has_final) a.emitted[b * width + accepted] = static_cast<int32_t>(token);
    if (status & (kBadTree | kBadToken)) accepted = 0;
    a.num_emitted[b] = accepted + (has_final ? 1 : 0);
    a.num_accepted[b] = accepted;
    a.status[b] = status;
  }
}

}  // namespace verify
}  // namespace sd
