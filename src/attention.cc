// Tree-masked attention on the CPU: split-KV flash attention over (batch, KV head, prefix split).
//
// A work item owns one KV head of one sequence and all T x (Hq / Hkv) query rows that share it,
// so each prefix key and value is read from memory once per KV head. Keys are streamed in blocks
// of kBlock positions: the block's keys are converted to fp32 and transposed (so the score tile
// is a small register-blocked GEMM), its values converted to fp32, and every query row updates
// its online-softmax state with the shared math of specdecode/attention.h.
//
// The prefix [0, prefix_len) is dense and unmasked; the tree [prefix_len, prefix_len + T) uses
// the bitmask. They accumulate into separate states that are merged with the log-sum-exp rule,
// like the prefix splits of a long cache. The split size is fixed (kSplitKeys), never derived from
// the thread count, so results do not depend on the number of threads.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's AVX-512 headers build _mm512_undefined_* from a self-initialised variable, which
// -Wuninitialized reports at every inlined use; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define SD_X86 1
#endif

#include "specdecode/attention.h"
#include "specdecode/attention_ops.h"
#include "specdecode/host_device.h"
#include "specdecode/parallel.h"

namespace sd {
namespace cpu {
namespace {

constexpr int kBlock = 64;            // keys per block: 4 vectors of 16 floats
constexpr int64_t kSplitKeys = 2048;  // prefix keys per work item (a multiple of kBlock)
constexpr int kRowTile = 4;           // query rows per register tile

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

// ---- portable kernels (also compiled for AVX2 through the always-inline bodies) ---------------
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

SD_FORCE_INLINE void generic_pv(const float* p, int rows, int n, const float* vb, int d,
                                const float* alpha, float* o) {
  for (int r = 0; r < rows; ++r) {
    float* orow = o + r * d;
    for (int i = 0; i < d; ++i) orow[i] *= alpha[r];
    for (int j = 0; j < n; ++j) {
      const float pj = p[r * kBlock + j];
      if (pj == 0.0f) continue;
      const float* vrow = vb + j * d;
      for (int i = 0; i < d; ++i) orow[i] += pj * vrow[i];
    }
  }
}

struct GenericKernels {
  template <AttnDType DT>
  static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d, float* kt) {
    generic_load_kt<DT>(k, rs, n, d, kt);
  }
  template <AttnDType DT>
  static void load_rows(const typename Elem<DT>::T* src, int64_t rs, int n, int d, float mult,
                        float* dst) {
    generic_load_rows<DT>(src, rs, n, d, mult, dst);
  }
  static void scores(const float* q, int rows, int d, const float* kt, float* s) {
    generic_scores(q, rows, d, kt, s);
  }
  static float softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
    return generic_softmax_row(s, visible, state);
  }
  static void pv(const float* p, int rows, int n, const float* vb, int d, const float* alpha,
                 float* o) {
    generic_pv(p, rows, n, vb, d, alpha, o);
  }
};

#ifdef SD_X86
#define SD_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SD_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

// The portable bodies again, vectorised by the compiler for AVX2 + FMA.
struct Avx2Kernels {
  template <AttnDType DT>
  SD_TARGET_AVX2 static void load_kt(const typename Elem<DT>::T* k, int64_t rs, int n, int d,
                                     float* kt) {
    generic_load_kt<DT>(k, rs, n, d, kt);
  }
  template <AttnDType DT>
  SD_TARGET_AVX2 static void load_rows(const typename Elem<DT>::T* src, int64_t rs, int n, int d,
                                       float mult, float* dst) {
    generic_load_rows<DT>(src, rs, n, d, mult, dst);
  }
  SD_TARGET_AVX2 static void scores(const float* q, int rows, int d, const float* kt, float* s) {
    generic_scores(q, rows, d, kt, s);
  }
  SD_TARGET_AVX2 static float softmax_row(float* s, uint64_t visible, SoftmaxState* state) {
    return generic_softmax_row(s, visible, state);
  }
  SD_TARGET_AVX2 static void pv(const float* p, int rows, int n, const float* vb, int d,
                                const float* alpha, float* o) {
    generic_pv(p, rows, n, vb, d, alpha, o);
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
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);                  // ln2^7 / 7!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

template <int RB>
SD_TARGET_AVX512 SD_FORCE_INLINE void scores_tile(const float* q, int d, const float* kt,
                                                  float* s) {
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < d; ++i) {
    const float* krow = kt + i * kBlock;
    const __m512 k0 = _mm512_load_ps(krow), k1 = _mm512_load_ps(krow + 16);
    const __m512 k2 = _mm512_load_ps(krow + 32), k3 = _mm512_load_ps(krow + 48);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + i]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 4; ++c) _mm512_store_ps(s + r * kBlock + 16 * c, acc[r][c]);
  }
}

// o[r][c0 .. c0 + 16 CV) = alpha[r] * o + sum_j p[r][j] v[j] for RB rows.
template <int RB, int CV>
SD_TARGET_AVX512 SD_FORCE_INLINE void pv_tile(const float* p, int n, const float* vb, int d,
                                              const float* alpha, float* o) {
  __m512 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + 16 * c));
  }
  for (int j = 0; j < n; ++j) {
    __m512 v[CV];
    for (int c = 0; c < CV; ++c) v[c] = _mm512_loadu_ps(vb + j * d + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlock + j]);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_fmadd_ps(pj, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
  }
}

template <int RB>
SD_TARGET_AVX512 SD_FORCE_INLINE void pv_rows(const float* p, int n, const float* vb, int d,
                                              const float* alpha, float* o) {
  int c = 0;
  for (; c + 64 <= d; c += 64) pv_tile<RB, 4>(p, n, vb + c, d, alpha, o + c);
  // Head dims are multiples of 16: at most 3 vectors remain.
  switch ((d - c) / 16) {
    case 1:
      pv_tile<RB, 1>(p, n, vb + c, d, alpha, o + c);
      break;
    case 2:
      pv_tile<RB, 2>(p, n, vb + c, d, alpha, o + c);
      break;
    case 3:
      pv_tile<RB, 3>(p, n, vb + c, d, alpha, o + c);
      break;
    default:
      break;
  }
}

struct Avx512Kernels {
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
  SD_TARGET_AVX512 static void scores(const float* q, int rows, int d, const float* kt, float* s) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) scores_tile<4>(q + r * d, d, kt, s + r * kBlock);
    switch (rows - r) {
      case 1:
        scores_tile<1>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 2:
        scores_tile<2>(q + r * d, d, kt, s + r * kBlock);
        break;
      case 3:
        scores_tile<3>(q + r * d, d, kt, s + r * kBlock);
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
  SD_TARGET_AVX512 static void pv(const float* p, int rows, int n, const float* vb, int d,
                                  const float* alpha, float* o) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) pv_rows<4>(p + r * kBlock, n, vb, d, alpha + r, o + r * d);
    switch (rows - r) {
      case 1:
        pv_rows<1>(p + r * kBlock, n, vb, d, alpha + r, o + r * d);
        break;
      case 2:
        pv_rows<2>(p + r * kBlock, n, vb, d, alpha + r, o + r * d);
        break;
      case 3:
        pv_rows<3>(p + r * kBlock, n, vb, d, alpha + r, o + r * d);
        break;
      default:
        break;
    }
  }
};
#endif  // SD_X86

// ---- ISA selection -------------------------------------------------------------------------

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa() {
#ifdef SD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
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
  SoftmaxState *st_prefix, *st_tree;
  std::vector<SoftmaxState> states;

  void reserve(int64_t rows, int64_t d) {
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    const int64_t need =
        3 * up(rows * d) + kBlock * up(d) + kBlock * up(d) + kRowTile * kBlock + up(rows) + 16;
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
    states.resize(2 * rows);
    st_prefix = states.data();
    st_tree = states.data() + rows;
  }
};

Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

// Visible keys of a block: bit j set when key j0 + j (< j0 + n) may be attended to.
inline uint64_t block_visibility(const uint32_t* mask_row, int query, int j0, int n, bool tree) {
  if (!tree) return n >= 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1);
  uint64_t bits = 0;
  for (int j = 0; j < n; ++j) {
    if (tree_key_visible(mask_row, query, j0 + j)) bits |= uint64_t{1} << j;
  }
  return bits;
}

struct Shape {
  int64_t t;       // tree nodes T
  int64_t g;       // query heads per KV head
  int64_t d;       // head dim
  int64_t rows;    // query rows per KV head, T * g
  int64_t words;   // mask words per row
  int64_t heads;   // KV heads per work item
  int64_t splits;  // prefix splits per (sequence, head group)
  int64_t split_keys;
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
  for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, end - j0));
    // Ask for the next block early so its lines are in flight while this one computes.
    const int64_t next_n = std::min<int64_t>(kBlock, end - j0 - n);
    for (int64_t j = 0; j < next_n; ++j) {
      for (int64_t head = 0; head < sh.heads; ++head) {
        const char* kr = reinterpret_cast<const char*>(k + (j0 + n + j) * rs + head * hs);
        const char* vr = reinterpret_cast<const char*>(v + (j0 + n + j) * rs + head * hs);
        for (int64_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(kr + off);
          __builtin_prefetch(vr + off);
        }
      }
    }
    for (int64_t head = 0; head < sh.heads; ++head) {
      K::template load_kt<DT>(k + j0 * rs + head * hs, rs, n, d, ws.kt);
      K::template load_rows<DT>(v + j0 * rs + head * hs, rs, n, d, 1.0f, ws.vb);
      const int64_t base = head * sh.rows;
      for (int r0 = 0; r0 < rows; r0 += kRowTile) {
        const int rb = std::min(kRowTile, rows - r0);
        K::scores(ws.q + (base + r0) * sh.d, rb, d, ws.kt, ws.s);
        for (int i = 0; i < rb; ++i) {
          const int t = (r0 + i) / static_cast<int>(sh.g);
          const uint32_t* mrow = mask_b ? mask_b + t * sh.words : nullptr;
          const uint64_t vis = block_visibility(mrow, t, static_cast<int>(j0 - begin), n, tree);
          ws.alpha[i] = K::softmax_row(ws.s + i * kBlock, vis, &st[base + r0 + i]);
        }
        K::pv(ws.s, rb, n, ws.vb, d, ws.alpha, o + (base + r0) * sh.d);
      }
    }
  }
}

// One work item: KV heads kvh0 .. kvh0 + sh.heads of sequence b over prefix keys [begin, end),
// plus the tree part when with_tree. Hands each row's finished (o, lse2) to `emit`.
template <class K, AttnDType DT, class Emit>
void run_item(const AttentionArgs& a, const Shape& sh, int64_t b, int64_t kvh0, int64_t begin,
              int64_t end, bool with_tree, Emit&& emit) {
  using T = typename Elem<DT>::T;
  Workspace& ws = thread_workspace();
  const int64_t rows = sh.heads * sh.rows;
  ws.reserve(rows, sh.d);
  const int d = static_cast<int>(sh.d);
  const T* q = static_cast<const T*>(a.q);
  const float mult = a.scale * kLog2e;
  for (int64_t rr = 0; rr < rows; ++rr) {
    const RowIndex ri = row_index(sh, kvh0, rr);
    const T* src = q + b * a.q_strides[0] + ri.t * a.q_strides[1] + ri.h * a.q_strides[2];
    K::template load_rows<DT>(src, 0, 1, d, mult, ws.q + rr * sh.d);
  }
  const T* k = static_cast<const T*>(a.k) + b * a.kv_strides[0] + kvh0 * a.kv_strides[2];
  const T* v = static_cast<const T*>(a.v) + b * a.kv_strides[0] + kvh0 * a.kv_strides[2];
  attend_range<K, DT>(a, sh, k, v, begin, end, false, nullptr, ws, ws.o_prefix, ws.st_prefix);
  if (with_tree) {
    const int64_t prefix = a.prefix_lens[b];
    const uint32_t* mask_b = a.mask ? a.mask + b * sh.t * sh.words : nullptr;
    const int64_t rs = a.kv_strides[1];
    attend_range<K, DT>(a, sh, k + prefix * rs, v + prefix * rs, 0, sh.t, true, mask_b, ws,
                        ws.o_tree, ws.st_tree);
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
// prefix is split finely for parallelism. Many rows are compute bound: one KV head per item and
// long splits, which keep the merge scratch small.
Shape make_shape(const AttentionArgs& a) {
  Shape sh;
  sh.t = a.tree_len;
  sh.g = a.q_heads / a.kv_heads;
  sh.d = a.head_dim;
  sh.rows = sh.t * sh.g;
  sh.words = mask_words(static_cast<int>(sh.t));
  const bool grouped = sh.rows * a.kv_heads <= 128;
  sh.heads = grouped ? a.kv_heads : 1;
  sh.split_keys = grouped ? 512 : 2048;
  sh.splits = 1;
  return sh;
}

template <class K, AttnDType DT>
void run(const AttentionArgs& a) {
  Shape sh = make_shape(a);
  const int64_t batch = a.batch;
  const int64_t groups = a.kv_heads / sh.heads;

  int64_t max_prefix = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = a.prefix_lens[b];
    const bool ok = p >= 0 && p + sh.t <= a.cache_len;
    a.status[b] = ok ? 0 : 1;
    if (ok) max_prefix = std::max(max_prefix, p);
  }
  // Every sequence uses the same number of splits so work items index simply; a sequence with a
  // shorter prefix gets empty leading splits, which merge as the identity.
  const int64_t splits = std::max<int64_t>(1, (max_prefix + sh.split_keys - 1) / sh.split_keys);
  sh.splits = splits;
  const int64_t items = batch * groups * splits;
  const int64_t item_rows = sh.heads * sh.rows;
  const int64_t part_stride = item_rows * (sh.d + 1);

  std::vector<float> scratch;
  if (splits > 1) scratch.resize(static_cast<size_t>(items * part_stride));

  parallel_for(items, 1, [&](int64_t begin, int64_t end) {
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
      const int64_t first = prefix - (splits - s) * sh.split_keys;
      const int64_t kb = std::max<int64_t>(0, first);
      const int64_t ke = std::max<int64_t>(0, first + sh.split_keys);
      const bool last = s == splits - 1;
      if (splits == 1) {
        run_item<K, DT>(a, sh, b, kvh0, 0, prefix, true,
                        [&](int64_t rr, const float* o, float lse) {
                          write_row<DT>(a, sh, b, row_index(sh, kvh0, rr), o, lse);
                        });
      } else {
        float* part = scratch.data() + item * part_stride;
        run_item<K, DT>(a, sh, b, kvh0, kb, std::min(ke, prefix), last,
                        [&](int64_t rr, const float* o, float lse) {
                          std::memcpy(part + rr * (sh.d + 1), o, sh.d * sizeof(float));
                          part[rr * (sh.d + 1) + sh.d] = lse;
                        });
      }
    }
  });
  if (splits == 1) return;

  // Merge the splits of every row in split order (deterministic).
  parallel_for(batch * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(sh.d);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / groups, kvh0 = (bg % groups) * sh.heads;
      if (a.status[b] != 0) continue;
      for (int64_t rr = 0; rr < item_rows; ++rr) {
        float lse = -INFINITY;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < splits; ++s) {
          const float* part = scratch.data() + (bg * splits + s) * part_stride + rr * (sh.d + 1);
          float wa, wb;
          lse = lse_merge_weights(lse, part[sh.d], &wa, &wb);
          if (wb == 0.0f) continue;
          for (int64_t i = 0; i < sh.d; ++i) acc[i] = wa * acc[i] + wb * part[i];
        }
        write_row<DT>(a, sh, b, row_index(sh, kvh0, rr), acc.data(), lse);
      }
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
