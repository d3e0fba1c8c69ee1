// Tree-masked attention on the CPU: split-KV flash attention over (batch, KV head, prefix split).
//
// A work item owns one KV head of one sequence and all T x (Hq / Hkv) query rows that share it,
// so each prefix key and value is read from memory once per KV head. Keys are streamed in blocks
// of kBlock positions: the block's keys are converted to fp32 and transposed (so the score tile
// is a small register-blocked GEMM), its values converted to fp32 (bf16 with AVX512_BF16: paired
// for vdpbf16ps), and every query row updates its online-softmax state with the shared math of
// specdecode/attention.h. With few query rows per KV head the prefix and the tree nodes take one
// of two cheaper paths on AVX2 / AVX-512: up to 4 rows the streaming path (stream_range: per-key
// dot products, the cache read in address order), from 5 to 16 rows on AVX-512 and 5 to 8 on
// AVX2 the lane path (lane_range: the rows of a KV head in the lanes of one vector). With AMX,
// bf16 runs on AMX tile multiplies from 8 rows on (5 to 7 take the lane path): 8 to 16 rows with
// the scores transposed, the keys read from the cache as the tiles' A operands and the rows in
// lanes (amx_key_range), 17 to 31 as the tiles above, and from 32 rows on as 32-row tiles over
// chunks of 128 keys (amx_chunk_range).
//
// The prefix [0, prefix_len) is dense and unmasked; the tree [prefix_len, prefix_len + T) uses
// the bitmask. They accumulate into separate states that are merged with the log-sum-exp rule,
// like the prefix splits of a long cache. The split size is a function of the shapes only
// (make_shape, split_keys_of), never of the thread count, so results do not depend on the number
// of threads; how many KV heads an item takes may follow the thread count (heads_per_item), as a
// head's rows compute the same in any item.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's AVX-512 headers build _mm512_undefined_* from a self-initialised variable, which
// -Wuninitialized reports at every inlined use; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
#define SD_X86 1
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "specdecode/attention.h"
#include "specdecode/attention_ops.h"
#include "specdecode/host_device.h"
#include "specdecode/parallel.h"

namespace sd {
namespace cpu {
namespace {

constexpr int kBlock = 64;   // keys per block: 4 vectors of 16 floats
constexpr int kRowTile = 8;  // query rows per register tile
// amx_chunk_range: rows per AMX tile, query rows per row tile (two AMX tiles) and keys per
// chunk (kChunkBlocks blocks).
constexpr int kAmxRows = 16;
constexpr int kChunkRows = 2 * kAmxRows;
constexpr int kChunkBlocks = 2;
constexpr int kChunkKeys = kChunkBlocks * kBlock;
// The streaming prefix path (AVX-512 and AVX2, at most K::kStreamRows query rows per KV head):
// keys per block. Scores of a block are 16 floats per query row.
constexpr int kStreamKeys = 16;
// The lane path (see lanes_transpose): query rows per vector at the most (Lanes16). The lane
// softmax state and the bf16 weight pairs keep this stride at every lane width.
constexpr int kLanes = 16;

// ---- element access ------------------------------------------------------------------------

template <AttnDType DT>
struct Elem;
template <>
struct Elem<AttnDType::kFloat32> {
  using T = float;
  static float load(const T* p) { return *p; }
  static T store(float f) { return f; }
};
template <>
struct Elem<AttnDType::kFloat16> {
  using T = uint16_t;
  static float load(const T* p) { return half_to_float(*p); }
  static T store(float f) { return float_to_half(f); }
};
template <>
struct Elem<AttnDType::kBFloat16> {
  using T = uint16_t;
  static float load(const T* p) { return bf16_to_float(*p); }
  static T store(float f) { return float_to_bf16(f); }
};

// ---- head dims -------------------------------------------------------------------------------
// fn(std::integral_constant<int, D>{}) for the compile-time head dim D equal to d (32, 64, 80, 96,
// 128; any other validated d is 256), for the kernels whose register arrays are sized by D.
template <class Fn>
SD_FORCE_INLINE void with_head_dim(int d, const Fn& fn) {
  switch (d) {
    case 32:
      return fn(std::integral_constant<int, 32>{});
    case 64:
      return fn(std::integral_constant<int, 64>{});
    case 80:
      return fn(std::integral_constant<int, 80>{});
    case 96:
      return fn(std::integral_constant<int, 96>{});
    case 128:
      return fn(std::integral_constant<int, 128>{});
    default:
      return fn(std::integral_constant<int, 256>{});
  }
}

// ---- portable kernels ----------------------------------------------------------------------
// Layouts: kt [D][kBlock] (transposed keys, zero past n), vb [n][D], s/p [rows][kBlock],
// o [rows][D], q [rows][D].

template <AttnDType DT>
SD_FORCE_INLINE void generic_load_kt(const typename Elem<DT>::T* k, int64_t row_stride, int n,
                                     int d, float* kt) {
  for (int j = 0; j < kBlock; ++j) {
    const typename Elem<DT>::T* row = k + j * row_stride;
    for (int i = 0; i < d; ++i) kt[i * kBlock + j] = j < n ? Elem<DT>::load(row + i) : 0.0f;
  }
}

template <AttnDType DT>
SD_FORCE_INLINE void generic_load_rows(const typename Elem<DT>::T* src, int64_t row_stride, int n,
                                       int d, float mult, float* dst) {
  for (int j = 0; j < n; ++j) {
    const typename Elem<DT>::T* row = src + j * row_stride;
    for (int i = 0; i < d; ++i) dst[j * d + i] = Elem<DT>::load(row + i) * mult;
  }
}

SD_FORCE_INLINE void generic_scores(const float* q, int rows, int d, const float* kt, float* s) {
  for (int r = 0; r < rows; ++r) {
    float acc[kBlock] = {};
    for (int i = 0; i < d; ++i) {
      const float qv = q[r * d + i];
      const float* krow = kt + i * kBlock;
      for (int j = 0; j < kBlock; ++j) acc[j] += qv * krow[j];
    }
    for (int j = 0; j < kBlock; ++j) s[r * kBlock + j] = acc[j];
  }
}

// Turns one row of scores into probabilities in place; returns the accumulator's rescale factor.
SD_FORCE_INLINE float generic_softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
  float block_max = -INFINITY;
  for (int j = 0; j < kBlock; ++j) {
    if ((visible >> j) & 1u) block_max = std::max(block_max, s[j]);
  }
  const float alpha = softmax_rescale(state, block_max);
  const float ref = softmax_reference(state->m);
  float sum = 0.0f;
  for (int j = 0; j < kBlock; ++j) {
    const float p = ((visible >> j) & 1u) ? std::exp2(s[j] - ref) : 0.0f;
    s[j] = p;
    sum += p;
  }
  state->l += sum;
  return alpha;
}

template <AttnDType VT>
SD_FORCE_INLINE void generic_pv(const float* p, int rows, int n, const typename Elem<VT>::T* vb,
                                int64_t vs, int d, const float* alpha, float* o) {
  for (int r = 0; r < rows; ++r) {
    float* orow = o + r * d;
    for (int i = 0; i < d; ++i) orow[i] *= alpha[r];
    for (int j = 0; j < n; ++j) {
      const float pj = p[r * kBlock + j];
      if (pj == 0.0f) continue;
      const typename Elem<VT>::T* vrow = vb + j * vs;
      for (int i = 0; i < d; ++i) orow[i] += pj * Elem<VT>::load(vrow + i);
    }
  }
}

struct GenericKernels {
  static constexpr bool kAmx = false;  // the tiles' products on AMX (AmxKernels)
  // Row counts up to this read the values in place in the tiles (no staging; see attend_range).
  static constexpr int kDirectRows = kRowTile;
  static constexpr bool kStream = false;     // no stream_scores: prefix blocks use the tiles
  static constexpr bool kTilePairs = false;  // the tiles' P V in fp32 (see attend_range)
  static constexpr int kStreamRows = 0;
  static constexpr int kLaneRows = 0;  // no lane path either
  template <AttnDType DT>
  static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d, float* kt) {
    generic_load_kt<DT>(k, rs, n, d, kt);
  }
  template <AttnDType DT>
  static void load_rows(const typename Elem<DT>::T* src, int64_t rs, int n, int d, float mult,
                        float* dst) {
    generic_load_rows<DT>(src, rs, n, d, mult, dst);
  }
  template <AttnDType DT>
  static void load_q(const typename Elem<DT>::T* src, int d, float mult, float* dst) {
    generic_load_rows<DT>(src, 0, 1, d, mult, dst);
  }
  static void scores(const float* q, int rows, int d, const float* kt, float* s, float) {
    generic_scores(q, rows, d, kt, s);
  }
  static float softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
    return generic_softmax_row(s, visible, state);
  }
  template <AttnDType VT>
  static void pv(const float* p, int rows, int n, const typename Elem<VT>::T* vb, int64_t vs, int d,
                 const float* alpha, float* o) {
    generic_pv<VT>(p, rows, n, vb, vs, d, alpha, o);
  }
};

// ---- next-block hints ----------------------------------------------------------------------
// Outside the x86 section: the drivers (stream_range, lane_range_of) name NextKeys on every
// target, and __builtin_prefetch is GCC's and Clang's on any architecture.

// A hint that parks a line in L2 (prefetcht1), not L1: see stream_range. Only the x86 kernels
// hint, so elsewhere nothing calls it (clang would say it is not needed).
[[maybe_unused]] SD_FORCE_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Share `part` of `parts` of the `elems` elements at k and of those at v, hinted into L2 line by
// line in address order, a line of k then the same line of v (the shares are whole lines; the
// last may be shorter or empty).
template <class T>
SD_FORCE_INLINE void hint_shares(const T* k, const T* v, int64_t elems, int part, int parts) {
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  const int64_t share = (bytes / parts + 63) / 64 * 64;
  const char* kc = reinterpret_cast<const char*>(k);
  const char* vc = reinterpret_cast<const char*>(v);
  for (int64_t b = part * share; b < std::min(bytes, (part + 1) * share); b += 64) {
    prefetch_l2(kc + b);
    prefetch_l2(vc + b);
  }
}

// The keys of an item's next block: key j of KV head h at k + j * rs + h * hs, for j < n (n = 0
// after the item's last block). They are hinted into L2 apart from the values, which the P V
// hints, so the keys' transfer overlaps the scores and the values' the P V: the streaming
// scores hint one key row of the next block per key row they read (stream_range), the lane
// path hints a head's next keys before the head's scores (lane_range_of).
template <class T>
struct NextKeys {
  const T* k;
  int n;
  int64_t rs, hs;  // elements between key rows, between KV heads
  // Hints the first `bytes` bytes of key j of KV head h.
  SD_FORCE_INLINE void hint(int j, int h, int bytes) const {
    if (j >= n) return;
    const char* p = reinterpret_cast<const char*>(k + j * rs + h * hs);
    for (int b = 0; b < bytes; b += 64) prefetch_l2(p + b);
  }
  // The view of a loop that starts at key j of the block.
  NextKeys from(int j) const {
    return j < n ? NextKeys{k + j * rs, n - j, rs, hs} : NextKeys{k, 0, rs, hs};
  }
};

#ifdef SD_X86
#define SD_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SD_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// AVX-512 with AVX512_BF16 (vdpbf16ps, vcvtneps2bf16): see Avx512Bf16Kernels.
#define SD_TARGET_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

// 2^f on |f| <= 1/2 for exp2_avx2 and exp2_avx512: the degree-7 Taylor polynomial of 2^f,
// coefficients ln2^k / k! from k = 7 down to 0 (relative error < 1e-8, below fp32 rounding).
constexpr float kExp2Poly[8] = {1.5252733804059841e-05f, 1.5403530393381606e-04f,
                                1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                6.9314718055994531e-01f, 1.0f};

// 2^f on |f| <= 1/2 for exp2_weights_avx512: a degree-3 near-minimax polynomial (relative error
// < 7.5e-5 evaluated in fp32), for weights that are rounded to bf16 (relative 2^-9, 26 times
// that) right after. The degree-4 one it replaced had the same errors against float64 in the
// tests and took 1-3 % more time at T = 64 (session 43).
constexpr float kExp2WeightPoly[4] = {5.51716685295105e-02f, 2.426111400127411e-01f,
                                      6.932609677314758e-01f, 9.999280571937561e-01f};

// ---- AVX2 kernels --------------------------------------------------------------------------

// Hints the first `bytes` bytes of row j of the next block's values (rows `stride` elements
// apart) into L2: the P V tiles spread these over their FMAs. The next block's keys are hinted
// apart from them, around the scores (NextKeys).
template <class T>
SD_FORCE_INLINE void hint_next_values(const T* next_v, int64_t j, int64_t stride, int bytes) {
  const char* nv = reinterpret_cast<const char*>(next_v + j * stride);
  for (int b = 0; b < bytes; b += 64) prefetch_l2(nv + b);
}

// The AVX-512 kernels on 8-lane vectors: the tile path (keys transposed 8 x 8 in registers,
// register-blocked score and P V tiles of at most 4 rows x 2 vectors, 16 ymm registers) and the
// streaming prefix path below, with a vectorised exp2. The portable bodies compiled for AVX2 ran
// 3 to 4 times slower (P V kept its accumulators in memory, exp2 was a libm call per score).

// 8 elements at p as fp32 (bf16 widens by a shift; fp16 uses vcvtph2ps, as load16).
template <AttnDType DT>
SD_TARGET_AVX2 SD_FORCE_INLINE __m256 load8(const typename Elem<DT>::T* p) {
  if constexpr (DT == AttnDType::kFloat32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (DT == AttnDType::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// In-register transpose of an 8 x 8 float tile (r[i] = row i on entry, column i on exit).
SD_TARGET_AVX2 SD_FORCE_INLINE void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // u[4i + c] holds, in 128-bit lane L, column 4L + c of rows 4i .. 4i + 3.
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// 2^x for x <= 0, as exp2_avx512 (the same degree-7 polynomial on x - round(x)) with 2^n built
// from n's bits. Inputs below -127 clamp there, where the bits give 2^-127 -> exactly 0, so
// masked (-inf) scores give 0; results below 2^-126 flush to 0 (the AVX-512 version keeps some
// subnormals: a difference of less than 2^-126 per weight). NaN stays NaN (vmaxps returns its
// second operand when either is NaN).
SD_TARGET_AVX2 SD_FORCE_INLINE __m256 exp2_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  // n in [-127, 0]: the biased exponent n + 127 in [0, 127]; 0 makes the scale +0.
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// s[r][8 c .. 8 c + 8) for c < CV of RB rows: the key vectors kt[i][8 c ..].
template <int RB, int CV>
SD_TARGET_AVX2 SD_FORCE_INLINE void scores_tile8(const float* q, int d, const float* kt, float* s) {
  __m256 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int i = 0; i < d; ++i) {
    __m256 k[CV];
    for (int c = 0; c < CV; ++c) k[c] = _mm256_load_ps(kt + i * kBlock + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * d + i);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_fmadd_ps(qv, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm256_store_ps(s + r * kBlock + 8 * c, acc[r][c]);
  }
}

// The scores of RB rows against the whole block, 16 keys (two vectors) at a time.
template <int RB>
SD_TARGET_AVX2 SD_FORCE_INLINE void scores_rows8(const float* q, int d, const float* kt, float* s) {
  for (int c = 0; c < kBlock; c += 16) scores_tile8<RB, 2>(q, d, kt + c, s + c);
}

// o[r][c0 .. c0 + 8 CV) = alpha[r] * o + sum_j p[r][j] v[j] for RB rows. With n_next > 0 it
// also hints the same columns of the next block's values into L2, as pv_tile does.
template <int RB, int CV, AttnDType VT>
SD_TARGET_AVX2 SD_FORCE_INLINE void pv_tile8(const float* p, int n, const typename Elem<VT>::T* vb,
                                             int64_t vs, int d, const float* alpha, float* o,
                                             const typename Elem<VT>::T* next_v = nullptr,
                                             int n_next = 0) {
  constexpr int kTileBytes = CV * 8 * static_cast<int>(sizeof(typename Elem<VT>::T));
  __m256 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_mul_ps(a, _mm256_loadu_ps(o + r * d + 8 * c));
  }
  for (int j = 0; j < n; ++j) {
    if (j < n_next) hint_next_values(next_v, j, vs, kTileBytes);
    __m256 v[CV];
    for (int c = 0; c < CV; ++c) v[c] = load8<VT>(vb + j * vs + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kBlock + j);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_fmadd_ps(pj, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(o + r * d + 8 * c, acc[r][c]);
  }
}

// RB rows over the whole head dim, 16 columns (two vectors) at a time: head dims are multiples
// of 16.
template <int RB, AttnDType VT>
SD_TARGET_AVX2 SD_FORCE_INLINE void pv_rows8(const float* p, int n, const typename Elem<VT>::T* vb,
                                             int64_t vs, int d, const float* alpha, float* o,
                                             const typename Elem<VT>::T* next_v = nullptr,
                                             int n_next = 0) {
  for (int c = 0; c < d; c += 16) {
    pv_tile8<RB, 2, VT>(p, n, vb + c, vs, d, alpha, o + c, next_v ? next_v + c : nullptr, n_next);
  }
}

// ---- AVX2 streaming prefix scores (see the AVX-512 ones below) ------------------------------
// Scores are per-key dot products, each row's sum taken across lanes in registers. A head dim of
// 128 fp32 values is 16 vectors, all of AVX2's registers, so the query rows are not held in
// registers across the keys: each key's pieces meet the rows' pieces reloaded from L1.

// The dot products of R <= 4 query rows (q, D floats apart) with one key kr: lane r of the
// result for r < R, zero above. Each 8-element piece of the key is loaded (and converted) once
// and used by every row; each row keeps two FMA chains, which halves the FMA latency on its
// critical path, so 2 R accumulators and the piece fit the 16 registers. A row's additions are
// those of reduce8 applied to its partial vector: even pieces in one chain, odd in the other,
// their sum, then lanes (0 + 1) + (2 + 3) and (4 + 5) + (6 + 7), the 128-bit halves last.
template <int D, int R, AttnDType DT>
SD_TARGET_AVX2 SD_FORCE_INLINE __m128 stream_key_dots4(const float* q,
                                                       const typename Elem<DT>::T* kr) {
  static_assert(R >= 1 && R <= 4, "at most four rows share a key piece");
  constexpr int CV = D / 8;
  __m256 a0[R], a1[R];
  const __m256 k0 = load8<DT>(kr);
  for (int r = 0; r < R; ++r) {
    a0[r] = _mm256_mul_ps(_mm256_loadu_ps(q + r * D), k0);
    a1[r] = _mm256_setzero_ps();
  }
  for (int c = 1; c < CV; ++c) {
    const __m256 kc = load8<DT>(kr + 8 * c);
    for (int r = 0; r < R; ++r) {
      if (c & 1)
        a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + 8 * c), kc, a1[r]);
      else
        a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + 8 * c), kc, a0[r]);
    }
  }
  __m256 x[4];
  for (int r = 0; r < 4; ++r) x[r] = r < R ? _mm256_add_ps(a0[r], a1[r]) : _mm256_setzero_ps();
  // Per 128-bit half: the pair sums of rows 0, 1 (resp. 2, 3), then each row's half sum.
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of keys [0, n) of a block for every query row of `heads` KV heads (fp32 query rows,
// pre-scaled; keys converted in registers), into s[(h * rows + r) * kBlock + j] (slots n .. 15
// zeroed). Each key's row sums are taken in registers (stream_key_dots4) and parked as one
// 4-float vector per (KV head, group of 4 rows, key) in dots; each group's 16 keys are then
// transposed into score rows. The block's keys were hinted into L2 during the previous block's
// scores, its values during that block's P V; these scores hint the next block's keys.
//
// Against 8-lane partial vectors per (row, key), stored and summed 8 keys at a time afterwards
// (16 KiB of stores per block at T = 1 and GQA 4, beside the 16 KiB of query rows every key
// reads, in a 32 KiB L1 the block's keys and the next block's hints stream through): the same
// sums bit for bit; from DRAM, two threads, alternating processes, fp32 took 2-5 % less time
// (B = 8 S = 4096, B = 1 S = 16384), bf16 and fp16 the same (session 25, bench/RESULTS.md).
template <int D, AttnDType DT>
SD_TARGET_AVX2 void stream_dots(const float* q, int heads, int rows, const typename Elem<DT>::T* k,
                                int64_t rs, int64_t hs, int n, NextKeys<typename Elem<DT>::T> next,
                                float* dots, float* s) {
  constexpr int kRowBytes = D * static_cast<int>(sizeof(typename Elem<DT>::T));
  constexpr int kShare = 4;
  const int groups = (rows + kShare - 1) / kShare;
  for (int j = 0; j < n; ++j) {
    for (int h = 0; h < heads; ++h) {
      const typename Elem<DT>::T* kr = k + j * rs + h * hs;
      next.hint(j, h, kRowBytes);
      for (int g = 0; g < groups; ++g) {
        const float* qr = q + static_cast<int64_t>(h * rows + g * kShare) * D;
        float* out = dots + ((h * groups + g) * kStreamKeys + j) * 4;
        switch (std::min(rows - g * kShare, kShare)) {
          case 1:
            _mm_store_ps(out, stream_key_dots4<D, 1, DT>(qr, kr));
            break;
          case 2:
            _mm_store_ps(out, stream_key_dots4<D, 2, DT>(qr, kr));
            break;
          case 3:
            _mm_store_ps(out, stream_key_dots4<D, 3, DT>(qr, kr));
            break;
          default:
            _mm_store_ps(out, stream_key_dots4<D, 4, DT>(qr, kr));
            break;
        }
      }
    }
  }
  for (int hg = 0; hg < heads * groups; ++hg) {
    float* x = dots + hg * kStreamKeys * 4;
    for (int j = n; j < kStreamKeys; ++j) _mm_store_ps(x + 4 * j, _mm_setzero_ps());
    const int h = hg / groups, r0 = (hg % groups) * kShare;
    const int nr = std::min(rows - r0, kShare);
    for (int j = 0; j < kStreamKeys; j += 4) {
      __m128 t0 = _mm_load_ps(x + 4 * j), t1 = _mm_load_ps(x + 4 * j + 4);
      __m128 t2 = _mm_load_ps(x + 4 * j + 8), t3 = _mm_load_ps(x + 4 * j + 12);
      _MM_TRANSPOSE4_PS(t0, t1, t2, t3);
      const __m128 row[4] = {t0, t1, t2, t3};
      for (int r = 0; r < nr; ++r) _mm_store_ps(s + (h * rows + r0 + r) * kBlock + j, row[r]);
    }
  }
}

// ---- query rows in lanes (5 to 16 query rows per KV head) ----------------------------------
// With more than a few query rows per KV head the per-key dot products of the streaming path
// cost as many loads and stores as FMAs (a query load per FMA, a partial store per row and key,
// then the lane sums): with the KV in cache they ran at about 45 % of the FMA rate. Here the
// query rows of a KV head are the lanes of one vector instead (Lanes16 or Lanes8). The head's
// query is transposed once per work item (qt[i] = element i of every row) and each key element
// is broadcast from memory into its FMA, so a block's scores come out as one vector per key
// (lane r = row r) without lane sums, and the online softmax of all the head's rows runs
// lane-wise: a vector max and an exp per key, with the running maxima and sums of the rows in
// two vectors. The weights are then transposed back to rows for the P V tiles of the streaming
// path.

// The keys of group g (g .. g + 7) of a lane block of keys j < n <= 16, rows rs elements apart:
// a partial group repeats key n - 1, and the scores s[j] of keys j >= n are left for
// lane_softmax to mask.
template <class T>
SD_FORCE_INLINE void lane_group_keys(const T* k, int64_t rs, int n, int g, const T** kp) {
  for (int j = 0; j < 8; ++j) kp[j] = k + std::min(g + j, n - 1) * rs;
}

// Lane vectors: the lane path keeps the query rows of a KV head in the lanes of one vector.
// Lanes8 (ymm) holds up to 8 rows, on AVX2 and on AVX-512; Lanes16 (zmm, AVX-512 below) 9 to 16.
// On AVX-512 a zmm instruction on 8 rows would leave half its lanes idle, and on Zen 4 it
// occupies the two 256-bit pipes for as long as two ymm instructions, so 8 rows in 8 lanes run
// at the rate of 16 rows in 16. The bf16 members (vdpbf16ps, pair words) need AVX512_BF16.
struct Lanes8 {
  using V = __m256;
  static constexpr int kW = 8;
  SD_TARGET_AVX2 SD_FORCE_INLINE static V zero() { return _mm256_setzero_ps(); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V set1(float x) { return _mm256_set1_ps(x); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V load(const float* p) { return _mm256_load_ps(p); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static void store(float* p, V x) { _mm256_store_ps(p, x); }
  // The first w <= 8 floats at p (unaligned), zeros above.
  SD_TARGET_AVX2 SD_FORCE_INLINE static V load_first(const float* p, int w) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(w), lanes));
  }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V add(V a, V b) { return _mm256_add_ps(a, b); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V max(V a, V b) { return _mm256_max_ps(a, b); }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // b where b > a, else a (an unordered lane keeps a).
  SD_TARGET_AVX2 SD_FORCE_INLINE static V select_greater(V a, V b) {
    return _mm256_blendv_ps(a, b, _mm256_cmp_ps(b, a, _CMP_GT_OQ));
  }
  // 0 where x is -inf, else x.
  SD_TARGET_AVX2 SD_FORCE_INLINE static V zero_if_ninf(V x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), x);
  }
  // x in the lanes r whose bit r of `lanes` is set, -inf in the others.
  SD_TARGET_AVX2 SD_FORCE_INLINE static V keep_lanes(V x, uint32_t lanes) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set =
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(lanes)), bit), bit);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, _mm256_castsi256_ps(set));
  }
  SD_TARGET_AVX2 SD_FORCE_INLINE static V exp2(V x) { return exp2_avx2(x); }
  // r[i] = row i of an 8 x 8 tile on entry, column i on exit.
  SD_TARGET_AVX2 SD_FORCE_INLINE static void transpose(V* r) { transpose8(r); }
  // 8 elements at p as fp32 (load8).
  template <AttnDType DT>
  SD_TARGET_AVX2 SD_FORCE_INLINE static V widen(const typename Elem<DT>::T* p) {
    return load8<DT>(p);
  }
  // acc + the dot products of the bf16 pair words at qw (one per lane) with the pair word w.
  SD_TARGET_AVX512BF16 SD_FORCE_INLINE static V dp_pair(V acc, const float* qw, uint32_t w) {
    const __m256bh qv = (__m256bh)_mm256_load_si256(reinterpret_cast<const __m256i*>(qw));
    return _mm256_dpbf16_ps(acc, qv, (__m256bh)_mm256_set1_epi32(static_cast<int>(w)));
  }
  // pw[r] = (bf16(a[r]), bf16(b[r])) as one 32-bit word per lane r.
  SD_TARGET_AVX512BF16 SD_FORCE_INLINE static void store_pairs(uint32_t* pw, V a, V b) {
    const __m256i lo = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(a));
    const __m256i hi = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(b));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw),
                       _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
  }
};

// The lane path's loops on AVX2, for Lanes8 (src/attention_lanes.inc).
namespace lanes_avx2 {
#define SD_LANE_TARGET SD_TARGET_AVX2
#include "attention_lanes.inc"
#undef SD_LANE_TARGET
}  // namespace lanes_avx2

struct Avx2Kernels : lanes_avx2::LaneKernels<Avx2Kernels> {
  static constexpr bool kAmx = false;
  static constexpr int kDirectRows = kRowTile;
  static constexpr bool kStream = true;
  static constexpr bool kTilePairs = false;
  // Up to 4 rows (T = 1 at GQA 4) the streaming path is faster than the AVX2 tiles: from DRAM,
  // alternating processes, T = 1 took 35-60 % less time (fp32 and bf16, B = 1 and 8, S = 4096
  // and 16384). At 4 rows it is also 5-8 % faster than the lane path (one thread, in cache).
  static constexpr int kStreamRows = 4;
  // From 5 to 8 rows the lane path on Lanes8. At 8 rows (T = 2 at GQA 4, T = 1 at GQA 8) it took
  // 23-28 % less time than the streaming path with the KV in cache (one thread; fp32, fp16 and
  // bf16) and 12-28 % less from DRAM (two threads, B = 8 S = 4096 and B = 1 S = 16384). More
  // rows take the tiles: at 16 rows the streaming path had been no faster than them (each row
  // reloads and converts the key: 16 vectors are all of AVX2's registers).
  static constexpr int kLaneRows = 8;
  // The streaming and lane paths hint the next values (lane path: also keys) of the KV head half
  // the item's heads on (hinted_head). Against the head's own, alternating processes: T = 2 on
  // the lane path (session 21, bench/RESULTS.md) took 3-8 % less time for fp32 at B = 8
  // S = 4096, 1-4 % for bf16 there and 2-9 % at B = 1; T = 1 on the streaming path (session 24)
  // 4-8 % for fp32 and 3-5 % for bf16 (B = 8 S = 4096, B = 1 S = 16384).
  static constexpr bool kHintOtherHead = true;
  // Scores of keys [0, n) < kStreamKeys of a block against every query row of `heads` KV heads
  // (q rows [heads * rows][d], pre-scaled), into s[(h * rows + r) * kBlock + j]. part:
  // heads * ceil(rows / 4) * kStreamKeys * 4 floats of 16-byte aligned scratch (stream_dots).
  template <AttnDType DT>
  SD_TARGET_AVX2 static void stream_scores(const float* q, int heads, int rows, int d,
                                           const typename Elem<DT>::T* k, int64_t rs, int64_t hs,
                                           int n, NextKeys<typename Elem<DT>::T> next, float,
                                           float* part, float* s) {
    with_head_dim(d, [&](auto dim) {
      stream_dots<decltype(dim)::value, DT>(q, heads, rows, k, rs, hs, n, next, part, s);
    });
  }
  template <AttnDType DT>
  SD_TARGET_AVX2 static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d,
                                     float* kt) {
    for (int g = 0; g < kBlock / 8; ++g) {
      for (int c = 0; c < d / 8; ++c) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const int j = 8 * g + i;
          r[i] = j < n ? load8<DT>(k + j * rs + 8 * c) : _mm256_setzero_ps();
        }
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_store_ps(kt + (8 * c + i) * kBlock + 8 * g, r[i]);
      }
    }
  }
  template <AttnDType DT>
  SD_TARGET_AVX2 static void load_rows(const typename Elem<DT>::T* src, int64_t rs, int n, int d,
                                       float mult, float* dst) {
    const __m256 m = _mm256_set1_ps(mult);
    for (int j = 0; j < n; ++j) {
      for (int c = 0; c < d; c += 8) {
        _mm256_storeu_ps(dst + j * d + c, _mm256_mul_ps(load8<DT>(src + j * rs + c), m));
      }
    }
  }
  template <AttnDType DT>
  SD_TARGET_AVX2 static void load_q(const typename Elem<DT>::T* src, int d, float mult,
                                    float* dst) {
    load_rows<DT>(src, 0, 1, d, mult, dst);
  }
  SD_TARGET_AVX2 static void scores(const float* q, int rows, int d, const float* kt, float* s,
                                    float) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) scores_rows8<4>(q + r * d, d, kt, s + r * kBlock);
    switch (rows - r) {
      case 1:
        scores_rows8<1>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 2:
        scores_rows8<2>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 3:
        scores_rows8<3>(q + r * d, d, kt, s + r * kBlock);
        break;
      default:
        break;
    }
  }
  SD_TARGET_AVX2 static float softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
    return softmax_vectors<kBlock / 8>(s, visible, state);
  }
  // softmax_row for the first 16 scores of a row (a streaming block): two vectors, not eight.
  SD_TARGET_AVX2 static float softmax_row16(float* s, uint32_t visible, SoftmaxState* state) {
    return softmax_vectors<kStreamKeys / 8>(s, visible, state);
  }
  // The online-softmax update of the first 8 NV scores of a row, turned into weights in place.
  template <int NV>
  SD_TARGET_AVX2 static float softmax_vectors(float* s, uint64_t visible, SoftmaxState* state) {
    // Lane l of vector c is visible when bit 8 c + l of `visible` is set.
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 x[NV];
    __m256 mx = ninf;
    for (int c = 0; c < NV; ++c) {
      const __m256i bits = _mm256_set1_epi32(static_cast<int>((visible >> (8 * c)) & 0xFFu));
      const __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, bit), bit));
      x[c] = _mm256_blendv_ps(ninf, _mm256_load_ps(s + 8 * c), on);
      mx = _mm256_max_ps(mx, x[c]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float alpha = softmax_rescale(state, _mm_cvtss_f32(m4));
    const __m256 ref = _mm256_set1_ps(softmax_reference(state->m));
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < NV; ++c) {
      const __m256 e = exp2_avx2(_mm256_sub_ps(x[c], ref));
      _mm256_store_ps(s + 8 * c, e);
      sum = _mm256_add_ps(sum, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    state->l += _mm_cvtss_f32(s4);
    return alpha;
  }
  template <AttnDType VT>
  SD_TARGET_AVX2 static void pv(const float* p, int rows, int n, const typename Elem<VT>::T* vb,
                                int64_t vs, int d, const float* alpha, float* o) {
    pv_row_tiles<VT>(p, rows, n, vb, vs, d, alpha, o, nullptr, 0);
  }
  // pv that also hints the next block's values (n_next rows at next_v, stride vs) into L2,
  // during its first row tile only (see stream_range). The streaming and lane paths' blocks of
  // kStreamKeys fp32 value rows (8 KiB at D = 128) are first fetched into L1 in a burst: their
  // lines were hinted into L2, and the tiles below would otherwise wait on each line's first
  // touch. Against HEAD in alternating processes (session 20, bench/RESULTS.md): fp32 T = 1
  // took 4-11 % less time (B = 8 S = 4096, B = 1 S = 16384), T = 2 4-5 % less; bf16 (half the
  // lines) gained nothing, and the tile path's 64-key blocks (32 KiB, all of L1) lost 5-7 % with
  // the burst, so pv (the tiles) goes without it.
  template <AttnDType VT>
  SD_TARGET_AVX2 static void pv_stream(const float* p, int rows, int n,
                                       const typename Elem<VT>::T* vb, int64_t vs, int d,
                                       const float* alpha, float* o,
                                       const typename Elem<VT>::T* next_v, int n_next) {
    if constexpr (VT == AttnDType::kFloat32) fetch_values_l1(vb, vs, n, d);
    pv_row_tiles<VT>(p, rows, n, vb, vs, d, alpha, o, next_v, n_next);
  }
  // The burst of pv_stream: every line of n fp32 value rows (vs floats apart) into L1.
  SD_TARGET_AVX2 static void fetch_values_l1(const float* vb, int64_t vs, int n, int d) {
    const int row_bytes = d * static_cast<int>(sizeof(float));
    for (int j = 0; j < n; ++j) {
      const char* line = reinterpret_cast<const char*>(vb + j * vs);
      for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(line + b, _MM_HINT_T0);
    }
  }
  // The lane path's P V (hides LaneKernels::lane_pv): fp32 after the L1 burst in groups of
  // kPvGroupKeys keys (pv_key_groups), fp16 / bf16 as pv_stream.
  template <AttnDType DT>
  SD_TARGET_AVX2 static void lane_pv(const float* p, int rows, int n, const typename Elem<DT>::T* v,
                                     int64_t rs, int d, const float* alpha, float* o,
                                     const typename Elem<DT>::T* next_v, int n_next, float*) {
    if constexpr (DT == AttnDType::kFloat32) {
      if (rows > 4 && rows <= 8) {
        fetch_values_l1(v, rs, n, d);
        pv_key_groups(p, rows, n, v, rs, d, alpha, o, next_v, n_next);
        return;
      }
    }
    pv_stream<DT>(p, rows, n, v, rs, d, alpha, o, next_v, n_next);
  }
  // P V of 5 to 8 rows of fp32 weights p (row r at p + r * kBlock) against value rows vb (vs
  // floats apart) into o, the tiles of pv_row_tiles taken kPvGroupKeys keys at a time: per group
  // and per 16 columns the tile of rows 0-3, then the tile of the other rows, which reads the
  // value lines the first has just touched. Over all 16 keys of a block those lines (rows 4 KiB
  // apart in a [S, 8, 128] cache) are more than an L1 set holds, so the second tile re-read them
  // from L2. Each accumulator sees the same additions in the same order as in one pass (the
  // rescale factors with the first group, later groups scale by exactly 1): the same results.
  // Against one pass, alternating processes, T = 2 (session 21, bench/RESULTS.md): fp32 took
  // 5-7 % less time at B = 8 S = 4096; bf16 (half the lines per row) 3-7 % more, so fp32 only.
  static constexpr int kPvGroupKeys = 4;
  SD_TARGET_AVX2 static void pv_key_groups(const float* p, int rows, int n, const float* vb,
                                           int64_t vs, int d, const float* alpha, float* o,
                                           const float* next_v, int n_next) {
    static constexpr float kOnes[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    constexpr AttnDType F = AttnDType::kFloat32;
    const float* p2 = p + 4 * kBlock;
    float* o2 = o + 4 * d;
    for (int g = 0; g < n; g += kPvGroupKeys) {
      const int m = std::min(kPvGroupKeys, n - g);
      const int hint = std::clamp(n_next - g, 0, m);
      const float* a1 = g == 0 ? alpha : kOnes;
      const float* a2 = g == 0 ? alpha + 4 : kOnes;
      for (int c = 0; c < d; c += 16) {
        const float* vg = vb + g * vs + c;
        const float* ng = hint > 0 ? next_v + g * vs + c : nullptr;
        pv_tile8<4, 2, F>(p + g, m, vg, vs, d, a1, o + c, ng, hint);
        switch (rows - 4) {
          case 1:
            pv_tile8<1, 2, F>(p2 + g, m, vg, vs, d, a2, o2 + c);
            break;
          case 2:
            pv_tile8<2, 2, F>(p2 + g, m, vg, vs, d, a2, o2 + c);
            break;
          case 3:
            pv_tile8<3, 2, F>(p2 + g, m, vg, vs, d, a2, o2 + c);
            break;
          default:
            pv_tile8<4, 2, F>(p2 + g, m, vg, vs, d, a2, o2 + c);
            break;
        }
      }
    }
  }
  // The P V tiles of pv and pv_stream: four rows at a time, then the rest.
  template <AttnDType VT>
  SD_TARGET_AVX2 static void pv_row_tiles(const float* p, int rows, int n,
                                          const typename Elem<VT>::T* vb, int64_t vs, int d,
                                          const float* alpha, float* o,
                                          const typename Elem<VT>::T* next_v, int n_next) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      pv_rows8<4, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v,
                      r == 0 ? n_next : 0);
    }
    const int hint = r == 0 ? n_next : 0;
    switch (rows - r) {
      case 1:
        pv_rows8<1, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      case 2:
        pv_rows8<2, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      case 3:
        pv_rows8<3, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      default:
        break;
    }
  }
};

// ---- AVX-512 kernels -----------------------------------------------------------------------

// 16 elements at p as fp32. bf16 widens by a shift and fp16 uses vcvtph2ps; both give the same
// values as the scalar helpers of host_device.h (vcvtph2ps only quiets signalling NaNs).
template <AttnDType DT>
SD_TARGET_AVX512 SD_FORCE_INLINE __m512 load16(const typename Elem<DT>::T* p) {
  if constexpr (DT == AttnDType::kFloat32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (DT == AttnDType::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// In-register transpose of a 16 x 16 float tile (r[i] = row i on entry, column i on exit).
SD_TARGET_AVX512 SD_FORCE_INLINE void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // u[4i + c] now holds, in 128-bit lane L, column 4L + c of rows 4i .. 4i + 3.
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// 2^x for x <= 0 (scores minus the running max): x = n + f with |f| <= 1/2, 2^f by a degree-7
// Taylor polynomial (relative error < 1e-8, below fp32 rounding), scaled by 2^n with vscalefps.
// Inputs below -200 clamp there, which scales to exactly 0, so masked (-inf) scores give 0; the
// clamp keeps NaN (vmaxps returns its second operand when either is NaN).
SD_TARGET_AVX512 SD_FORCE_INLINE __m512 exp2_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x in the lanes of `keep`, 0 in the others, for the bf16 weights of the AMX tiles (see
// kExp2WeightPoly): as exp2_avx512 with 4 fewer terms, the fraction taken by vreduceps (one
// instruction where vrndscaleps takes two) and the lanes masked in the final scaling, which
// also zeroes what a hidden key's x (any value, NaN included) gives. There is no clamp: x is
// finite in a visible lane, or +-inf / NaN only where a score is, which makes l NaN as
// softmax_finish expects; a very negative x has f = 0 and scales to 0.
SD_TARGET_AVX512 SD_FORCE_INLINE __m512 exp2_weights_avx512(__m512 x, __mmask16 keep) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, f);
  __m512 p = _mm512_set1_ps(kExp2WeightPoly[0]);
  for (int i = 1; i < 4; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2WeightPoly[i]));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// Lanes16 (zmm): 9 to 16 query rows of a KV head on the lane path, on AVX-512 (see Lanes8).
struct Lanes16 {
  using V = __m512;
  static constexpr int kW = 16;
  SD_TARGET_AVX512 SD_FORCE_INLINE static V zero() { return _mm512_setzero_ps(); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V set1(float x) { return _mm512_set1_ps(x); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V load(const float* p) { return _mm512_load_ps(p); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static void store(float* p, V x) { _mm512_store_ps(p, x); }
  // The first w <= 16 floats at p (unaligned), zeros above.
  SD_TARGET_AVX512 SD_FORCE_INLINE static V load_first(const float* p, int w) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << w) - 1u), p);
  }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V add(V a, V b) { return _mm512_add_ps(a, b); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V max(V a, V b) { return _mm512_max_ps(a, b); }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V fmadd(V a, V b, V c) {
    return _mm512_fmadd_ps(a, b, c);
  }
  // b where b > a, else a (an unordered lane keeps a).
  SD_TARGET_AVX512 SD_FORCE_INLINE static V select_greater(V a, V b) {
    return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(b, a, _CMP_GT_OQ), b);
  }
  // 0 where x is -inf, else x.
  SD_TARGET_AVX512 SD_FORCE_INLINE static V zero_if_ninf(V x) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_ps());
  }
  // x in the lanes r whose bit r of `lanes` is set, -inf in the others.
  SD_TARGET_AVX512 SD_FORCE_INLINE static V keep_lanes(V x, uint32_t lanes) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(lanes), x);
  }
  SD_TARGET_AVX512 SD_FORCE_INLINE static V exp2(V x) { return exp2_avx512(x); }
  // r[i] = row i of a 16 x 16 tile on entry, column i on exit.
  SD_TARGET_AVX512 SD_FORCE_INLINE static void transpose(V* r) { transpose16(r); }
  // 16 elements at p as fp32 (load16).
  template <AttnDType DT>
  SD_TARGET_AVX512 SD_FORCE_INLINE static V widen(const typename Elem<DT>::T* p) {
    return load16<DT>(p);
  }
  // acc + the dot products of the bf16 pair words at qw (one per lane) with the pair word w.
  SD_TARGET_AVX512BF16 SD_FORCE_INLINE static V dp_pair(V acc, const float* qw, uint32_t w) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(reinterpret_cast<const void*>(qw));
    return _mm512_dpbf16_ps(acc, qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(w)));
  }
  // pw[r] = (bf16(a[r]), bf16(b[r])) as one 32-bit word per lane r.
  SD_TARGET_AVX512BF16 SD_FORCE_INLINE static void store_pairs(uint32_t* pw, V a, V b) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    _mm512_store_si512(pw, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
};

// s[r][16 c .. 16 c + 16) for c < CV of RB rows: the key vectors kt[i][16 c ..].
template <int RB, int CV>
SD_TARGET_AVX512 SD_FORCE_INLINE void scores_tile(const float* q, int d, const float* kt,
                                                  float* s) {
  __m512 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < d; ++i) {
    __m512 k[CV];
    for (int c = 0; c < CV; ++c) k[c] = _mm512_load_ps(kt + i * kBlock + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + i]);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_fmadd_ps(qv, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm512_store_ps(s + r * kBlock + 16 * c, acc[r][c]);
  }
}

// o[r][c0 .. c0 + 16 CV) = alpha[r] * o + sum_j p[r][j] v[j] for RB rows. With n_next > 0 it
// also hints, for j < n_next, the same columns of rows next_v + j * vs (the next block's values,
// same strides as vb): one line per line of v read, spread over the FMAs of the tile.
template <int RB, int CV, AttnDType VT>
SD_TARGET_AVX512 SD_FORCE_INLINE void pv_tile(const float* p, int n, const typename Elem<VT>::T* vb,
                                              int64_t vs, int d, const float* alpha, float* o,
                                              const typename Elem<VT>::T* next_v, int n_next) {
  constexpr int kTileBytes = CV * 16 * static_cast<int>(sizeof(typename Elem<VT>::T));
  __m512 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + 16 * c));
  }
  for (int j = 0; j < n; ++j) {
    if (j < n_next) hint_next_values(next_v, j, vs, kTileBytes);
    __m512 v[CV];
    for (int c = 0; c < CV; ++c) v[c] = load16<VT>(vb + j * vs + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlock + j]);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_fmadd_ps(pj, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
  }
}

// Full tiles of 8 rows use 8 x 2 register tiles (fewer loads of V per FMA); fewer rows use
// up to 4 x 4. next_v / n_next: see pv_tile (every column tile hints its own columns).
template <int RB, AttnDType VT>
SD_TARGET_AVX512 SD_FORCE_INLINE void pv_rows(const float* p, int n, const typename Elem<VT>::T* vb,
                                              int64_t vs, int d, const float* alpha, float* o,
                                              const typename Elem<VT>::T* next_v, int n_next) {
  constexpr int kWide = RB > 4 ? 2 : 4;
  int c = 0;
  for (; c + 16 * kWide <= d; c += 16 * kWide)
    pv_tile<RB, kWide, VT>(p, n, vb + c, vs, d, alpha, o + c, next_v + c, n_next);
  // Head dims are multiples of 16: fewer than kWide vectors remain.
  switch ((d - c) / 16) {
    case 1:
      pv_tile<RB, 1, VT>(p, n, vb + c, vs, d, alpha, o + c, next_v + c, n_next);
      break;
    case 2:
      pv_tile<RB, 2, VT>(p, n, vb + c, vs, d, alpha, o + c, next_v + c, n_next);
      break;
    case 3:
      pv_tile<RB, 3, VT>(p, n, vb + c, vs, d, alpha, o + c, next_v + c, n_next);
      break;
    default:
      break;
  }
}

// ---- streaming prefix scores (few query rows per KV head) ----------------------------------
// With at most K::kStreamRows query rows per KV head the work per key is small and the kernel is
// bound by how fast the cache can be read. The cache [S, Hkv, D] is then read in address order
// (key-major, every KV head of a key before the next key), the order the hardware prefetchers
// follow; the tile path above reads each head's keys Hkv * D elements apart instead, one new
// 4 KiB page per key, which measured about half the read bandwidth of a linear pass. Scores are
// per-key dot products: one 16-lane partial vector per (query row, key), summed across lanes for
// 16 keys at once by reduce16, so no key is ever transposed.

// y[j] = sum of the 16 lanes of x[16 j .. 16 j + 16) for j < 16 (x: 16 vectors, 64-byte aligned).
SD_TARGET_AVX512 SD_FORCE_INLINE __m512 reduce16(const float* x) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 x0 = _mm512_load_ps(x + 32 * i), x1 = _mm512_load_ps(x + 32 * i + 16);
    // Per 128-bit lane L: (x0[0] + x0[2], x1[0] + x1[2], x0[1] + x0[3], x1[1] + x1[3]).
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d lo =
        _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi =
        _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    // Per 128-bit lane L: the lane-L sums of vectors 4 i .. 4 i + 3.
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // Sum the four 128-bit lanes: lane g of the result gathers vectors 4 g .. 4 g + 3.
  const __m512 d01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// Sums part rows [hr][16 keys][16 lanes] into s[hr * kBlock + j] (times mult); key slots >= n
// are zeroed first, so every lane summed is initialised.
SD_TARGET_AVX512 SD_FORCE_INLINE void stream_reduce(float* part, int hr, int n, float mult,
                                                    float* s) {
  const __m512 m = _mm512_set1_ps(mult);
  for (int i = 0; i < hr; ++i) {
    float* x = part + i * kStreamKeys * 16;
    for (int j = n; j < kStreamKeys; ++j) _mm512_store_ps(x + 16 * j, _mm512_setzero_ps());
    _mm512_store_ps(s + i * kBlock, _mm512_mul_ps(reduce16(x), m));
  }
}

// Partial score vectors of keys [0, n) of a block for every query row of `heads` KV heads; fp32
// query rows (pre-scaled) against fp32 / fp16 keys converted in registers. D = head dim. The
// block's keys and values were prefetched during the previous block's P V (pv_tile).
template <int D, AttnDType DT>
SD_TARGET_AVX512 void stream_partials_f32(const float* q, int heads, int rows,
                                          const typename Elem<DT>::T* k, int64_t rs, int64_t hs,
                                          int n, NextKeys<typename Elem<DT>::T> next, float* part) {
  constexpr int CV = D / 16;
  constexpr int kRowBytes = D * static_cast<int>(sizeof(typename Elem<DT>::T));
  for (int j = 0; j < n; ++j) {
    for (int h = 0; h < heads; ++h) {
      const typename Elem<DT>::T* kr = k + j * rs + h * hs;
      next.hint(j, h, kRowBytes);
      __m512 kv[CV];
      for (int c = 0; c < CV; ++c) kv[c] = load16<DT>(kr + 16 * c);
      for (int r = 0; r < rows; ++r) {
        const float* qr = q + static_cast<int64_t>(h * rows + r) * D;
        // Two chains halve the FMA latency on the critical path.
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
        __m512 a1 = _mm512_setzero_ps();
        for (int c = 1; c < CV; ++c) {
          if (c & 1)
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], a1);
          else
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], a0);
        }
        _mm512_store_ps(part + ((h * rows + r) * kStreamKeys + j) * 16, _mm512_add_ps(a0, a1));
      }
    }
  }
}

// As stream_partials_f32, two keys per step: each query vector loaded feeds the FMAs of two
// keys, which halves the query loads per FMA (see stream_partials_rows_f32). Every
// key's dot product is summed in the same order as in the one-key loop, so results are
// bit-identical; the address order pairs keys j, j + 1 of a head. A trailing odd key of a block
// takes the one-key loop.
template <int D, AttnDType DT>
SD_TARGET_AVX512 void stream_partials2_f32(const float* q, int heads, int rows,
                                           const typename Elem<DT>::T* k, int64_t rs, int64_t hs,
                                           int n, NextKeys<typename Elem<DT>::T> next,
                                           float* part) {
  constexpr int CV = D / 16;
  constexpr int kRowBytes = D * static_cast<int>(sizeof(typename Elem<DT>::T));
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    for (int h = 0; h < heads; ++h) {
      const typename Elem<DT>::T* kr = k + j * rs + h * hs;
      next.hint(j, h, kRowBytes);
      next.hint(j + 1, h, kRowBytes);
      __m512 k0[CV], k1[CV];
      for (int c = 0; c < CV; ++c) {
        k0[c] = load16<DT>(kr + 16 * c);
        k1[c] = load16<DT>(kr + rs + 16 * c);
      }
      for (int r = 0; r < rows; ++r) {
        const float* qr = q + static_cast<int64_t>(h * rows + r) * D;
        __m512 qc = _mm512_loadu_ps(qr);
        __m512 a0 = _mm512_mul_ps(qc, k0[0]), b0 = _mm512_mul_ps(qc, k1[0]);
        __m512 a1 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        for (int c = 1; c < CV; ++c) {
          qc = _mm512_loadu_ps(qr + 16 * c);
          if (c & 1) {
            a1 = _mm512_fmadd_ps(qc, k0[c], a1);
            b1 = _mm512_fmadd_ps(qc, k1[c], b1);
          } else {
            a0 = _mm512_fmadd_ps(qc, k0[c], a0);
            b0 = _mm512_fmadd_ps(qc, k1[c], b0);
          }
        }
        float* pr = part + ((h * rows + r) * kStreamKeys + j) * 16;
        _mm512_store_ps(pr, _mm512_add_ps(a0, a1));
        _mm512_store_ps(pr + 16, _mm512_add_ps(b0, b1));
      }
    }
  }
  if (j < n) {
    stream_partials_f32<D, DT>(q, heads, rows, k + j * rs, rs, hs, n - j, next.from(j),
                               part + j * 16);
  }
}

// The streaming scores take two keys per step for every row count. At 8 rows (T = 2, GQA 4)
// the pairing took 8-10 % less time with the KV in cache. At 4 rows (decoding) round 3 kept the
// one-key loop because the paired order measured slower from DRAM with the values prefetched in
// L1 bursts; with the next block hinted into L2 during P V (stream_range) the paired loop was
// faster in 21 of 24 same-run A/B pairs (T = 1, B = 1 / S = 16384 and B = 8 / S = 4096, fp32
// and bf16, two threads), typically by 2-12 %.
template <int D, AttnDType DT>
SD_TARGET_AVX512 void stream_partials_rows_f32(const float* q, int heads, int rows,
                                               const typename Elem<DT>::T* k, int64_t rs,
                                               int64_t hs, int n,
                                               NextKeys<typename Elem<DT>::T> next, float* part) {
  // Two keys of D = 256 would take all 32 vector registers: that head dim keeps one key.
  if constexpr (D <= 128) {
    stream_partials2_f32<D, DT>(q, heads, rows, k, rs, hs, n, next, part);
  } else {
    stream_partials_f32<D, DT>(q, heads, rows, k, rs, hs, n, next, part);
  }
}

// The lane path's loops on AVX-512, for Lanes16 and Lanes8 (src/attention_lanes.inc).
namespace lanes_avx512 {
#define SD_LANE_TARGET SD_TARGET_AVX512
#include "attention_lanes.inc"
#undef SD_LANE_TARGET
}  // namespace lanes_avx512

struct Avx512Kernels : lanes_avx512::LaneKernels<Avx512Kernels> {
  static constexpr bool kAmx = false;
  static constexpr int kDirectRows = kRowTile;
  static constexpr bool kStream = true;
  static constexpr bool kTilePairs = false;
  // Up to 4 rows (T = 1 at GQA 4) the prefix takes the streaming path (stream_range), which is
  // bound by the read of the cache there; at 4 rows the lane path was 10-55 % slower.
  static constexpr int kStreamRows = 4;
  // From 5 to 16 rows (T = 2 to 4 at GQA 4, T = 1 and 2 at GQA 8) it takes the lane path
  // (lane_range; 8 lanes up to 8 rows, 16 above). Against the streaming path, from DRAM, same
  // inputs in alternating processes (Hq = 32, Hkv = 8, D = 128, S = 4096): T = 3 and 4 took
  // 18-26 % less time for fp32 and 19-26 % for bf16, B = 1 and 8. At 8 rows (T = 2), one thread
  // with the KV in cache, 8 lanes took 17 % less time than the streaming path for fp32 and 12 %
  // less than 16 lanes for bf16; from DRAM, two threads, fp32 10-18 % less and bf16 from 6 % more
  // to 13 % less (bench/RESULTS.md). Before, the streaming path took up to 16 rows: it had been
  // 5-25 % faster than the tiles, which transpose every key block and read each KV head's keys
  // a 4 KiB page apart.
  static constexpr int kLaneRows = 16;
  // The streaming and lane paths hint each head's own next block (see hinted_head). The other
  // head's, which the AVX2 kernels take, measured within the noise on a Zen 4 VM (session 26,
  // 18 alternating rounds: bf16 T = 1 medians 5-9 % lower, minima not; bench/RESULTS.md).
  static constexpr bool kHintOtherHead = false;
  // Scores of keys [0, n) < kStreamKeys of a block against every query row of `heads` KV heads
  // (q rows [heads * rows][d], pre-scaled), into s[(h * rows + r) * kBlock + j]. part:
  // heads * rows * 256 floats of scratch.
  template <AttnDType DT>
  SD_TARGET_AVX512 static void stream_scores(const float* q, int heads, int rows, int d,
                                             const typename Elem<DT>::T* k, int64_t rs, int64_t hs,
                                             int n, NextKeys<typename Elem<DT>::T> next, float,
                                             float* part, float* s) {
    with_head_dim(d, [&](auto dim) {
      stream_partials_rows_f32<decltype(dim)::value, DT>(q, heads, rows, k, rs, hs, n, next, part);
    });
    stream_reduce(part, heads * rows, n, 1.0f, s);
  }
  template <AttnDType DT>
  SD_TARGET_AVX512 static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d,
                                       float* kt) {
    for (int g = 0; g < kBlock / 16; ++g) {
      for (int c = 0; c < d / 16; ++c) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          const int j = 16 * g + i;
          r[i] = j < n ? load16<DT>(k + j * rs + 16 * c) : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (16 * c + i) * kBlock + 16 * g, r[i]);
      }
    }
  }
  template <AttnDType DT>
  SD_TARGET_AVX512 static void load_rows(const typename Elem<DT>::T* src, int64_t rs, int n, int d,
                                         float mult, float* dst) {
    const __m512 m = _mm512_set1_ps(mult);
    for (int j = 0; j < n; ++j) {
      for (int c = 0; c < d; c += 16) {
        _mm512_storeu_ps(dst + j * d + c, _mm512_mul_ps(load16<DT>(src + j * rs + c), m));
      }
    }
  }
  template <AttnDType DT>
  SD_TARGET_AVX512 static void load_q(const typename Elem<DT>::T* src, int d, float mult,
                                      float* dst) {
    load_rows<DT>(src, 0, 1, d, mult, dst);
  }
  SD_TARGET_AVX512 static void scores(const float* q, int rows, int d, const float* kt, float* s,
                                      float) {
    if (rows == 8) {
      scores_tile<8, 2>(q, d, kt, s);
      scores_tile<8, 2>(q, d, kt + 32, s + 32);
      return;
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4) scores_tile<4, 4>(q + r * d, d, kt, s + r * kBlock);
    switch (rows - r) {
      case 1:
        scores_tile<1, 4>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 2:
        scores_tile<2, 4>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 3:
        scores_tile<3, 4>(q + r * d, d, kt, s + r * kBlock);
        break;
      default:
        break;
    }
  }
  SD_TARGET_AVX512 static float softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
    __m512 x[4];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
      const __mmask16 mk = static_cast<__mmask16>(visible >> (16 * c));
      x[c] = _mm512_mask_mov_ps(ninf, mk, _mm512_load_ps(s + 16 * c));
    }
    const float block_max =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    const float alpha = softmax_rescale(state, block_max);
    const __m512 ref = _mm512_set1_ps(softmax_reference(state->m));
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m512 p = exp2_avx512(_mm512_sub_ps(x[c], ref));
      _mm512_store_ps(s + 16 * c, p);
      sum = _mm512_add_ps(sum, p);
    }
    state->l += _mm512_reduce_add_ps(sum);
    return alpha;
  }
  // softmax_row for the first 16 scores of a row (a streaming block): one vector instead of four.
  SD_TARGET_AVX512 static float softmax_row16(float* s, uint32_t visible, SoftmaxState* state) {
    const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(visible),
                                        _mm512_load_ps(s));
    const float alpha = softmax_rescale(state, _mm512_reduce_max_ps(x));
    const __m512 p = exp2_avx512(_mm512_sub_ps(x, _mm512_set1_ps(softmax_reference(state->m))));
    _mm512_store_ps(s, p);
    state->l += _mm512_reduce_add_ps(p);
    return alpha;
  }
  template <AttnDType VT>
  SD_TARGET_AVX512 static void pv(const float* p, int rows, int n, const typename Elem<VT>::T* vb,
                                  int64_t vs, int d, const float* alpha, float* o) {
    pv_stream<VT>(p, rows, n, vb, vs, d, alpha, o, vb, 0);
  }
  // pv that also hints the next block's values (n_next rows at next_v, stride vs) into L2,
  // during its first row tile only (see stream_range).
  template <AttnDType VT>
  SD_TARGET_AVX512 static void pv_stream(const float* p, int rows, int n,
                                         const typename Elem<VT>::T* vb, int64_t vs, int d,
                                         const float* alpha, float* o,
                                         const typename Elem<VT>::T* next_v, int n_next) {
    if (rows == 8) {
      pv_rows<8, VT>(p, n, vb, vs, d, alpha, o, next_v, n_next);
      return;
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      pv_rows<4, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v,
                     r == 0 ? n_next : 0);
    }
    const int hint = r == 0 ? n_next : 0;
    switch (rows - r) {
      case 1:
        pv_rows<1, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      case 2:
        pv_rows<2, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      case 3:
        pv_rows<3, VT>(p + r * kBlock, n, vb, vs, d, alpha + r, o + r * d, next_v, hint);
        break;
      default:
        break;
    }
  }
};

// bf16 inputs with AVX512_BF16: the scores use vdpbf16ps on the raw bf16 query and keys. A
// product of two bf16 values is exact in fp32 and vdpbf16ps accumulates in fp32, so this is the
// same fp32-accumulated dot product as converting first (up to summation order), at twice the
// rate. The query stays unscaled (scaling it would round it) and the scale is applied to the
// scores. Everything after the scores is the fp32 code of Avx512Kernels.
// One step of an RB x CV register tile on bf16 pairs: acc[r][c] += a[r * a_stride] . b[c], the
// pair word of row r broadcast against the CV pair-word vectors at b (64-byte aligned).
template <int RB, int CV>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void dp_tile_step(__m512 (&acc)[RB][CV], const uint32_t* a,
                                                       int a_stride, const void* b) {
  __m512bh bv[CV];
  for (int c = 0; c < CV; ++c) {
    bv[c] = (__m512bh)_mm512_load_si512(static_cast<const char*>(b) + 64 * c);
  }
  for (int r = 0; r < RB; ++r) {
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * a_stride]));
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);
  }
}

// s[r][j] = mult * sum_i q[r * q_stride + i] . kt[i][j] for RB rows of `pairs` pair words.
template <int RB, int CV>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void scores_tile_bf16(const uint32_t* q, int q_stride,
                                                           int pairs, const float* kt, float* s,
                                                           float mult) {
  __m512 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < pairs; ++i) dp_tile_step<RB, CV>(acc, q + i, q_stride, kt + i * kBlock);
  const __m512 m = _mm512_set1_ps(mult);
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c)
      _mm512_store_ps(s + r * kBlock + 16 * c, _mm512_mul_ps(acc[r][c], m));
  }
}

// bf16 partial score vectors with vdpbf16ps on raw bf16 pairs (query rows stored as d / 2
// words at the start of each fp32-stride row, see Avx512Bf16Kernels::load_q). D / 2 = 40 words
// (D = 80) leaves a last chunk of 8 words, loaded masked (zeros add nothing).
template <int D>
SD_TARGET_AVX512BF16 void stream_partials_bf16(const float* q, int heads, int rows,
                                               const uint16_t* k, int64_t rs, int64_t hs, int n,
                                               NextKeys<uint16_t> next, float* part) {
  constexpr int W = D / 2;
  constexpr int CW = (W + 15) / 16;
  constexpr __mmask16 kLast = static_cast<__mmask16>(W % 16 == 0 ? 0xFFFF : (1u << (W % 16)) - 1u);
  for (int j = 0; j < n; ++j) {
    for (int h = 0; h < heads; ++h) {
      const uint16_t* kr = k + j * rs + h * hs;
      next.hint(j, h, 2 * D);
      __m512bh kv[CW];
      for (int c = 0; c < CW; ++c) {
        const __mmask16 mk = c == CW - 1 ? kLast : static_cast<__mmask16>(0xFFFF);
        kv[c] = (__m512bh)_mm512_maskz_loadu_epi32(mk, kr + 32 * c);
      }
      for (int r = 0; r < rows; ++r) {
        const float* qr = q + static_cast<int64_t>(h * rows + r) * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int c = 0; c < CW; ++c) {
          const __mmask16 mk = c == CW - 1 ? kLast : static_cast<__mmask16>(0xFFFF);
          const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi32(mk, qr + 16 * c);
          if (c & 1)
            a1 = _mm512_dpbf16_ps(a1, qv, kv[c]);
          else
            a0 = _mm512_dpbf16_ps(a0, qv, kv[c]);
        }
        _mm512_store_ps(part + ((h * rows + r) * kStreamKeys + j) * 16, _mm512_add_ps(a0, a1));
      }
    }
  }
}

// As stream_partials_bf16, two keys per step (each query word vector feeds two keys), with
// the same bit-identical sums and odd-key tail as stream_partials2_f32.
template <int D>
SD_TARGET_AVX512BF16 void stream_partials2_bf16(const float* q, int heads, int rows,
                                                const uint16_t* k, int64_t rs, int64_t hs, int n,
                                                NextKeys<uint16_t> next, float* part) {
  constexpr int W = D / 2;
  constexpr int CW = (W + 15) / 16;
  constexpr __mmask16 kLast = static_cast<__mmask16>(W % 16 == 0 ? 0xFFFF : (1u << (W % 16)) - 1u);
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    for (int h = 0; h < heads; ++h) {
      const uint16_t* kr = k + j * rs + h * hs;
      next.hint(j, h, 2 * D);
      next.hint(j + 1, h, 2 * D);
      __m512bh k0[CW], k1[CW];
      for (int c = 0; c < CW; ++c) {
        const __mmask16 mk = c == CW - 1 ? kLast : static_cast<__mmask16>(0xFFFF);
        k0[c] = (__m512bh)_mm512_maskz_loadu_epi32(mk, kr + 32 * c);
        k1[c] = (__m512bh)_mm512_maskz_loadu_epi32(mk, kr + rs + 32 * c);
      }
      for (int r = 0; r < rows; ++r) {
        const float* qr = q + static_cast<int64_t>(h * rows + r) * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        for (int c = 0; c < CW; ++c) {
          const __mmask16 mk = c == CW - 1 ? kLast : static_cast<__mmask16>(0xFFFF);
          const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi32(mk, qr + 16 * c);
          if (c & 1) {
            a1 = _mm512_dpbf16_ps(a1, qv, k0[c]);
            b1 = _mm512_dpbf16_ps(b1, qv, k1[c]);
          } else {
            a0 = _mm512_dpbf16_ps(a0, qv, k0[c]);
            b0 = _mm512_dpbf16_ps(b0, qv, k1[c]);
          }
        }
        float* pr = part + ((h * rows + r) * kStreamKeys + j) * 16;
        _mm512_store_ps(pr, _mm512_add_ps(a0, a1));
        _mm512_store_ps(pr + 16, _mm512_add_ps(b0, b1));
      }
    }
  }
  if (j < n) {
    stream_partials_bf16<D>(q, heads, rows, k + j * rs, rs, hs, n - j, next.from(j), part + j * 16);
  }
}

template <int D>
SD_TARGET_AVX512BF16 void stream_partials_rows_bf16(const float* q, int heads, int rows,
                                                    const uint16_t* k, int64_t rs, int64_t hs,
                                                    int n, NextKeys<uint16_t> next, float* part) {
  // Two keys per step at every row count (see stream_partials_rows_f32); a trailing odd key of
  // a block takes the one-key loop.
  stream_partials2_bf16<D>(q, heads, rows, k, rs, hs, n, next, part);
}

// s[j] = mult * sum_i qt[i] . kp[j][i] over the W bf16 pairs of 8 keys (vdpbf16ps, each pair of
// key elements broadcast from memory as one 32-bit word). On ymm (Lanes8) each key's sum runs as
// two chains, the even and the odd pairs, added at the end, so 16 chains are in flight: on a Zen
// 4 VM vdpbf16ps takes about 1.7 ns (6 cycles) and issues 4.7 ymm products per ns from 8 chains
// against 6.8-7.1 from 16 (bench/probes/dp_chains_probe.cc); the bf16 lane path at 8 rows per KV
// head took 6-9 % less time with its KV in L3, one thread (session 47, bench/RESULTS.md).
// Sixteen keys at once would also give 16 chains, but their rows, Hkv * D elements apart, crowd
// the few L1 sets they map to (1.03-1.12x the time from DRAM in one A/B). zmm products issue 3.4
// per ns from 8 chains as from 16, so Lanes16 keeps one chain per key.
template <int W, class L>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void lane_dots_bf16(const float* qt, const uint16_t* const* kp,
                                                         float mult, typename L::V* s) {
  constexpr int kChains = L::kW == 8 && W % 2 == 0 ? 2 : 1;
  typename L::V acc[kChains][8];
  for (int c = 0; c < kChains; ++c) {
    for (int j = 0; j < 8; ++j) acc[c][j] = L::zero();
  }
  for (int i = 0; i < W; i += kChains) {
    for (int c = 0; c < kChains; ++c) {
      for (int j = 0; j < 8; ++j) {
        uint32_t w;
        std::memcpy(&w, kp[j] + 2 * (i + c), sizeof(w));
        acc[c][j] = L::dp_pair(acc[c][j], qt + L::kW * (i + c), w);
      }
    }
  }
  const typename L::V m = L::set1(mult);
  for (int j = 0; j < 8; ++j) {
    if constexpr (kChains == 2) {
      s[j] = L::mul(L::add(acc[0][j], acc[1][j]), m);
    } else {
      s[j] = L::mul(acc[0][j], m);
    }
  }
}

// As lane_scores_f32 on raw bf16 keys and pair words of the query (D / 2 per row).
template <int D, class L>
SD_TARGET_AVX512BF16 void lane_scores_bf16(const float* qt, const uint16_t* k, int64_t rs, int n,
                                           float mult, typename L::V* s) {
  for (int g = 0; g < n; g += 8) {
    const uint16_t* kp[8];
    lane_group_keys(k, rs, n, g, kp);
    lane_dots_bf16<D / 2, L>(qt, kp, mult, s + g);
  }
}

// The P V of the bf16 lane path and of the tiles (5 or more rows per KV head) runs on vdpbf16ps
// too: the weights are rounded to bf16 (relative error 2^-9 per weight; the sums of the softmax
// stay fp32), as the CUDA kernel's mma and FlashAttention do, and pairs of keys are multiplied
// and added at once, at twice the FMA rate. Both operands hold pairs of keys (2m, 2m + 1) as
// 32-bit words: the weights of a row, broadcast, and the values of 16 columns, staged once per
// block. The price: 34-39 % of the outputs are one bf16 ulp off the exactly rounded result, with
// a mean error 0.95-0.99x and a largest error at most that of torch's bf16 SDPA on the CPU
// (36-41 % off), where the fp32 paths are exact in more than 99 % of them. Fp32 weights (or a
// bf16 pair of weight and residual) cost the lane path 12-22 % more time at T = 2 and 4 from
// DRAM and the tiles about 1.4x; the streaming path (up to 4 rows) keeps fp32 weights, since its
// P V on pair words saved 1-6 % from DRAM there (sessions 27 and 29, bench/RESULTS.md).

// As lane_weights, with the weights as bf16 pair words: pw[m * 16 + r] = (P[r][2m], P[r][2m + 1])
// for the block's 8 key pairs m and the rows r < L::kW (keys >= n weigh 0).
template <class L>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void lane_weight_pairs(typename L::V* s, int n,
                                                            const uint32_t* vis, float* ml,
                                                            uint32_t* pw, float* alpha) {
  lanes_avx512::lane_update<L>(s, n, vis, ml, alpha);
  for (int m = 0; m < kStreamKeys / 2; ++m) L::store_pairs(pw + kLanes * m, s[2 * m], s[2 * m + 1]);
}

// vp[m * d + c] = (v[2m][c], v[2m + 1][c]) as bf16 pair words for keys [0, n) (rows rs apart);
// an odd n pairs its last key with 0.
SD_TARGET_AVX512BF16 void lane_stage_v_pairs(const uint16_t* v, int64_t rs, int n, int d,
                                             uint32_t* vp) {
  // One vpermt2w interleaves 16 columns of the two rows: result word 2c is row 2m's column c,
  // word 2c + 1 row 2m + 1's (index 32 + c: the second source). It replaced a widening load
  // of each row, a shift and an or per 16 columns (the staging was a quarter of the P V's time
  // at 8 rows, cpu-clock profile).
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                   53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                   27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int m = 0; 2 * m < n; ++m) {
    const uint16_t* v0 = v + 2 * m * rs;
    const bool odd = 2 * m + 1 == n;
    uint32_t* out = vp + m * d;
    int c = 0;
    for (; c + 32 <= d; c += 32) {
      const __m512i a = _mm512_loadu_si512(v0 + c);
      const __m512i b = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(v0 + rs + c);
      _mm512_store_si512(out + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(out + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
    if (c < d) {  // d = 80: 16 columns left; lo reads words 0-15 of each source only
      const __m512i a =
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c)));
      const __m512i b = odd ? _mm512_setzero_si512()
                            : _mm512_castsi256_si512(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(v0 + rs + c)));
      _mm512_store_si512(out + c, _mm512_permutex2var_epi16(a, lo, b));
    }
  }
}

// o[r][c0 .. c0 + 16 CV) = alpha[r] * o + sum_m pw[m * ms + r * rstride] . vp[m] for RB rows
// over `pairs` key pairs, with the hints of pv_tile (n_next rows of next_v, rs apart, the tile's
// columns). The lane path's weights are key-major (ms = kLanes, rstride = 1), the tiles'
// row-major (ms = 1, rstride = kBlock / 2).
template <int RB, int CV>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void pv_tile_pairs(const uint32_t* pw, int ms, int rstride,
                                                        int pairs, const uint32_t* vp, int d,
                                                        const float* alpha, float* o,
                                                        const uint16_t* next_v, int64_t rs,
                                                        int n_next) {
  constexpr int kTileBytes = CV * 16 * static_cast<int>(sizeof(uint16_t));
  __m512 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + 16 * c));
  }
  for (int m = 0; m < pairs; ++m) {
    for (int j = 2 * m; j < 2 * m + 2 && j < n_next; ++j) {
      hint_next_values(next_v, j, rs, kTileBytes);
    }
    dp_tile_step<RB, CV>(acc, pw + m * ms, rstride, vp + m * d);
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
  }
}

// pv_tile_pairs for RB rows over the whole head dim: 4 vectors at a time, 2 for 8 rows (as
// pv_rows: 16 accumulators either way).
template <int RB>
SD_TARGET_AVX512BF16 SD_FORCE_INLINE void pv_rows_pairs(const uint32_t* pw, int ms, int rstride,
                                                        int pairs, const uint32_t* vp, int d,
                                                        const float* alpha, float* o,
                                                        const uint16_t* next_v, int64_t rs,
                                                        int n_next) {
  constexpr int kWide = RB > 4 ? 2 : 4;
  int c = 0;
  for (; c + 16 * kWide <= d; c += 16 * kWide) {
    pv_tile_pairs<RB, kWide>(pw, ms, rstride, pairs, vp + c, d, alpha, o + c, next_v + c, rs,
                             n_next);
  }
  // Head dims are multiples of 16: fewer than kWide vectors remain.
  switch ((d - c) / 16) {
    case 1:
      pv_tile_pairs<RB, 1>(pw, ms, rstride, pairs, vp + c, d, alpha, o + c, next_v + c, rs, n_next);
      break;
    case 2:
      pv_tile_pairs<RB, 2>(pw, ms, rstride, pairs, vp + c, d, alpha, o + c, next_v + c, rs, n_next);
      break;
    case 3:
      pv_tile_pairs<RB, 3>(pw, ms, rstride, pairs, vp + c, d, alpha, o + c, next_v + c, rs, n_next);
      break;
    default:
      break;
  }
}

struct Avx512Bf16Kernels : Avx512Kernels {
  static constexpr bool kTilePairs = true;
  // The tiles' values as pair words (lane_stage_v_pairs), staged once per block for all row
  // tiles; vb holds kBlock * d floats, twice what the pairs take.
  template <AttnDType DT>
  SD_TARGET_AVX512BF16 static void stage_tile_v(const uint16_t* v, int64_t rs, int n, int d,
                                                float* vb) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    lane_stage_v_pairs(v, rs, n, d, reinterpret_cast<uint32_t*>(vb));
  }
  // The P V of a row tile (rb <= kRowTile rows of weights p[r * kBlock + j], keys j < n) on the
  // staged pairs, the weights rounded to bf16 pair words as on the lane path.
  SD_TARGET_AVX512BF16 static void tile_pv(const float* p, int rb, int n, const float* vb, int d,
                                           const float* alpha, float* o) {
    constexpr int kPairs = kBlock / 2;
    alignas(64) uint32_t pw[kRowTile * kPairs];
    for (int r = 0; r < rb; ++r) {
      for (int j = 0; j < kBlock; j += 32) {
        // vcvtne2ps2bf16 puts its second operand in the low half: keys j .. j + 15 first.
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(p + r * kBlock + j + 16),
                                               _mm512_load_ps(p + r * kBlock + j));
        _mm512_store_si512(pw + r * kPairs + j / 2, (__m512i)w);
      }
    }
    const uint32_t* vp = reinterpret_cast<const uint32_t*>(vb);
    const uint16_t* no_hints = reinterpret_cast<const uint16_t*>(vb);
    const int pairs = (n + 1) / 2;
    if (rb == kRowTile) {
      pv_rows_pairs<kRowTile>(pw, 1, kPairs, pairs, vp, d, alpha, o, no_hints, 0, 0);
      return;
    }
    int r = 0;
    for (; r + 4 <= rb; r += 4) {
      pv_rows_pairs<4>(pw + r * kPairs, 1, kPairs, pairs, vp, d, alpha + r, o + r * d, no_hints, 0,
                       0);
    }
    const uint32_t* pr = pw + r * kPairs;
    switch (rb - r) {
      case 1:
        pv_rows_pairs<1>(pr, 1, kPairs, pairs, vp, d, alpha + r, o + r * d, no_hints, 0, 0);
        break;
      case 2:
        pv_rows_pairs<2>(pr, 1, kPairs, pairs, vp, d, alpha + r, o + r * d, no_hints, 0, 0);
        break;
      case 3:
        pv_rows_pairs<3>(pr, 1, kPairs, pairs, vp, d, alpha + r, o + r * d, no_hints, 0, 0);
        break;
      default:
        break;
    }
  }
  // As Avx512Kernels::stream_scores with raw bf16 query rows; the scale is applied to the sums.
  template <AttnDType DT>
  SD_TARGET_AVX512BF16 static void stream_scores(const float* q, int heads, int rows, int d,
                                                 const uint16_t* k, int64_t rs, int64_t hs, int n,
                                                 NextKeys<uint16_t> next, float mult, float* part,
                                                 float* s) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    with_head_dim(d, [&](auto dim) {
      stream_partials_rows_bf16<decltype(dim)::value>(q, heads, rows, k, rs, hs, n, next, part);
    });
    stream_reduce(part, heads * rows, n, mult, s);
  }
  // The lane layout holds the raw bf16 pairs of the query rows (see load_q).
  template <AttnDType DT>
  static constexpr int lane_words(int d) {
    return d / 2;
  }
  // As Avx512Kernels::lane_block with vdpbf16ps on the raw bf16 keys; the scale is applied to
  // the sums.
  template <AttnDType DT, class L>
  SD_TARGET_AVX512BF16 static void lane_block(const float* qt, int d, int rows, const uint16_t* k,
                                              int64_t rs, int n, const uint32_t* vis, float mult,
                                              float*, float* ml, float* p, float* alpha) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    typename L::V s[kStreamKeys];
    with_head_dim(
        d, [&](auto dim) { lane_scores_bf16<decltype(dim)::value, L>(qt, k, rs, n, mult, s); });
    lane_weight_pairs<L>(s, n, vis, ml, reinterpret_cast<uint32_t*>(p), alpha);
  }
  // As Avx512Kernels::lane_pv on vdpbf16ps: p holds the weight pair words of lane_block, and the
  // values are staged as pair words into vbuf first.
  template <AttnDType DT>
  SD_TARGET_AVX512BF16 static void lane_pv(const float* p, int rows, int n, const uint16_t* v,
                                           int64_t rs, int d, const float* alpha, float* o,
                                           const uint16_t* next_v, int n_next, float* vbuf) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    uint32_t* vp = reinterpret_cast<uint32_t*>(vbuf);
    lane_stage_v_pairs(v, rs, n, d, vp);
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(p);
    const int pairs = (n + 1) / 2;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      pv_rows_pairs<4>(pw + r, kLanes, 1, pairs, vp, d, alpha + r, o + r * d, next_v, rs,
                       r == 0 ? n_next : 0);
    }
    const int hint = r == 0 ? n_next : 0;
    switch (rows - r) {
      case 1:
        pv_rows_pairs<1>(pw + r, kLanes, 1, pairs, vp, d, alpha + r, o + r * d, next_v, rs, hint);
        break;
      case 2:
        pv_rows_pairs<2>(pw + r, kLanes, 1, pairs, vp, d, alpha + r, o + r * d, next_v, rs, hint);
        break;
      case 3:
        pv_rows_pairs<3>(pw + r, kLanes, 1, pairs, vp, d, alpha + r, o + r * d, next_v, rs, hint);
        break;
      default:
        break;
    }
  }
  // kt holds, for each pair of dims (2i, 2i + 1), the 32-bit words (k[j][2i], k[j][2i + 1]) of
  // the block's keys j: the 16 x 16 transpose of 32-bit words, applied to raw bf16 pairs.
  template <AttnDType DT>
  SD_TARGET_AVX512BF16 static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d,
                                           float* kt) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    for (int g = 0; g < kBlock / 16; ++g) {
      // d / 2 pair words per key: 16 per chunk; d = 80 leaves a chunk of 8.
      for (int c = 0; c < (d / 2 + 15) / 16; ++c) {
        const int words = std::min(16, d / 2 - 16 * c);
        const __mmask16 mk = static_cast<__mmask16>((1u << words) - 1u);
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          const int j = 16 * g + i;
          r[i] = j < n ? _mm512_maskz_loadu_ps(mk, k + j * rs + 32 * c) : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int i = 0; i < words; ++i) {
          _mm512_store_ps(kt + (16 * c + i) * kBlock + 16 * g, r[i]);
        }
      }
    }
  }
  // The raw bf16 row (d / 2 words) in place of the scaled fp32 row.
  template <AttnDType DT>
  SD_TARGET_AVX512BF16 static void load_q(const typename Elem<DT>::T* src, int d, float,
                                          float* dst) {
    static_assert(DT == AttnDType::kBFloat16, "bf16 only");
    std::memcpy(dst, src, static_cast<size_t>(d) * sizeof(uint16_t));
  }
  SD_TARGET_AVX512BF16 static void scores(const float* q, int rows, int d, const float* kt,
                                          float* s, float mult) {
    // The workspace rows keep their fp32 stride d (d words), their first d / 2 words the pairs.
    const int pairs = d / 2;
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q);
    if (rows == 8) {
      scores_tile_bf16<8, 2>(qp, d, pairs, kt, s, mult);
      scores_tile_bf16<8, 2>(qp, d, pairs, kt + 32, s + 32, mult);
      return;
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4)
      scores_tile_bf16<4, 4>(qp + r * d, d, pairs, kt, s + r * kBlock, mult);
    switch (rows - r) {
      case 1:
        scores_tile_bf16<1, 4>(qp + r * d, d, pairs, kt, s + r * kBlock, mult);
        break;
      case 2:
        scores_tile_bf16<2, 4>(qp + r * d, d, pairs, kt, s + r * kBlock, mult);
        break;
      case 3:
        scores_tile_bf16<3, 4>(qp + r * d, d, pairs, kt, s + r * kBlock, mult);
        break;
      default:
        break;
    }
  }
};
// ---- AMX tiles (bf16, more than 16 query rows per KV head) ------------------------------------
// On CPUs with AMX (Intel Xeon since Sapphire Rapids) the tiles' two products run as tile
// multiplies: 8 query rows (kRowTile) by 16 keys for the scores, 8 rows by 16 head-dim columns
// for the P V, 32 bf16 pairs deep per tdpbf16ps. Both B operands are what the AVX512_BF16 tiles
// already stage: K^T as pair words per pair of dims (load_kt) and V as pair words per pair of
// keys (stage_tile_v); the weights are rounded to bf16 pairs as there. The softmax, the staging
// and every other path are Avx512Bf16Kernels'. AMX adds the products in its own order and treats
// subnormal bf16 inputs as zero, so the outputs differ from the AVX512_BF16 tiles' in the last
// bits (tests hold them to the reference's tolerance and to torch's bf16 SDPA error).
#define SD_TARGET_AMX                                                       \
  __attribute__((                                                           \
      target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c," \
             "amx-tile,amx-bf16")))

// The layout of ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");

// tmm0-3: four C tiles (`rows` rows of 16 fp32: kRowTile for the tiles of attend_range,
// kAmxRows for amx_chunk_range); tmm4: A (`rows` rows of 32 bf16); tmm5-7: B (16 rows of 16
// pair words), of which amx_chunk_range's 32-row groups take tmm6 as a second A. The configuration
// is a thread's state, and the threads are shared with torch (whose oneDNN kernels load their own),
// so every tiled range loads it first and releases the tiles after (attend_range).
SD_TARGET_AMX void amx_configure(int rows) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12's _tile_loadconfig declares only 8 bytes of its operand as read, so the stores of the
  // rows and widths above were dropped as dead (a tilezero then faulted as unconfigured): the
  // whole struct is the asm's input here.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

SD_TARGET_AMX void amx_release() { _tile_release(); }

// C0..C3 += A (tmm4) times the four B tiles at b, b + 64, b + 128 and b + 192 bytes (16 rows,
// `stride` bytes apart): 64 output columns, 16 of them per C tile.
SD_TARGET_AMX SD_FORCE_INLINE void amx_four_products(const void* b, int stride) {
  const char* p = static_cast<const char*>(b);
  _tile_loadd(5, p, stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(5, p + 64, stride);
  _tile_dpbf16ps(1, 4, 5);
  _tile_loadd(5, p + 128, stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(5, p + 192, stride);
  _tile_dpbf16ps(3, 4, 5);
}

// C0..C3 to the 64 fp32 columns at c (rows `stride` bytes apart).
SD_TARGET_AMX SD_FORCE_INLINE void amx_store_four(float* c, int stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 32, stride);
  _tile_stored(3, c + 48, stride);
}

// o += P V for the configured rows of o (d floats apart, d a multiple of 64) over `steps` steps
// of 16 key pairs of a block: P the weights' pair words pw (rows kBlock / 2 words apart), V the
// staged value pairs vp (d words per key pair; pairs past the block's last zero up to the last
// step, as AmxKernels::stage_tile_v leaves them).
SD_TARGET_AMX SD_FORCE_INLINE void amx_block_pv(const uint32_t* pw, int steps, const uint32_t* vp,
                                                int d, float* o) {
  const int o_stride = d * 4, p_stride = kBlock / 2 * 4;
  for (int c0 = 0; c0 < d; c0 += 64) {
    _tile_loadd(0, o + c0, o_stride);
    _tile_loadd(1, o + c0 + 16, o_stride);
    _tile_loadd(2, o + c0 + 32, o_stride);
    _tile_loadd(3, o + c0 + 48, o_stride);
    for (int st = 0; st < steps; ++st) {
      _tile_loadd(4, pw + 16 * st, p_stride);
      amx_four_products(vp + static_cast<int64_t>(16 * st) * d + c0, o_stride);
    }
    amx_store_four(o + c0, o_stride);
  }
}

struct AmxKernels : Avx512Bf16Kernels {
  static constexpr bool kAmx = true;
  // 8 or more rows per KV head take the tiles, whose full 8-row tiles run on AMX, with the values
  // staged as pairs from 8 rows on (the AVX512_BF16 tiles read them in place up to 8): against
  // the lane path, S = 4096, B = 1 / 8, 0.58x / 0.76x the time at 8 rows (T = 2 at GQA 4; with
  // the values read in place 0.75x / 1.16x) and 0.55x / 0.70x at 16 (T = 4). 5 to 7 rows, which
  // would fill no AMX tile, stay on the lane path. (With a head dim that is a multiple of 64, 8
  // to 16 rows now take amx_key_range, and 32 or more amx_chunk_range.)
  static constexpr int kLaneRows = 7;
  static constexpr int kDirectRows = 7;
  // s[r * kBlock + j] = mult * q_r . k_j for the 8 rows of a full row tile and the block's 64
  // keys (keys >= n have zero K^T words: load_kt); other tiles and head dims that are not a
  // multiple of 32 take the AVX512_BF16 tiles.
  SD_TARGET_AMX static void scores(const float* q, int rows, int d, const float* kt, float* s,
                                   float mult) {
    if (rows != kRowTile || d % 32 != 0) {
      Avx512Bf16Kernels::scores(q, rows, d, kt, s, mult);
      return;
    }
    // The workspace rows are d words apart, their first d / 2 words the query's pair words.
    const char* qb = reinterpret_cast<const char*>(q);
    const char* kb = reinterpret_cast<const char*>(kt);
    const int q_stride = d * 4, k_stride = kBlock * 4;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < d / 32; ++c) {
      _tile_loadd(4, qb + 64 * c, q_stride);
      amx_four_products(kb + static_cast<int64_t>(16 * c) * k_stride, k_stride);
    }
    amx_store_four(s, k_stride);
    const __m512 m = _mm512_set1_ps(mult);
    for (int i = 0; i < kRowTile * kBlock; i += 16) {
      _mm512_store_ps(s + i, _mm512_mul_ps(_mm512_load_ps(s + i), m));
    }
  }
  // As Avx512Bf16Kernels::stage_tile_v, and the pairs past the block's last one zeroed up to
  // the next 16 (a B tile's depth): they held an earlier block's values or other paths' scratch,
  // whose bits may read as bf16 infinities, and zero weights times those would be NaN.
  template <AttnDType DT>
  SD_TARGET_AMX static void stage_tile_v(const uint16_t* v, int64_t rs, int n, int d, float* vb) {
    Avx512Bf16Kernels::stage_tile_v<DT>(v, rs, n, d, vb);
    const int pairs = (n + 1) / 2;
    const int padded = (pairs + 15) / 16 * 16;
    std::memset(reinterpret_cast<uint32_t*>(vb) + static_cast<int64_t>(pairs) * d, 0,
                static_cast<size_t>(padded - pairs) * d * sizeof(uint32_t));
  }
  // The P V of a full row tile on the staged value pairs (head dims that are multiples of 64;
  // others, and partial tiles, take the AVX512_BF16 tiles): o = alpha * o + P V, the weights of
  // keys >= n zeroed.
  SD_TARGET_AMX static void tile_pv(const float* p, int rb, int n, const float* vb, int d,
                                    const float* alpha, float* o) {
    if (rb != kRowTile || d % 64 != 0) {
      Avx512Bf16Kernels::tile_pv(p, rb, n, vb, d, alpha, o);
      return;
    }
    constexpr int kPairs = kBlock / 2;
    alignas(64) uint32_t pw[kRowTile * kPairs];
    for (int r = 0; r < kRowTile; ++r) {
      for (int j = 0; j < kBlock; j += 32) {
        const __mmask16 lo = keys_below(n - j), hi = keys_below(n - j - 16);
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_load_ps(hi, p + r * kBlock + j + 16),
                                               _mm512_maskz_load_ps(lo, p + r * kBlock + j));
        _mm512_store_si512(pw + r * kPairs + j / 2, (__m512i)w);
      }
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < d; c += 16) {
        _mm512_storeu_ps(o + r * d + c, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + c)));
      }
    }
    amx_block_pv(pw, ((n + 1) / 2 + 15) / 16, reinterpret_cast<const uint32_t*>(vb), d, o);
  }

  // ---- amx_key_range: the query rows of a KV head in the columns of the score tiles ----
  // With 8 to 16 query rows per KV head (T = 2 to 4 at GQA 4) the scores run transposed, S^T =
  // K Q^T: the A tiles are 16 keys of the cache as they lie (rows rs apart, no staging), the B
  // tiles the head's query pair words in lanes (lane_query: the VNNI layout of Q^T), and each C
  // tile holds 16 keys by 16 rows, the lane layout of the lane path, whose softmax runs down the
  // keys with no horizontal reductions (lane_update). Only the bf16 weights are transposed back
  // to rows for the P V (two 16 x 16 transposes of pair words per 64 keys, where load_kt
  // transposes sixteen for the keys of a 64-key block at d = 128).

  // s[j * 16 + r] = q_r . k_j (unscaled) for the 64 keys j of a block (keys >= n score 0; their
  // rows are copied into kpad, kBlock rows of d bf16, when n < kBlock, so no tile reads past the
  // cache's last key) and the 16 lanes r of qt (d / 2 pair words per lane; zero lanes score 0).
  SD_TARGET_AMX static void key_scores(const float* qt, const uint16_t* k, int64_t rs, int n, int d,
                                       uint16_t* kpad, float* s) {
    const char* src = reinterpret_cast<const char*>(k);
    int64_t stride = rs * 2;
    if (n < kBlock) {
      for (int j = 0; j < n; ++j) {
        std::memcpy(kpad + static_cast<int64_t>(j) * d, k + j * rs, d * sizeof(uint16_t));
      }
      std::memset(kpad + static_cast<int64_t>(n) * d, 0, (kBlock - n) * d * sizeof(uint16_t));
      src = reinterpret_cast<const char*>(kpad);
      stride = d * 2;
    }
    const char* qb = reinterpret_cast<const char*>(qt);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < d / 32; ++c) {
      // Depth step c: dims 32 c .. 32 c + 31 of 16 keys (A) by their 16 pair words of all lanes.
      _tile_loadd(5, qb + 1024 * c, 64);
      const char* kc = src + 64 * c;
      _tile_loadd(4, kc, stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(4, kc + 16 * stride, stride);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(4, kc + 32 * stride, stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(4, kc + 48 * stride, stride);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s, 64);
    _tile_stored(1, s + 256, 64);
    _tile_stored(2, s + 512, 64);
    _tile_stored(3, s + 768, 64);
  }
  // The lane softmax of a block's scores s (key_scores; scaled by mult here) with the lane state
  // ml (vis: as in lane_update), and the weights as the A tiles of the P V want them: pw[r * 32 +
  // m] = (P[r][2m], P[r][2m + 1]) for the 16 lanes r and the 32 key pairs m (keys >= n weigh 0).
  SD_TARGET_AMX static void key_weights(float* s, int n, const uint32_t* vis, float mult, float* ml,
                                        uint32_t* pw, float* alpha) {
    __m512* sv = reinterpret_cast<__m512*>(s);
    const __m512 m = _mm512_set1_ps(mult);
    for (int j = 0; j < n; ++j) sv[j] = _mm512_mul_ps(sv[j], m);
    lanes_avx512::lane_update<Lanes16, kBlock>(sv, n, vis, ml, alpha);
    // vcvtne2ps2bf16 puts keys 2m in words 0-15 and 2m + 1 in 16-31; the permutation pairs them
    // per lane, and the transpose turns 16 pairs by 16 lanes into 16 lanes (rows) by 16 pairs.
    alignas(64) static constexpr uint16_t kPairUp[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                         21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                         11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pair_up = _mm512_load_si512(kPairUp);
    const int groups = (n + 31) / 32;
    for (int g = 0; g < groups; ++g) {
      __m512 w[16];
      for (int i = 0; i < 16; ++i) {
        const int j = 32 * g + 2 * i;
        const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(sv[j + 1], sv[j]);
        w[i] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(pair_up, bf));
      }
      transpose16(w);
      for (int r = 0; r < 16; ++r)
        _mm512_store_ps(reinterpret_cast<float*>(pw) + r * 32 + 16 * g, w[r]);
    }
  }
  // o = alpha * o + P V for 16 rows of o (d floats apart, d a multiple of 64): the weights pw of
  // key_weights, the values' pairs vb of stage_tile_v for keys [0, n).
  SD_TARGET_AMX static void key_pv(const uint32_t* pw, int n, const float* vb, int d,
                                   const float* alpha, float* o) {
    for (int r = 0; r < kAmxRows; ++r) {
      if (alpha[r] == 1.0f) continue;  // the row's max did not grow (softmax_rescale)
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (float* x = o + r * d; x < o + (r + 1) * d; x += 16) {
        _mm512_store_ps(x, _mm512_mul_ps(a, _mm512_load_ps(x)));
      }
    }
    amx_block_pv(pw, ((n + 1) / 2 + 15) / 16, reinterpret_cast<const uint32_t*>(vb), d, o);
  }

  // ---- amx_chunk_range: tiles of 32 query rows over chunks of 128 keys ----
  // A row tile of kChunkRows query rows (two 16-row AMX tiles; a last tile of at most 16 rows
  // one) meets a chunk of kChunkKeys keys: its scores, one softmax pass and one P V over the
  // whole chunk. Every tile multiply pairs two A tiles with two B tiles into four C tiles, so
  // each K^T and V tile loaded (from L2: a chunk's staged keys and values outgrow L1) feeds 32
  // rows, and the O rows move through the C tiles once per chunk. The tile multiplies of the
  // previous row tile's P V and the next one's scores are interleaved with this one's softmax
  // (chunk_tile): with 16-row tiles over 256-key chunks that took 5-9 % less time than the three
  // phases in turn (S = 4096, T = 64, B = 1 / 8).
  // The 32-row groups load their K^T and V tiles with the no-reuse hint (TILELOADDT1): each row
  // tile reads them from L2 anyway (a chunk's 64 KB outgrow L1), and kept out of L1 they leave
  // it to the row tile's query, weights and output rows (0.97-1.00x the time at S = 4096, T = 64
  // in four A/B runs).

  // The scores of a row tile: s[r][64 b + j] = q_r . k_j (unscaled) for the 16 * halves rows of
  // q (pair words, rows d words apart) and the keys of `blocks` blocks of K^T pair words at kt
  // (load_kt: (d / 2) * kBlock words per block, keys past a block's end zero); s rows are
  // kChunkKeys floats apart. A unit is one depth step of 32 dims of a C group (16 * halves rows
  // by 64 / halves keys).
  struct ScoresJob {
    const float* q;
    const float* kt;
    float* s;
    int d, blocks, halves;
    int units() const { return blocks * halves * (d / 32); }
  };
  // o += P V for the 16 * halves rows of o (d floats apart, d a multiple of 64): P the pair words
  // chunk_softmax_row left in s, V the chunk's staged value pairs at vb (stage_tile_v per block,
  // 32 * d words per block; the staging zeroes the pairs past the last up to the next 16),
  // `pairs` key pairs deep. A unit is 16 pairs of a C group (16 * halves rows by 64 / halves
  // columns).
  struct PvJob {
    const float* s;
    const float* vb;
    float* o;
    int d, pairs, halves;
    int steps() const { return (pairs + 15) / 16; }
    int units() const { return d / 64 * halves * steps(); }
  };

  // Units [u0, u1) of a ScoresJob, in order: a C group's tiles live from its first unit to its
  // last, so no other tile work may come in between (chunk_tile runs whole units in order).
  SD_TARGET_AMX SD_FORCE_INLINE static void scores_units(const ScoresJob& job, int u0, int u1) {
    const int depth = job.d / 32;
    const char* qb = reinterpret_cast<const char*>(job.q);
    const int q_stride = job.d * 4, k_stride = kBlock * 4, s_stride = kChunkKeys * 4;
    const int64_t q_half = static_cast<int64_t>(kAmxRows) * q_stride;
    for (int u = u0; u < u1; ++u) {
      const int grp = u / depth, c = u % depth;
      if (c == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      if (job.halves == 1) {  // 16 rows by the block's 64 keys
        const float* kt = job.kt + static_cast<int64_t>(grp) * (job.d / 2) * kBlock;
        _tile_loadd(4, qb + 64 * c, q_stride);
        amx_four_products(kt + 16 * c * kBlock, k_stride);
        if (c == depth - 1) amx_store_four(job.s + kBlock * grp, s_stride);
        continue;
      }
      // 32 rows by 32 keys: C0 / C1 rows 0-15, C2 / C3 rows 16-31; C0 / C2 the first 16 keys.
      const int b = grp / 2, k0 = 32 * (grp % 2);
      const float* kt = job.kt + static_cast<int64_t>(b) * (job.d / 2) * kBlock + k0;
      _tile_loadd(4, qb + 64 * c, q_stride);
      _tile_stream_loadd(5, kt + 16 * c * kBlock, k_stride);
      _tile_loadd(6, qb + q_half + 64 * c, q_stride);
      _tile_stream_loadd(7, kt + 16 * c * kBlock + 16, k_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 6, 5);
      _tile_dpbf16ps(3, 6, 7);
      if (c == depth - 1) {
        float* sc = job.s + kBlock * b + k0;
        _tile_stored(0, sc, s_stride);
        _tile_stored(1, sc + 16, s_stride);
        _tile_stored(2, sc + kAmxRows * kChunkKeys, s_stride);
        _tile_stored(3, sc + kAmxRows * kChunkKeys + 16, s_stride);
      }
    }
  }
  // Units [u0, u1) of a PvJob, in order (see scores_units).
  SD_TARGET_AMX SD_FORCE_INLINE static void pv_units(const PvJob& job, int u0, int u1) {
    const int steps = job.steps();
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(job.s);
    const uint32_t* vp = reinterpret_cast<const uint32_t*>(job.vb);
    const int o_stride = job.d * 4, p_stride = kChunkKeys * 4;
    const int cols = 64 / job.halves;
    for (int u = u0; u < u1; ++u) {
      const int c0 = cols * (u / steps), st = u % steps;
      const uint32_t* vs = vp + static_cast<int64_t>(16 * st) * job.d + c0;
      if (job.halves == 1) {  // 16 rows by 64 columns
        if (st == 0) {
          _tile_loadd(0, job.o + c0, o_stride);
          _tile_loadd(1, job.o + c0 + 16, o_stride);
          _tile_loadd(2, job.o + c0 + 32, o_stride);
          _tile_loadd(3, job.o + c0 + 48, o_stride);
        }
        _tile_loadd(4, pw + 16 * st, p_stride);
        amx_four_products(vs, o_stride);
        if (st == steps - 1) amx_store_four(job.o + c0, o_stride);
        continue;
      }
      // 32 rows by 32 columns: C0 / C1 rows 0-15, C2 / C3 rows 16-31.
      float* o0 = job.o + c0;
      float* o1 = job.o + kAmxRows * job.d + c0;
      if (st == 0) {
        _tile_loadd(0, o0, o_stride);
        _tile_loadd(1, o0 + 16, o_stride);
        _tile_loadd(2, o1, o_stride);
        _tile_loadd(3, o1 + 16, o_stride);
      }
      _tile_loadd(4, pw + 16 * st, p_stride);
      _tile_stream_loadd(5, vs, o_stride);
      _tile_loadd(6, pw + kAmxRows * kChunkKeys + 16 * st, p_stride);
      _tile_stream_loadd(7, vs + 16, o_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 6, 5);
      _tile_dpbf16ps(3, 6, 7);
      if (st == steps - 1) {
        _tile_stored(0, o0, o_stride);
        _tile_stored(1, o0 + 16, o_stride);
        _tile_stored(2, o1, o_stride);
        _tile_stored(3, o1 + 16, o_stride);
      }
    }
  }
  // The online softmax of one row over a chunk of Blocks blocks (row: its scores, kChunkKeys
  // floats; key j of block b visible when bit j of vis[b] is set): returns the factor the row's
  // O must be multiplied by (softmax_rescale) and leaves the weights 2^(mult s - m) in place as
  // bf16 pair words (word i = keys 2i, 2i + 1; invisible keys 0) over the row's first
  // 32 * Blocks words.
  // One pass over the scores: they are scaled against the running max m as it stands, held in
  // registers, and only a chunk whose visible scores rise above m (or a row's first) takes the
  // horizontal max and shifts them to its new max, which makes the largest weight exactly 1 as
  // a max pass first would (a weight above 1 instead cost the bf16 outputs 4 % in mean error).
  // A chunk without a new max, most of them past a row's first, skips both.
  template <int Blocks>
  SD_TARGET_AMX SD_FORCE_INLINE static float chunk_softmax_row(float* row, const uint64_t* vis,
                                                               float mult, SoftmaxState* st) {
    constexpr int kVectors = 4 * Blocks;
    const float ref = softmax_reference(st->m);
    const __m512 vmult = _mm512_set1_ps(mult), vref = _mm512_set1_ps(ref);
    __m512 x[kVectors];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < kVectors; ++c) {
      const __mmask16 keep = static_cast<__mmask16>(vis[c / 4] >> (16 * (c % 4)));
      x[c] = _mm512_fmsub_ps(_mm512_load_ps(row + 16 * c), vmult, vref);
      top = _mm512_mask_max_ps(top, keep, top, x[c]);
    }
    // A row's first visible keys always set its max (m = -inf, ref 0); later ones when above m.
    const __m512 rise = _mm512_set1_ps(st->m == -INFINITY ? -INFINITY : 0.0f);
    float alpha = 1.0f;
    if (_mm512_cmp_ps_mask(top, rise, _CMP_GT_OQ) != 0) {
      // mult > 0, so the max of the scaled scores is the scaled max.
      alpha = softmax_rescale(st, ref + _mm512_reduce_max_ps(top));
      const __m512 shift = _mm512_set1_ps(softmax_reference(st->m) - ref);
      for (int c = 0; c < kVectors; ++c) x[c] = _mm512_sub_ps(x[c], shift);
    }
    __m512 sum = _mm512_setzero_ps();
    uint32_t* pw = reinterpret_cast<uint32_t*>(row);
    for (int c2 = 0; c2 < kVectors / 2; ++c2) {
      const uint64_t bits = vis[c2 / 2] >> (32 * (c2 % 2));
      const __m512 p0 = exp2_weights_avx512(x[2 * c2], static_cast<__mmask16>(bits));
      const __m512 p1 = exp2_weights_avx512(x[2 * c2 + 1], static_cast<__mmask16>(bits >> 16));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      // vcvtne2ps2bf16 puts its second operand in the low half: keys 32 c2 .. + 15 first.
      _mm512_store_si512(pw + 16 * c2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    st->l += _mm512_reduce_add_ps(sum);
    return alpha;
  }
  // Rows [0, rows) of the keys and values at k and v (rs elements apart, row_bytes each), hinted
  // into L2 a share per softmax row of chunk_tile.
  struct HintJob {
    const uint16_t* k;
    const uint16_t* v;
    int64_t rs;
    int rows, row_bytes;
  };
  // One step of the pipeline: the softmax of the row tile whose scores are in s (16 * halves
  // rows; rows r < rb real, with visible keys vis[r * blocks + b] and states st, their O rows
  // (o, d floats apart) rescaled where the max grew, before the next step's P V adds to them;
  // the others get zero weights, so the P V's A tiles read only zeros there), with the previous
  // tile's P V in its first half of rows, the next tile's scores in its second (either may be
  // null) and the hints spread over all.
  SD_TARGET_AMX static void chunk_tile(float* s, int rb, int halves, int blocks,
                                       const uint64_t* vis, float mult, SoftmaxState* st, float* o,
                                       int d, const PvJob* pv, const ScoresJob* next,
                                       const HintJob& hint) {
    const int rows = kAmxRows * halves, half = rows / 2;
    const int pv_n = pv ? pv->units() : 0, next_n = next ? next->units() : 0;
    for (int r = 0; r < rows; ++r) {
      for (int j = r * hint.rows / rows; j < (r + 1) * hint.rows / rows; ++j) {
        const char* kr = reinterpret_cast<const char*>(hint.k + j * hint.rs);
        const char* vr = reinterpret_cast<const char*>(hint.v + j * hint.rs);
        for (int off = 0; off < hint.row_bytes; off += 64) {
          _mm_prefetch(kr + off, _MM_HINT_T1);
          _mm_prefetch(vr + off, _MM_HINT_T1);
        }
      }
      float* row = s + r * kChunkKeys;
      if (r < rb) {
        const float alpha =
            blocks == kChunkBlocks
                ? chunk_softmax_row<kChunkBlocks>(row, vis + r * blocks, mult, st + r)
                : chunk_softmax_row<1>(row, vis + r * blocks, mult, st + r);
        if (alpha != 1.0f) {
          const __m512 a = _mm512_set1_ps(alpha);
          for (float* x = o + r * d; x < o + (r + 1) * d; x += 16) {
            _mm512_storeu_ps(x, _mm512_mul_ps(a, _mm512_loadu_ps(x)));
          }
        }
      } else {
        std::memset(row, 0, static_cast<size_t>(blocks) * kBlock * 2);
      }
      if (r < half) {
        if (pv) pv_units(*pv, r * pv_n / half, (r + 1) * pv_n / half);
      } else if (next) {
        const int h = r - half;
        scores_units(*next, h * next_n / half, (h + 1) * next_n / half);
      }
    }
  }
  SD_TARGET_AMX static void run_scores(const ScoresJob& job) { scores_units(job, 0, job.units()); }
  SD_TARGET_AMX static void run_pv(const PvJob& job) { pv_units(job, 0, job.units()); }

 private:
  // The lanes of 16 keys below `count` (all for count >= 16, none for count <= 0).
  static __mmask16 keys_below(int count) {
    if (count >= 16) return static_cast<__mmask16>(0xffff);
    if (count <= 0) return 0;
    return static_cast<__mmask16>((1u << count) - 1u);
  }
};
#endif  // SD_X86

// ---- ISA selection -------------------------------------------------------------------------

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

#ifdef SD_X86
// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and the tile data state granted to
// this process: Linux enables it only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; a kernel that cannot grant it refuses, and the tiles stay off).
bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
#ifdef __linux__
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

Isa best_isa() {
#ifdef SD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
    return amx_usable() ? Isa::kAmx : Isa::kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kGeneric;
}

std::atomic<int>& isa_override() {
  static std::atomic<int> value{-1};
  return value;
}

Isa current_isa() {
  static const Isa best = best_isa();
  const int forced = isa_override().load(std::memory_order_relaxed);
  return forced >= 0 ? static_cast<Isa>(forced) : best;
}

// ---- the driver ----------------------------------------------------------------------------

// Aligned scratch of one thread, reused across calls (the pool's threads live on).
struct Workspace {
  std::vector<float> storage;
  float *q, *o_prefix, *o_tree, *kt, *vb, *s, *alpha;
  float *part, *sall;   // partial score vectors (streaming), scores of all rows (both paths)
  float *qt, *lane_ml;  // lane path only: each KV head's query in lanes, its lane softmax state
  // amx_chunk_range only: a chunk's K^T and V pairs, a row tile's scores, its padded query and
  // output rows (a last tile of fewer than kChunkRows rows) and its visibility words.
  float *kt_chunk, *v_chunk, *s_chunk, *q_pad, *o_pad;
  uint64_t* vis_chunk;
  // amx_key_range only: each KV head's output rows padded to a tile's 16, a block's transposed
  // scores and its weights' pair words.
  float *o_keys, *s_keys;
  uint32_t* pw_keys;
  SoftmaxState *st_prefix, *st_tree;
  std::vector<SoftmaxState> states;

  // rows: query rows of the work item; stream: whether the streaming prefix path runs;
  // lane_heads: KV heads of the lane path (0 when it does not run); chunk_heads: KV heads of
  // amx_chunk_range (0 when it does not run); key_heads: KV heads of amx_key_range (0 when it
  // does not run).
  void reserve(int64_t rows, int64_t d, bool stream, int64_t lane_heads, int64_t chunk_heads = 0,
               int64_t key_heads = 0) {
    const bool chunk = chunk_heads > 0;
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    const int64_t part_need = stream ? rows * kStreamKeys * 16 : 0;
    const int64_t sall_need = stream || lane_heads > 0 ? rows * kBlock : 0;
    const int64_t lane_need = lane_heads * (d * kLanes + 2 * kLanes);
    // K^T and V pairs of a chunk: kChunkKeys * d / 2 words each; a padded tile's query and
    // output rows per KV head; the visibility words count as two floats each.
    const int64_t chunk_need = chunk ? 2 * kChunkKeys * up(d) / 2 + 2 * kChunkRows * kChunkKeys +
                                           2 * chunk_heads * kChunkRows * up(d) +
                                           2 * kChunkRows * kChunkBlocks
                                     : 0;
    const int64_t keys_need =
        key_heads > 0 ? key_heads * kAmxRows * up(d) + kBlock * kAmxRows + kBlock / 2 * kAmxRows
                      : 0;
    const int64_t need = 3 * up(rows * d) + kBlock * up(d) + kBlock * up(d) + kRowTile * kBlock +
                         up(rows) + part_need + sall_need + lane_need + chunk_need + keys_need + 16;
    if (static_cast<int64_t>(storage.size()) < need) storage.assign(need, 0.0f);
    float* base = storage.data();
    base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;  // 64-byte
    q = base;
    o_prefix = q + up(rows * d);
    o_tree = o_prefix + up(rows * d);
    kt = o_tree + up(rows * d);
    vb = kt + kBlock * up(d);
    s = vb + kBlock * up(d);
    alpha = s + kRowTile * kBlock;
    part = alpha + up(rows);  // 64-byte aligned: every size above is a multiple of 16 floats
    sall = part + part_need;
    qt = sall + sall_need;
    lane_ml = qt + lane_heads * d * kLanes;
    kt_chunk = lane_ml + lane_heads * 2 * kLanes;  // 64-byte aligned: kLanes is 8 or 16
    v_chunk = kt_chunk + (chunk ? kChunkKeys * up(d) / 2 : 0);
    s_chunk = v_chunk + (chunk ? kChunkKeys * up(d) / 2 : 0);
    q_pad = s_chunk + (chunk ? 2 * kChunkRows * kChunkKeys : 0);
    o_pad = q_pad + chunk_heads * kChunkRows * up(d);
    vis_chunk = reinterpret_cast<uint64_t*>(o_pad + chunk_heads * kChunkRows * up(d));
    o_keys = o_pad + chunk_heads * kChunkRows * up(d) + (chunk ? 2 * kChunkRows * kChunkBlocks : 0);
    s_keys = o_keys + key_heads * kAmxRows * up(d);
    pw_keys = reinterpret_cast<uint32_t*>(s_keys + (key_heads > 0 ? kBlock * kAmxRows : 0));
    states.resize(2 * rows);
    st_prefix = states.data();
    st_tree = states.data() + rows;
  }
};

// Flush-to-zero (MXCSR.FTZ) on this thread while the kernels run, the caller's mode restored
// after (the threads are torch's). A weight 2^(s - m) or rescale factor below 2^-126 (keys past
// a block's end or hidden by the mask, whose scores are -inf, the first block's factor 2^(-inf),
// scores far below the max) is otherwise a denormal result, and every denormal result takes a
// microcode assist of the order of a hundred cycles: on the Xeon of session 42, bf16 T = 4 on AMX
// spent 4.1x the cycles in its softmax at S = 256 (the tree's block: 60 keys past its end) and
// 1.3x at S = 4096 than with the flush. Such terms are below 2^-126 of the row's largest weight,
// which is 1, so flushing them leaves every fp32 sum as it was; denormal inputs are still read
// as they are (DAZ stays off).
class FlushToZero {
 public:
#ifdef SD_X86
  FlushToZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushToZero() { _mm_setcsr(saved_); }
#else
  FlushToZero() = default;  // the other architectures keep their mode
#endif
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;

 private:
#ifdef SD_X86
  unsigned saved_;
#endif
};

Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

// Visible keys of a block: bit j set when key j0 + j (< j0 + n) may be attended to; every key of
// the prefix (tree false), the tree's by tree_visible_bits (j0 and the bits relative to the tree).
inline uint64_t block_visibility(const uint32_t* mask_row, int query, int j0, int n, bool tree) {
  return tree ? tree_visible_bits(mask_row, query, j0, n) : low_bits(n);
}

// block_visibility of keys [j0, j0 + n) (n <= 32) for each tree node t < nodes of a sequence's
// mask (null: the causal chain): the streaming and lane paths' tree part, whose rows share their
// node's mask row across query heads and KV heads, so it is computed once per block.
inline void node_visibility(const uint32_t* mask_b, int64_t words, int nodes, int j0, int n,
                            uint32_t* vis) {
  for (int t = 0; t < nodes; ++t) {
    const uint32_t* mrow = mask_b ? mask_b + t * words : nullptr;
    vis[t] = static_cast<uint32_t>(block_visibility(mrow, t, j0, n, true));
  }
}

// The lane path's transpose of node_visibility: bit r of lanes[j] set when row r (node r / g,
// r < rows <= 32) sees key j < n.
inline void key_lane_masks(const uint32_t* node_vis, int rows, int g, int n, uint32_t* lanes) {
  for (int j = 0; j < n; ++j) {
    uint32_t bits = 0;
    for (int r = 0; r < rows; ++r) bits |= ((node_vis[r / g] >> j) & 1u) << r;
    lanes[j] = bits;
  }
}

struct Shape {
  int64_t t;                // tree nodes T
  int64_t g;                // query heads per KV head
  int64_t d;                // head dim
  int64_t rows;             // query rows per KV head, T * g
  int64_t words;            // mask words per row
  int64_t heads;            // KV heads per work item
  int64_t splits;           // prefix splits per (sequence, head group)
  int64_t split_keys;       // prefix keys per split, the fewest (see split_keys_of)
  int64_t long_split_keys;  // prefix keys per split, the most
};

// Row rr of a work item (heads kvh0 ..) is query head h of tree node t.
struct RowIndex {
  int64_t t, h;
};
inline RowIndex row_index(const Shape& sh, int64_t kvh0, int64_t rr) {
  const int64_t head = rr / sh.rows, r = rr % sh.rows;
  return {r / sh.g, (kvh0 + head) * sh.g + r % sh.g};
}

// Streams keys [begin, end) of the item's KV heads through the online softmax of every query
// row. k/v point at element (b, 0, kvh0). tree: keys are tree nodes begin.. and use the mask.
template <class K, AttnDType DT>
void attend_range(const AttentionArgs& a, const Shape& sh, const typename Elem<DT>::T* k,
                  const typename Elem<DT>::T* v, int64_t begin, int64_t end, bool tree,
                  const uint32_t* mask_b, Workspace& ws, float* o, SoftmaxState* st) {
  const int d = static_cast<int>(sh.d);
  const int rows = static_cast<int>(sh.rows);
  const int64_t rs = a.kv_strides[1], hs = a.kv_strides[2];
  std::fill(o, o + sh.heads * sh.rows * sh.d, 0.0f);
  for (int64_t r = 0; r < sh.heads * sh.rows; ++r) st[r] = softmax_init();
  const int64_t row_bytes = sh.d * static_cast<int64_t>(sizeof(*k));
#ifdef SD_X86
  if constexpr (K::kAmx) amx_configure(kRowTile);
#endif
  for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, end - j0));
    // Ask for the next block early so its lines are in flight while this one computes. The hints
    // park the lines in L2 (prefetcht1): a block of one KV head is 64 KiB of fp32 keys and
    // values, twice L1, so hints into L1 evicted the block being computed. From DRAM, alternating
    // processes (Hq = 32, Hkv = 8, D = 128): T = 5 to 16 took 5-32 % less time than with L1
    // hints (fp32 and bf16, B = 8 / S = 4096 and B = 1 / S = 16384), T = 64 the same.
    const int64_t next_n = std::min<int64_t>(kBlock, end - j0 - n);
    for (int64_t j = 0; j < next_n; ++j) {
      for (int64_t head = 0; head < sh.heads; ++head) {
        const char* kr = reinterpret_cast<const char*>(k + (j0 + n + j) * rs + head * hs);
        const char* vr = reinterpret_cast<const char*>(v + (j0 + n + j) * rs + head * hs);
        for (int64_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(kr + off, 0, 2);
          __builtin_prefetch(vr + off, 0, 2);
        }
      }
    }
    for (int64_t head = 0; head < sh.heads; ++head) {
      K::template load_kt<DT>(k + j0 * rs + head * hs, rs, n, d, ws.kt);
      // With one row tile (few rows, memory bound) the values are read once, straight from the
      // cache and converted in registers. Many row tiles read them many times, so they are first
      // staged as contiguous fp32 (bf16 with AVX512_BF16: as pair words for vdpbf16ps, see
      // tile_pv): a head's rows are Hkv * D apart, which maps them onto few L1 sets, and bf16 /
      // fp16 would be converted once per tile.
      const bool stage_v = rows > K::kDirectRows;
      if (stage_v) {
        if constexpr (K::kTilePairs) {
          K::template stage_tile_v<DT>(v + j0 * rs + head * hs, rs, n, d, ws.vb);
        } else {
          K::template load_rows<DT>(v + j0 * rs + head * hs, rs, n, d, 1.0f, ws.vb);
        }
      }
      const int64_t base = head * sh.rows;
      for (int r0 = 0; r0 < rows; r0 += kRowTile) {
        const int rb = std::min(kRowTile, rows - r0);
        K::scores(ws.q + (base + r0) * sh.d, rb, d, ws.kt, ws.s, a.scale * kLog2e);
        for (int i = 0; i < rb; ++i) {
          const int t = (r0 + i) / static_cast<int>(sh.g);
          const uint32_t* mrow = mask_b ? mask_b + t * sh.words : nullptr;
          const uint64_t vis = block_visibility(mrow, t, static_cast<int>(j0 - begin), n, tree);
          ws.alpha[i] = K::softmax_row(ws.s + i * kBlock, vis, &st[base + r0 + i]);
        }
        if (stage_v) {
          if constexpr (K::kTilePairs) {
            K::tile_pv(ws.s, rb, n, ws.vb, d, ws.alpha, o + (base + r0) * sh.d);
          } else {
            K::template pv<AttnDType::kFloat32>(ws.s, rb, n, ws.vb, d, d, ws.alpha,
                                                o + (base + r0) * sh.d);
          }
        } else {
          K::template pv<DT>(ws.s, rb, n, v + j0 * rs + head * hs, rs, d, ws.alpha,
                             o + (base + r0) * sh.d);
        }
      }
    }
  }
#ifdef SD_X86
  if constexpr (K::kAmx) amx_release();
#endif
}

#ifdef SD_X86
// attend_range for bf16 on AMX (head dims that are multiples of 64), with the loops set for the
// tile unit: each KV head's keys are staged a chunk (kChunkKeys) at a time, K^T and V as the
// pair words of load_kt / stage_tile_v, and every 32-row tile of its query rows runs the chunk's
// scores, softmax and P V (AmxKernels::chunk_tile). Against attend_range's 8-row tiles over
// 64-key blocks each K^T and V tile loaded feeds 32 rows rather than 8, the O rows move through
// the C tiles (and are scaled, only where a row's max grew) once per chunk, and a row's max and
// sum are reduced once per 128 keys.
void amx_chunk_range(const AttentionArgs& a, const Shape& sh, const uint16_t* k, const uint16_t* v,
                     int64_t begin, int64_t end, bool tree, const uint32_t* mask_b, Workspace& ws,
                     float* o, SoftmaxState* st) {
  using K = AmxKernels;
  constexpr AttnDType kBf16 = AttnDType::kBFloat16;
  const int d = static_cast<int>(sh.d);
  const int rows = static_cast<int>(sh.rows);
  const int64_t rs = a.kv_strides[1], hs = a.kv_strides[2];
  const float mult = a.scale * kLog2e;
  std::fill(o, o + sh.heads * sh.rows * sh.d, 0.0f);
  for (int64_t r = 0; r < sh.heads * sh.rows; ++r) st[r] = softmax_init();
  const int tiles = (rows + kChunkRows - 1) / kChunkRows;
  // A last partial tile of each KV head works on padded rows (zero queries past its rows) of
  // 16, or 32 past 16, set up once per range: its query rows, and its output rows, which are
  // copied back after the last chunk.
  const int part = rows % kChunkRows;
  const int64_t pad_stride = static_cast<int64_t>(kChunkRows) * d;
  if (part != 0) {
    std::fill(ws.q_pad, ws.q_pad + sh.heads * pad_stride, 0.0f);
    std::fill(ws.o_pad, ws.o_pad + sh.heads * pad_stride, 0.0f);
    for (int64_t head = 0; head < sh.heads; ++head) {
      std::memcpy(ws.q_pad + head * pad_stride, ws.q + (head * sh.rows + rows - part) * sh.d,
                  static_cast<size_t>(part) * d * sizeof(float));
    }
  }
  amx_configure(kAmxRows);
  for (int64_t c0 = begin; c0 < end; c0 += kChunkKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kChunkKeys, end - c0));
    const int blocks = (nk + kBlock - 1) / kBlock;
    const int last_n = nk - (blocks - 1) * kBlock;
    const int pairs = (blocks - 1) * (kBlock / 2) + (last_n + 1) / 2;
    for (int64_t head = 0; head < sh.heads; ++head) {
      for (int b = 0; b < blocks; ++b) {
        const int n = std::min(kBlock, nk - b * kBlock);
        const int64_t at = (c0 + b * kBlock) * rs + head * hs;
        K::load_kt<kBf16>(k + at, rs, n, d,
                          ws.kt_chunk + static_cast<int64_t>(b) * (d / 2) * kBlock);
        K::stage_tile_v<kBf16>(v + at, rs, n, d,
                               ws.v_chunk + static_cast<int64_t>(b) * (kBlock / 2) * d);
      }
      // The next (head, chunk) to stage, hinted into L2 during this one's tiles (chunk_tile):
      // a head's rows are Hkv * D elements apart, a stride the hardware prefetchers do not
      // follow across pages.
      const bool next_head = head + 1 < sh.heads;
      const int64_t nc0 = next_head ? c0 : c0 + kChunkKeys;
      const int64_t nhead = next_head ? head + 1 : 0;
      const int next_nk =
          static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kChunkKeys, end - nc0)));
      const int64_t base = head * sh.rows;
      auto padded = [&](int ti) { return part != 0 && ti == tiles - 1; };
      auto tile_q = [&](int ti) -> const float* {
        return padded(ti) ? ws.q_pad + head * pad_stride : ws.q + (base + ti * kChunkRows) * sh.d;
      };
      auto tile_o = [&](int ti) -> float* {
        return padded(ti) ? ws.o_pad + head * pad_stride : o + (base + ti * kChunkRows) * sh.d;
      };
      auto tile_rows = [&](int ti) { return std::min(kChunkRows, rows - ti * kChunkRows); };
      auto tile_halves = [&](int ti) { return tile_rows(ti) > kAmxRows ? 2 : 1; };
      // Two score buffers: tile ti's softmax reads one while tile ti + 1's scores fill the
      // other, after tile ti - 1's P V (earlier in the same step) has read its weights there.
      auto tile_s = [&](int ti) { return ws.s_chunk + (ti % 2) * kChunkRows * kChunkKeys; };
      auto scores_job = [&](int ti) {
        return K::ScoresJob{tile_q(ti), ws.kt_chunk, tile_s(ti), d, blocks, tile_halves(ti)};
      };
      auto pv_job = [&](int ti) {
        return K::PvJob{tile_s(ti), ws.v_chunk, tile_o(ti), d, pairs, tile_halves(ti)};
      };
      K::run_scores(scores_job(0));
      for (int ti = 0; ti < tiles; ++ti) {
        const int r0 = ti * kChunkRows, rb = tile_rows(ti);
        for (int i = 0; i < rb; ++i) {
          const int t = (r0 + i) / static_cast<int>(sh.g);
          const uint32_t* mrow = mask_b ? mask_b + t * sh.words : nullptr;
          for (int b = 0; b < blocks; ++b) {
            const int n = std::min(kBlock, nk - b * kBlock);
            ws.vis_chunk[i * blocks + b] =
                block_visibility(mrow, t, static_cast<int>(c0 - begin) + b * kBlock, n, tree);
          }
        }
        const K::PvJob prev = ti > 0 ? pv_job(ti - 1) : K::PvJob{};
        const K::ScoresJob next = ti + 1 < tiles ? scores_job(ti + 1) : K::ScoresJob{};
        const int h0 = ti * next_nk / tiles, h1 = (ti + 1) * next_nk / tiles;
        const K::HintJob hint{k + (nc0 + h0) * rs + nhead * hs, v + (nc0 + h0) * rs + nhead * hs,
                              rs, h1 - h0, d * 2};
        K::chunk_tile(tile_s(ti), rb, tile_halves(ti), blocks, ws.vis_chunk, mult, st + base + r0,
                      tile_o(ti), d, ti > 0 ? &prev : nullptr, ti + 1 < tiles ? &next : nullptr,
                      hint);
      }
      K::run_pv(pv_job(tiles - 1));
    }
  }
  amx_release();
  for (int64_t head = 0; head < sh.heads && part != 0; ++head) {
    std::memcpy(o + (head * sh.rows + rows - part) * sh.d, ws.o_pad + head * pad_stride,
                static_cast<size_t>(part) * d * sizeof(float));
  }
}
#endif

#ifdef SD_X86
// attend_range for bf16 on AMX with 8 to 16 query rows per KV head (head dims that are multiples
// of 64), on the transposed score tiles of AmxKernels::key_scores: per block of 64 keys and KV
// head, the scores with the keys read from the cache as they lie, the lane softmax down the keys
// (key_weights), the values staged as pairs and the P V into the head's 16 padded output rows
// (key_pv). The tree part (T <= 16 nodes here) takes it too, each key hidden from the rows whose
// mask row lacks it (key_lane_masks). Same state and accumulator contract as attend_range.
void amx_key_range(const AttentionArgs& a, const Shape& sh, const uint16_t* k, const uint16_t* v,
                   int64_t begin, int64_t end, bool tree, const uint32_t* mask_b, Workspace& ws,
                   float* o, SoftmaxState* st) {
  using K = AmxKernels;
  const int d = static_cast<int>(sh.d);
  const int rows = static_cast<int>(sh.rows);
  const int heads = static_cast<int>(sh.heads);
  const int g = static_cast<int>(sh.g);
  const int words = d / 2;
  const int64_t rs = a.kv_strides[1], hs = a.kv_strides[2];
  const int row_bytes = d * static_cast<int>(sizeof(uint16_t));
  const float mult = a.scale * kLog2e;
  std::fill(ws.o_keys, ws.o_keys + static_cast<int64_t>(heads) * kAmxRows * d, 0.0f);
  for (int h = 0; h < heads; ++h) {
    K::lane_query<Lanes16>(ws.q + static_cast<int64_t>(h) * rows * d, d, rows, words,
                           ws.qt + static_cast<int64_t>(h) * words * kLanes);
    float* ml = ws.lane_ml + h * 2 * kLanes;
    std::fill(ml, ml + kLanes, -INFINITY);
    std::fill(ml + kLanes, ml + 2 * kLanes, 0.0f);
  }
  uint16_t* kpad = reinterpret_cast<uint16_t*>(ws.kt);
  alignas(64) float alpha[kLanes];
  // The item's key rows (and value rows) lie back to back: its heads are every KV head of the
  // rows, which are contiguous in the cache.
  const bool rows_adjacent = hs == d && rs == static_cast<int64_t>(heads) * d;
  amx_configure(kAmxRows);
  for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, end - j0));
    const int n_next = static_cast<int>(std::min<int64_t>(kBlock, end - j0 - n));
    const NextKeys<uint16_t> next_k{k + (j0 + n) * rs, n_next, rs, hs};
    const uint16_t* next_v = v + (j0 + n) * rs;
    // The tree part: bit r of vis[j] is set when row r (tree node r / g) sees key j0 + j; the
    // same for every KV head (a tree of at most 16 nodes here, so n <= 16).
    uint32_t vis[kBlock];
    if (tree) {
      uint32_t node_vis[kLanes];
      node_visibility(mask_b, sh.words, rows / g, static_cast<int>(j0 - begin), n, node_vis);
      key_lane_masks(node_vis, rows, g, n, vis);
    }
    for (int h = 0; h < heads; ++h) {
      const int64_t at = j0 * rs + h * hs;
      // The next block, hinted into L2 in a burst before each head's work here (the hardware
      // prefetchers do not follow rows Hkv * D apart across pages): where the item's rows are
      // one span (all KV heads of an unstrided cache), share h of that span in address order,
      // otherwise head h's own rows. The same lines either way; in address order bf16 T = 2 to
      // 4 took 0.94-0.97x the time from DRAM (session 46, bench/RESULTS.md). Every second or
      // fourth line alone, for the hardware to fill in, took 1.12-1.39x; the lane path's
      // blocks, whose values are hinted during their P V, took 1.09-1.18x in address order.
      if (rows_adjacent) {
        hint_shares(k + (j0 + n) * rs, next_v, n_next * rs, h, heads);
      } else {
        for (int j = 0; j < n_next; ++j) {
          next_k.hint(j, h, row_bytes);
          hint_next_values(next_v + h * hs, j, rs, row_bytes);
        }
      }
      float* ml = ws.lane_ml + h * 2 * kLanes;
      K::key_scores(ws.qt + static_cast<int64_t>(h) * words * kLanes, k + at, rs, n, d, kpad,
                    ws.s_keys);
      K::key_weights(ws.s_keys, n, tree ? vis : nullptr, mult, ml, ws.pw_keys, alpha);
      K::stage_tile_v<AttnDType::kBFloat16>(v + at, rs, n, d, ws.vb);
      K::key_pv(ws.pw_keys, n, ws.vb, d, alpha, ws.o_keys + static_cast<int64_t>(h) * kAmxRows * d);
    }
  }
  amx_release();
  for (int h = 0; h < heads; ++h) {
    const float* ml = ws.lane_ml + h * 2 * kLanes;
    for (int r = 0; r < rows; ++r) {
      st[h * rows + r] = SoftmaxState{ml[r], ml[kLanes + r]};
      std::memcpy(o + (static_cast<int64_t>(h) * rows + r) * d,
                  ws.o_keys + (static_cast<int64_t>(h) * kAmxRows + r) * d, d * sizeof(float));
    }
  }
}
#endif

// The query rows per KV head from which bf16 on AMX takes amx_key_range (up to kAmxRows, the
// columns of a tile). Against attend_range's 8-row tiles, S = 4096, B = 1 / 8, caches cold
// (bench/attention_ab.py, session 42): 8 rows (T = 2 at GQA 4) 0.98x / 0.94x the time, 12 rows
// 0.76x / 0.69x, 16 rows 0.81x / 0.84x.
constexpr int64_t kKeyMinRows = 8;

// Whether a work item takes amx_key_range where it would take the tiles.
template <class K, AttnDType DT>
bool use_amx_keys(const Shape& sh) {
  return K::kAmx && DT == AttnDType::kBFloat16 && sh.d % 64 == 0 && sh.rows >= kKeyMinRows &&
         sh.rows <= kAmxRows;
}

// The query rows per KV head from which bf16 on AMX takes amx_chunk_range. Against attend_range's
// 8-row tiles, S = 4096, B = 1 / 8, caches cold (bench/attention_ab.py, session 41): 32 rows
// (T = 8 at GQA 4) 0.88x / 0.83x the time, 64 rows 0.69x / 0.82x, 256 rows 0.66x / 0.67x; at 16
// rows (T = 4) 1.00-1.07x with warm caches, so that stays on attend_range.
constexpr int64_t kChunkMinRows = 32;

// Whether a work item takes the chunked AMX path (amx_chunk_range) where it would take the tiles.
template <class K, AttnDType DT>
bool use_amx_chunks(const Shape& sh) {
  return K::kAmx && DT == AttnDType::kBFloat16 && sh.d % 64 == 0 && sh.rows >= kChunkMinRows;
}

// The AMX paths of bf16: amx_chunk_range (32 or more rows per KV head, use_amx_chunks) and
// amx_key_range (8 to 16, use_amx_keys).
enum class AmxPath { kChunks, kKeys };

// The AMX path `path` for the element type of DT: only ever bf16 where its use_amx_* holds, so
// the other element types (and other architectures) compile to nothing here.
template <AttnDType DT>
void amx_range(AmxPath path, const AttentionArgs& a, const Shape& sh, const typename Elem<DT>::T* k,
               const typename Elem<DT>::T* v, int64_t begin, int64_t end, bool tree,
               const uint32_t* mask_b, Workspace& ws, float* o, SoftmaxState* st) {
#ifdef SD_X86
  if constexpr (DT == AttnDType::kBFloat16) {
    if (path == AmxPath::kChunks) {
      amx_chunk_range(a, sh, k, v, begin, end, tree, mask_b, ws, o, st);
    } else {
      amx_key_range(a, sh, k, v, begin, end, tree, mask_b, ws, o, st);
    }
    return;
  }
#endif
  (void)path, (void)a, (void)sh, (void)k, (void)v, (void)begin, (void)end, (void)tree, (void)mask_b,
      (void)ws, (void)o, (void)st;
}

// Whether the prefix of a work item takes the streaming path (see stream_partials_f32) or,
// with more rows per KV head, the lane path (see lanes_transpose).
template <class K>
bool use_stream(const Shape& sh) {
  return K::kStream && sh.rows <= K::kStreamRows;
}
template <class K>
bool use_lanes(const Shape& sh) {
  return K::kLaneRows > 0 && sh.rows > K::kStreamRows && sh.rows <= K::kLaneRows;
}
// The KV head whose next block is hinted during head h's work in the streaming and lane paths.
// A head's rows of every position lie the same offset into a 4 KiB page ([Hkv = 8, D = 128]
// rows), so its next block maps to the very L1 sets its current keys and values occupy, and
// hints fill L1 on AMD cores: where K::kHintOtherHead, head h hints the block of head
// h + heads / 2 (every head's next block is still hinted once per block, a few heads' work
// earlier or later).
template <class K>
SD_FORCE_INLINE int hinted_head(int h, int heads) {
  return K::kHintOtherHead ? (h + heads / 2) % heads : h;
}

// The prefix keys [begin, end) of the item's KV heads, read key-major in blocks of kStreamKeys:
// scores of every query row (stream_scores), then per KV head the online-softmax update and P V
// of the block. Same state and accumulator contract as attend_range, tree and mask_b included:
// the tree part of an item on this path takes it too, each row's keys masked by its mask row
// (the tiles of attend_range would transpose and score a whole 64-key block for T <= 4 nodes:
// at T = 1 that cost as much as about 40 prefix keys).
//
// Overlap of transfer and compute: each core reads its items from DRAM at a limited rate (one
// core streams about 20-23 GB/s here), so the transfer of a block must proceed while the
// previous block computes. The hardware prefetchers stop at every 4 KiB page, i.e. at every fp32
// key row of [Hkv = 8, D = 128], so the next block is hinted into L2 in software: its keys by
// this block's scores (NextKeys, one key row hinted per key row read), its values by this
// block's P V (one line per line of V read; head h's P V hints hinted_head(h)'s values). The
// requests are thus spread over both phases at a steady rate. Measured on the 2-core Zen 4 VM,
// same-run A/Bs:
// - against a scheme that prefetched a block's values into L1 in a burst during its scores and
//   left the keys to the hardware: T = 1 and 2 took 5-50 % less time from DRAM, most for bf16
//   (the same hints into L1, or two blocks ahead, were not faster);
// - against hinting the keys during the P V as well (twice the hints in half the time, nothing
//   during the scores), T = 1 from DRAM: fp32 took 10-28 % less time on AVX-512 and 25-28 % less
//   on AVX2, fp16 7-12 % less; bf16 moved both ways within the noise of its rounds (session 12,
//   bench/results/attention_s12_next_keys.txt).
template <class K, AttnDType DT>
void stream_range(const AttentionArgs& a, const Shape& sh, const typename Elem<DT>::T* k,
                  const typename Elem<DT>::T* v, int64_t begin, int64_t end, bool tree,
                  const uint32_t* mask_b, Workspace& ws, float* o, SoftmaxState* st) {
  if constexpr (K::kStream) {
    const int d = static_cast<int>(sh.d);
    const int rows = static_cast<int>(sh.rows);
    const int heads = static_cast<int>(sh.heads);
    const int64_t rs = a.kv_strides[1], hs = a.kv_strides[2];
    std::fill(o, o + sh.heads * sh.rows * sh.d, 0.0f);
    for (int64_t r = 0; r < sh.heads * sh.rows; ++r) st[r] = softmax_init();
    for (int64_t j0 = begin; j0 < end; j0 += kStreamKeys) {
      const int n = static_cast<int>(std::min<int64_t>(kStreamKeys, end - j0));
      // Keys of this item's next block (none after its last): its keys are hinted during this
      // block's scores, its values during this block's P V.
      const int n_next = static_cast<int>(std::min<int64_t>(kStreamKeys, end - j0 - n));
      const NextKeys<typename Elem<DT>::T> next{k + (j0 + n) * rs, n_next, rs, hs};
      K::template stream_scores<DT>(ws.q, heads, rows, d, k + j0 * rs, rs, hs, n, next,
                                    a.scale * kLog2e, ws.part, ws.sall);
      // The tree part: each node's visible keys of the block, the same for every KV head (rows
      // <= kStreamRows, so nodes <= rows).
      const int g = static_cast<int>(sh.g);
      uint32_t node_vis[K::kStreamRows];
      if (tree) {
        node_visibility(mask_b, sh.words, rows / g, static_cast<int>(j0 - begin), n, node_vis);
      }
      const uint32_t all = (uint32_t{1} << n) - 1;
      for (int h = 0; h < heads; ++h) {
        float* sh_rows = ws.sall + static_cast<int64_t>(h) * rows * kBlock;
        for (int r = 0; r < rows; ++r) {
          const uint32_t vis = tree ? node_vis[r / g] : all;
          ws.alpha[r] = K::softmax_row16(sh_rows + r * kBlock, vis, &st[h * rows + r]);
        }
        K::template pv_stream<DT>(sh_rows, rows, n, v + j0 * rs + h * hs, rs, d, ws.alpha,
                                  o + static_cast<int64_t>(h) * rows * sh.d,
                                  v + (j0 + n) * rs + hinted_head<K>(h, heads) * hs, n_next);
      }
    }
  }
}

// The prefix keys [begin, end) of the item's KV heads with the query rows of each KV head in
// the lanes of L (lanes_transpose), in blocks of kStreamKeys keys: per KV head the scores and the
// lane-wise softmax update (K::lane_block), then the P V tiles of the streaming path. The next
// block is hinted into L2 as in stream_range: a head's keys before its scores, its values during
// its P V. Against hinting both during the P V, from DRAM, alternating processes (session 12,
// bench/results/attention_s12_lane_next_keys.txt): bf16 T = 4 at B = 8, S = 4096 took 15-16 %
// less time, T = 2 2-15 % less (fp32 and bf16), T = 3 and fp32 T = 4 within 3 %. The block
// hinted during head h's work is that of hinted_head(h). Same state and accumulator contract as
// attend_range, tree and mask_b included: as on the streaming path, the tree part of an item on
// this path takes it too, each key hidden from the rows whose mask row lacks it.
template <class K, AttnDType DT, class L>
void lane_range_of(const AttentionArgs& a, const Shape& sh, const typename Elem<DT>::T* k,
                   const typename Elem<DT>::T* v, int64_t begin, int64_t end, bool tree,
                   const uint32_t* mask_b, Workspace& ws, float* o, SoftmaxState* st) {
  const int d = static_cast<int>(sh.d);
  const int rows = static_cast<int>(sh.rows);
  const int heads = static_cast<int>(sh.heads);
  const int64_t rs = a.kv_strides[1], hs = a.kv_strides[2];
  const int64_t words = K::template lane_words<DT>(d);
  const int row_bytes = d * static_cast<int>(sizeof(typename Elem<DT>::T));
  std::fill(o, o + sh.heads * sh.rows * sh.d, 0.0f);
  for (int h = 0; h < heads; ++h) {
    K::template lane_query<L>(ws.q + static_cast<int64_t>(h) * rows * d, d, rows,
                              static_cast<int>(words), ws.qt + h * words * L::kW);
    float* ml = ws.lane_ml + h * 2 * kLanes;
    std::fill(ml, ml + kLanes, -INFINITY);
    std::fill(ml + kLanes, ml + 2 * kLanes, 0.0f);
  }
  for (int64_t j0 = begin; j0 < end; j0 += kStreamKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kStreamKeys, end - j0));
    const int n_next = static_cast<int>(std::min<int64_t>(kStreamKeys, end - j0 - n));
    const NextKeys<typename Elem<DT>::T> next{k + (j0 + n) * rs, n_next, rs, hs};
    // The tree part: bit r of vis[j] is set when row r (tree node r / g) sees key j0 + j; the
    // same for every KV head.
    uint32_t vis[kStreamKeys];
    if (tree) {
      const int g = static_cast<int>(sh.g);
      uint32_t node_vis[kLanes];
      node_visibility(mask_b, sh.words, rows / g, static_cast<int>(j0 - begin), n, node_vis);
      key_lane_masks(node_vis, rows, g, n, vis);
    }
    for (int h = 0; h < heads; ++h) {
      // The hinted head's next keys are hinted before this head's scores, its next values during
      // this head's P V (as in stream_range, one burst here: the lane scores of a head take as
      // long as its P V).
      const int hinted = hinted_head<K>(h, heads);
      for (int j = 0; j < n_next; ++j) next.hint(j, hinted, row_bytes);
      K::template lane_block<DT, L>(ws.qt + h * words * L::kW, d, rows, k + j0 * rs + h * hs, rs, n,
                                    tree ? vis : nullptr, a.scale * kLog2e, ws.kt,
                                    ws.lane_ml + h * 2 * kLanes, ws.sall, ws.alpha);
      K::template lane_pv<DT>(ws.sall, rows, n, v + j0 * rs + h * hs, rs, d, ws.alpha,
                              o + static_cast<int64_t>(h) * rows * sh.d,
                              v + (j0 + n) * rs + hinted * hs, n_next, ws.vb);
    }
  }
  for (int h = 0; h < heads; ++h) {
    const float* ml = ws.lane_ml + h * 2 * kLanes;
    for (int r = 0; r < rows; ++r) st[h * rows + r] = SoftmaxState{ml[r], ml[kLanes + r]};
  }
}

// lane_range_of on the narrowest lane vector that holds the rows of a KV head.
template <class K, AttnDType DT>
void lane_range(const AttentionArgs& a, const Shape& sh, const typename Elem<DT>::T* k,
                const typename Elem<DT>::T* v, int64_t begin, int64_t end, bool tree,
                const uint32_t* mask_b, Workspace& ws, float* o, SoftmaxState* st) {
  // Only the x86 kernels have a lane path (K::kLaneRows is 0 elsewhere, and the lane vectors
  // exist only there).
#ifdef SD_X86
  if constexpr (K::kLaneRows > 0) {
    if (sh.rows <= Lanes8::kW) {
      lane_range_of<K, DT, Lanes8>(a, sh, k, v, begin, end, tree, mask_b, ws, o, st);
    } else if constexpr (K::kLaneRows > Lanes8::kW) {
      lane_range_of<K, DT, Lanes16>(a, sh, k, v, begin, end, tree, mask_b, ws, o, st);
    }
  }
#endif
}

// One work item: KV heads kvh0 .. kvh0 + sh.heads of sequence b over prefix keys [begin, end),
// plus the tree part when with_tree. Hands each row's finished (o, lse2) to `emit`.
template <class K, AttnDType DT, class Emit>
void run_item(const AttentionArgs& a, const Shape& sh, int64_t b, int64_t kvh0, int64_t begin,
              int64_t end, bool with_tree, Emit&& emit) {
  using T = typename Elem<DT>::T;
  Workspace& ws = thread_workspace();
  const int64_t rows = sh.heads * sh.rows;
  const bool stream = use_stream<K>(sh), lanes = use_lanes<K>(sh);
  const bool chunks = !stream && !lanes && use_amx_chunks<K, DT>(sh);
  const bool keys = !stream && !lanes && use_amx_keys<K, DT>(sh);
  ws.reserve(rows, sh.d, stream, lanes || keys ? sh.heads : 0, chunks ? sh.heads : 0,
             keys ? sh.heads : 0);
  const int d = static_cast<int>(sh.d);
  const T* q = static_cast<const T*>(a.q);
  const float mult = a.scale * kLog2e;
  for (int64_t rr = 0; rr < rows; ++rr) {
    const RowIndex ri = row_index(sh, kvh0, rr);
    const T* src = q + b * a.q_strides[0] + ri.t * a.q_strides[1] + ri.h * a.q_strides[2];
    K::template load_q<DT>(src, d, mult, ws.q + rr * sh.d);
  }
  const T* k = static_cast<const T*>(a.k) + b * a.kv_strides[0] + kvh0 * a.kv_strides[2];
  const T* v = static_cast<const T*>(a.v) + b * a.kv_strides[0] + kvh0 * a.kv_strides[2];
  if (stream) {
    stream_range<K, DT>(a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix, ws.st_prefix);
  } else if (lanes) {
    lane_range<K, DT>(a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix, ws.st_prefix);
  } else if (chunks) {
    amx_range<DT>(AmxPath::kChunks, a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix,
                  ws.st_prefix);
  } else if (keys) {
    amx_range<DT>(AmxPath::kKeys, a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix,
                  ws.st_prefix);
  } else {
    attend_range<K, DT>(a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix, ws.st_prefix);
  }
  if (with_tree) {
    const int64_t prefix = a.prefix_lens[b];
    const uint32_t* mask_b = a.mask ? a.mask + b * sh.t * sh.words : nullptr;
    const int64_t rs = a.kv_strides[1];
    if (stream) {
      stream_range<K, DT>(a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true, mask_b, ws,
                          ws.o_tree, ws.st_tree);
    } else if (lanes) {
      lane_range<K, DT>(a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true, mask_b, ws,
                        ws.o_tree, ws.st_tree);
    } else if (chunks) {
      amx_range<DT>(AmxPath::kChunks, a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true,
                    mask_b, ws, ws.o_tree, ws.st_tree);
    } else if (keys) {
      amx_range<DT>(AmxPath::kKeys, a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true, mask_b,
                    ws, ws.o_tree, ws.st_tree);
    } else {
      attend_range<K, DT>(a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true, mask_b, ws,
                          ws.o_tree, ws.st_tree);
    }
  }
  for (int64_t rr = 0; rr < rows; ++rr) {
    float inv_p, inv_t = 0.0f;
    const float lse_p = softmax_finish(ws.st_prefix[rr], &inv_p);
    const float lse_t = with_tree ? softmax_finish(ws.st_tree[rr], &inv_t) : -INFINITY;
    float wp, wt;
    const float lse = lse_merge_weights(lse_p, lse_t, &wp, &wt);
    wp *= inv_p;
    wt *= inv_t;
    float* op = ws.o_prefix + rr * sh.d;
    const float* ot = ws.o_tree + rr * sh.d;
    // wt == 0 whenever the tree part is absent or empty, so o_tree is never read uninitialised.
    for (int i = 0; i < d; ++i) op[i] = wp * op[i] + (wt != 0.0f ? wt * ot[i] : 0.0f);
    emit(rr, op, lse);
  }
}

template <AttnDType DT>
void write_row(const AttentionArgs& a, const Shape& sh, int64_t b, RowIndex ri, const float* o,
               float lse2) {
  using T = typename Elem<DT>::T;
  const int64_t row = (b * sh.t + ri.t) * a.q_heads + ri.h;
  T* dst = static_cast<T*>(a.out) + row * sh.d;
  for (int64_t i = 0; i < sh.d; ++i) dst[i] = Elem<DT>::store(o[i]);
  if (a.lse) a.lse[row] = lse2 * kLn2;
}

// Work decomposition, a function of the shapes only (never of the thread count, so results do
// not depend on it). Few query rows per KV head (decoding, short chains) are memory bound: one
// item then takes every KV head of a sequence, so it streams whole cache rows [Hkv, D] of
// consecutive positions (each KV head alone would touch a new 4 KiB page per position), and the
// prefix is split finely for parallelism (run may still cut the heads into groups where the
// items are fewer than the threads: heads_per_item). Many rows are compute bound: one KV head
// per item and long splits, which keep the merge scratch small.
Shape make_shape(const AttentionArgs& a) {
  Shape sh;
  sh.t = a.tree_len;
  sh.g = a.q_heads / a.kv_heads;
  sh.d = a.head_dim;
  sh.rows = sh.t * sh.g;
  sh.words = mask_words(static_cast<int>(sh.t));
  const bool grouped = sh.rows * a.kv_heads <= 128;
  sh.heads = grouped ? a.kv_heads : 1;
  sh.split_keys = grouped ? 256 : 2048;
  sh.long_split_keys = grouped ? 1024 : 2048;
  sh.splits = 1;
  return sh;
}

// A prefix is cut into about this many splits, as long as its splits stay between the shape's
// fewest and most keys (split_keys_of), and the splits are whole multiples of kSplitUnit keys
// (an AMX chunk; the 64- and 16-key blocks of the other paths divide it).
constexpr int64_t kSplitsPerPrefix = 8;
constexpr int64_t kSplitUnit = 128;

// Rows per chunk of the merge of the splits: each row reads splits * (D + 1) floats.
constexpr int64_t kMergeGrain = 16;

// Keys per split of a row with this prefix: a function of the row's own prefix only, so a row's
// result never depends on the other rows of the batch. Where items take every KV head (256 to
// 1024 keys), a longer split starts cold (nothing hinted before its first block) less often and
// leaves fewer partial rows to merge, while about eight of them still spread a sequence over the
// threads: 256 keys up to a prefix of 2048, 1024 from 7169 on, between them an eighth of the
// prefix rounded up to kSplitUnit. From DRAM, alternating processes: 1024-key splits took 2-16 %
// less time than 256 at B = 1, S = 16384 and 10 % less at B = 2, S = 8192 (session 10,
// bench/results/attention_s10_long_splits.txt), where the rule was 256 below 8192 keys and 1024
// from there; this rule took 0.86-0.99x that one's time at S = 2100-7500, B = 1 and 8, in all
// but one of 33 A/B pairs (1.04 once, 0.96 in the next run; session 46, bench/RESULTS.md).
inline int64_t split_keys_of(const Shape& sh, int64_t prefix) {
  const int64_t eighth = (prefix + kSplitsPerPrefix - 1) / kSplitsPerPrefix;
  const int64_t whole = (eighth + kSplitUnit - 1) / kSplitUnit * kSplitUnit;
  return std::min(sh.long_split_keys, std::max(sh.split_keys, whole));
}

// KV heads per work item where the items that take every KV head of a sequence (make_shape's
// grouped shapes) would be fewer than the threads (few sequences with short prefixes: at B = 1 a
// prefix of at most 256 keys made one item, and the other threads waited): the fewest head
// groups that give every thread an item, as far as the KV heads divide. Every path computes a
// head's rows the same in any group (the splits, which change the sums, stay a function of the
// shapes), so this choice may follow the thread count and the other sequences without changing
// a result; test_head_groups_leave_results_unchanged holds it to that, bit for bit.
int64_t heads_per_item(const Shape& sh, int64_t kv_heads, int64_t items) {
  const int64_t threads = num_threads();
  if (sh.heads != kv_heads || items >= threads) return sh.heads;
  for (int64_t groups = 2; groups < kv_heads; ++groups) {
    if (kv_heads % groups == 0 && items * groups >= threads) return kv_heads / groups;
  }
  return 1;
}

template <class K, AttnDType DT>
void run(const AttentionArgs& a) {
  Shape sh = make_shape(a);
  const int64_t batch = a.batch;

  int64_t splits = 1;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = a.prefix_lens[b];
    const bool ok = p >= 0 && p + sh.t <= a.cache_len;
    a.status[b] = ok ? 0 : 1;
    if (ok) {
      const int64_t keys = split_keys_of(sh, p);
      splits = std::max(splits, (p + keys - 1) / keys);
    }
  }
  // Every sequence uses the same number of splits so work items index simply; a sequence with
  // fewer splits of its own gets empty leading splits, which merge as the identity.
  sh.splits = splits;
  sh.heads = heads_per_item(sh, a.kv_heads, batch * (a.kv_heads / sh.heads) * splits);
  const int64_t groups = a.kv_heads / sh.heads;
  const int64_t items = batch * groups * splits;
  const int64_t item_rows = sh.heads * sh.rows;
  const int64_t part_stride = item_rows * (sh.d + 1);

  // Every (item, row) slot the merge reads is written by its item first, so the scratch is left
  // uninitialised: zeroing it cost one thread up to a few percent of a B = 1 call.
  std::unique_ptr<float[]> scratch;
  if (splits > 1) scratch.reset(new float[static_cast<size_t>(items * part_stride)]);

  parallel_for(items, 1, [&](int64_t begin, int64_t end) {
    const FlushToZero ftz;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % splits, bg = item / splits;
      const int64_t b = bg / groups, kvh0 = (bg % groups) * sh.heads;
      if (a.status[b] != 0) {
        if (s == splits - 1) {
          std::vector<float> zero(sh.d, 0.0f);
          for (int64_t rr = 0; rr < item_rows; ++rr) {
            write_row<DT>(a, sh, b, row_index(sh, kvh0, rr), zero.data(), -INFINITY);
          }
        }
        continue;
      }
      const int64_t prefix = a.prefix_lens[b];
      // Splits are counted back from the end of the prefix, so the last split, which also takes
      // the tree, holds the most recent keys; leading splits of shorter prefixes are empty.
      const int64_t keys = split_keys_of(sh, prefix);
      const int64_t first = prefix - (splits - s) * keys;
      const int64_t kb = std::max<int64_t>(0, first);
      const int64_t ke = std::max<int64_t>(0, first + keys);
      const bool last = s == splits - 1;
      if (splits == 1) {
        run_item<K, DT>(a, sh, b, kvh0, 0, prefix, true,
                        [&](int64_t rr, const float* o, float lse) {
                          write_row<DT>(a, sh, b, row_index(sh, kvh0, rr), o, lse);
                        });
      } else {
        float* part = scratch.get() + item * part_stride;
        run_item<K, DT>(a, sh, b, kvh0, kb, std::min(ke, prefix), last,
                        [&](int64_t rr, const float* o, float lse) {
                          std::memcpy(part + rr * (sh.d + 1), o, sh.d * sizeof(float));
                          part[rr * (sh.d + 1) + sh.d] = lse;
                        });
      }
    }
  });
  if (splits == 1) return;

  // Merge the splits of every row in split order (deterministic whatever the chunks). Chunks
  // are rows, not sequences: at B = 1 one sequence holds every row, and merging them on one
  // thread left the others waiting.
  const int64_t merge_rows = batch * groups * item_rows;
  parallel_for(merge_rows, kMergeGrain, [&](int64_t begin, int64_t end) {
    const FlushToZero ftz;
    std::vector<float> acc(sh.d);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bg = row / item_rows, rr = row % item_rows;
      const int64_t b = bg / groups, kvh0 = (bg % groups) * sh.heads;
      if (a.status[b] != 0) continue;
      float lse = -INFINITY;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const float* part = scratch.get() + (bg * splits + s) * part_stride + rr * (sh.d + 1);
        float wa, wb;
        lse = lse_merge_weights(lse, part[sh.d], &wa, &wb);
        if (wb == 0.0f) continue;
        for (int64_t i = 0; i < sh.d; ++i) acc[i] = wa * acc[i] + wb * part[i];
      }
      write_row<DT>(a, sh, b, row_index(sh, kvh0, rr), acc.data(), lse);
    }
  });
}

template <class K>
void run_isa(const AttentionArgs& a) {
  switch (a.dtype) {
    case AttnDType::kFloat32:
      run<K, AttnDType::kFloat32>(a);
      break;
    case AttnDType::kFloat16:
      run<K, AttnDType::kFloat16>(a);
      break;
    case AttnDType::kBFloat16:
      run<K, AttnDType::kBFloat16>(a);
      break;
  }
}

}  // namespace

const char* attention_isa() {
  switch (current_isa()) {
    case Isa::kAmx:
      return "amx";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

bool set_attention_isa(const char* name) {
  const std::string s = name ? name : "";
  if (s.empty()) {
    isa_override().store(-1);
    return true;
  }
  Isa want;
  if (s == "generic")
    want = Isa::kGeneric;
  else if (s == "avx2")
    want = Isa::kAvx2;
  else if (s == "avx512")
    want = Isa::kAvx512;
  else if (s == "avx512bf16")
    want = Isa::kAvx512Bf16;
  else if (s == "amx")
    want = Isa::kAmx;
  else
    return false;
  if (static_cast<int>(want) > static_cast<int>(best_isa())) return false;
  isa_override().store(static_cast<int>(want));
  return true;
}

void tree_attention(const AttentionArgs& a) {
  if (a.batch == 0) return;
  switch (current_isa()) {
#ifdef SD_X86
    case Isa::kAmx:
      // The tiles' bf16 products on AMX; other dtypes run the AVX-512 fp32 code.
      if (a.dtype == AttnDType::kBFloat16) {
        run<AmxKernels, AttnDType::kBFloat16>(a);
      } else {
        run_isa<Avx512Kernels>(a);
      }
      break;
    case Isa::kAvx512Bf16:
      // The bf16 dot product only changes bf16 inputs; other dtypes run the AVX-512 fp32 code.
      if (a.dtype == AttnDType::kBFloat16) {
        run<Avx512Bf16Kernels, AttnDType::kBFloat16>(a);
      } else {
        run_isa<Avx512Kernels>(a);
      }
      break;
    case Isa::kAvx512:
      run_isa<Avx512Kernels>(a);
      break;
    case Isa::kAvx2:
      run_isa<Avx2Kernels>(a);
      break;
#endif
    default:
      run_isa<GenericKernels>(a);
      break;
  }
}

void compact_kv(void* k, void* v, int elem_size, const int64_t kv_strides[3], int64_t batch,
                int64_t cache_len, int64_t kv_heads, int64_t head_dim, const int32_t* prefix_lens,
                const int32_t* path, int path_len, const int32_t* num_accepted, int32_t* new_lens,
                int32_t* status) {
  bool all_ok = true;
  for (int64_t b = 0; b < batch; ++b) {
    int bad = 0;
    const CompactError err = validate_compact_row(path + b * path_len, path_len, num_accepted[b],
                                                  prefix_lens[b], cache_len, &bad);
    status[2 * b] = static_cast<int32_t>(err);
    status[2 * b + 1] = bad;
    all_ok = all_ok && err == CompactError::kOk;
  }
  if (!all_ok) return;
  const size_t row_bytes = static_cast<size_t>(head_dim) * elem_size;
  parallel_for(batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t prefix = prefix_lens[b];
      const int32_t* p = path + b * path_len;
      // Increasing i is safe: see validate_compact_row.
      for (int i = 0; i < num_accepted[b]; ++i) {
        if (p[i] == i) continue;
        for (char* base : {static_cast<char*>(k), static_cast<char*>(v)}) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t off = b * kv_strides[0] + h * kv_strides[2];
            char* dst = base + (off + (prefix + i) * kv_strides[1]) * elem_size;
            const char* src = base + (off + (prefix + p[i]) * kv_strides[1]) * elem_size;
            std::memmove(dst, src, row_bytes);
          }
        }
      }
      new_lens[b] = static_cast<int32_t>(prefix + num_accepted[b]);
    }
  });
}

}  // namespace cpu
}  // namespace sd
