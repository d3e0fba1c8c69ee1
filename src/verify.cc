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
// around them stays baseline code and calls into these methods.
#pragma GCC push_options
#pragma GCC target("avx2")
#define SD_CPU_EXEC CpuExecAvx2
#include "verify_cpu_exec.inc"
#undef SD_CPU_EXEC
#pragma GCC pop_options

// ---- AVX-512 ---------------------------------------------------------------------------------
// The three loops that read whole rows on every visited node (the scan, the target weights with
// their chunk sums, the first residual with its chunk sums) written with AVX-512 intrinsics for
// float32 and bfloat16 rows; every other functor and element type runs the generic loops
// compiled for AVX-512. Each intrinsic loop performs exactly the operations of the shared
// SD_HOST_DEVICE definition it replaces (verify::exp_approx, RowWeight, FirstResidualWeight,
// verify::chunk_sum), element by element and in the same order: IEEE single-precision
// mul/add/sub/compare with no FMA, so the results are bit-identical to the generic path and to the
// CUDA kernel. Only the order-free parts differ (the max is exact in any order; the argmax is the
// first index equal to the max).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2")
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

// verify::exp_approx, operation for operation.
inline __m512 exp16(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(-87.0f), _CMP_GT_OQ);  // !tiny (NaN: tiny)
  // x < 88 ? x : 88 is MINPS(x, 88) exactly; tiny lanes become 0.
  x = _mm512_maskz_mov_ps(keep, _mm512_min_ps(x, set1(88.0f)));
  const __m512 magic = set1(12582912.0f);
  const __m512 n =
      _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)), magic), magic);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, set1(0.693145751953125f))),
                                 _mm512_mul_ps(n, set1(1.428606765330187e-06f)));
  __m512 p = set1(1.0f / 5040.0f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f / 720.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f / 120.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f / 24.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f / 6.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), set1(1.0f));
  // n is integral and in [-126, 127]: truncation is the exact conversion.
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, scale));
}

// verify::RowWeight<T>::operator() on 16 raw values.
// The parameters are copied into registers once (the functor itself sits in memory that the
// loops' stores could alias, which would force a reload per vector).
template <class T>
struct Weight16 {
  __m512 inv_temp, scaled_max, kth, wmin;
  explicit Weight16(const verify::RowWeight<T>& f)
      : inv_temp(set1(f.inv_temp)),
        scaled_max(set1(f.scaled_max)),
        kth(set1(f.kth)),
        wmin(set1(f.wmin)) {}
  __m512 operator()(__m512 raw) const {
    __m512 w;
    if constexpr (verify::IsProb<T>::value) {
      w = raw;
    } else {
      w = exp16(_mm512_sub_ps(_mm512_mul_ps(raw, inv_temp), scaled_max));
    }
    w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(raw, kth, _CMP_GE_OQ), w);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, wmin, _CMP_GE_OQ), w);
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
static_assert(verify::kChunk % 16 == 0, "a chunk is a whole number of 16-lane vectors");

// Canonical sums of the full chunks [0, full) of a weight given per vector by w16(i) (i the first
// of 16 indices), in memory order: the row streams in sequentially, which the hardware prefetcher
// follows (interleaving several chunks' addresses defeated it and halved the read bandwidth).
// Each chunk's additions are one dependent chain in the canonical order; consecutive chunks'
// chains are independent, so the out-of-order core overlaps them.
template <class W16>
inline void full_chunk_sums(int full, float* out, const W16& w16) {
  for (int c = 0; c < full; ++c) {
    const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
    __m256 acc = _mm256_setzero_ps();
    for (int s = 0; s < kVecPerChunk; ++s) acc = add_lanes(acc, w16(begin + s * 16));
    out[c] = combine_lanes(acc);
  }
}

// The same sums for an expensive weight (the exp of logits), whose computation is long enough
// that one chunk's add chain no longer overlaps the next chunk's: the weights of four chunks are
// computed in memory order and stored to `w` (the row's weight cache), then summed from L1 with
// the four chunks' chains interleaved.
template <class W16>
inline void full_chunk_sums_stored(int full, float* out, float* w, const W16& w16) {
  int c = 0;
  for (; c + 4 <= full; c += 4) {
    const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
    for (int64_t i = begin; i < begin + 4 * verify::kChunk; i += 16) {
      _mm512_storeu_ps(w + i, w16(i));
    }
    __m256 acc[4];
    for (int g = 0; g < 4; ++g) acc[g] = _mm256_setzero_ps();
    for (int s = 0; s < kVecPerChunk; ++s) {
      for (int g = 0; g < 4; ++g) {
        acc[g] = add_lanes(acc[g], _mm512_loadu_ps(w + begin + g * verify::kChunk + s * 16));
      }
    }
    for (int g = 0; g < 4; ++g) out[c + g] = combine_lanes(acc[g]);
  }
  for (; c < full; ++c) {
    const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
    __m256 acc = _mm256_setzero_ps();
    for (int s = 0; s < kVecPerChunk; ++s) {
      const __m512 wv = w16(begin + s * 16);
      _mm512_storeu_ps(w + begin + s * 16, wv);
      acc = add_lanes(acc, wv);
    }
    out[c] = combine_lanes(acc);
  }
}

}  // namespace v512

class CpuExecAvx512 : public CpuExecAvx512Generic {
 public:
  using CpuExecAvx512Generic::chunk_sums;
  using CpuExecAvx512Generic::scan;

  // The scan of a target row: max over 4 x 16 lanes (exact in any order), the bad flag, then
  // the first index equal to the max (the argmax the generic loop and the GPU return).
  template <class T>
  ScanResult scan(int64_t n, const verify::RowLoad<T>& load, const verify::BadTarget& bad) {
    if constexpr (!v512::kFast<T>) {
      return CpuExecAvx512Generic::scan(n, load, bad);
    } else {
      const auto* row = v512::elems(load.row);
      const bool logits = bad.logits;
      const __m512 ninf = v512::set1(-verify::kInf);
      __m512 m[4] = {ninf, ninf, ninf, ninf};
      __mmask16 flag = 0;
      const auto is_bad = [&](__m512 v) -> __mmask16 {
        if (logits) {
          return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) |
                 _mm512_cmp_ps_mask(v, v512::set1(verify::kInf), _CMP_EQ_OQ);
        }
        return static_cast<__mmask16>(
            ~(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ) &
              _mm512_cmp_ps_mask(v, v512::set1(verify::kFloatMax), _CMP_LE_OQ)));
      };
      int64_t i = 0;
      if constexpr (verify::IsProb<T>::value) {
        // The weights of a probability row without top-k / top-p are its values (kth = -inf,
        // wmin = 0), known before the scan: their canonical chunk sums are taken in this same
        // pass, while the data is in registers, and handed to the chunk_sums call of
        // prepare_row that follows (which would otherwise read the row a second time).
        const verify::RowWeight<T> plain{load.row, 1.f, -verify::kInf, 0.f, 0.f};
        const v512::Weight16<T> weight16(plain);
        pending_.resize(static_cast<size_t>(verify::num_chunks(n)));
        float* out = pending_.data();
        const int full = static_cast<int>(n / verify::kChunk);
        v512::full_chunk_sums(full, out, [&](int64_t k) {
          const __m512 v = v512::load16(row, k);
          flag |= is_bad(v);
          m[0] = _mm512_max_ps(v, m[0]);
          return weight16(v);
        });
        i = static_cast<int64_t>(full) * verify::kChunk;
        if (i < n) out[full] = verify::chunk_sum(plain, i, n);
        pending_row_ = load.row;
        pending_n_ = n;
      } else {
        for (; i + 64 <= n; i += 64) {
          for (int g = 0; g < 4; ++g) {
            const __m512 v = v512::load16(row, i + 16 * g);
            flag |= is_bad(v);
            // MAXPS(v, m) = v > m ? v : m, the generic lane update (a NaN v keeps m).
            m[g] = _mm512_max_ps(v, m[g]);
          }
        }
      }
      for (; i < n; i += 16) {
        const int64_t left = n - i;
        const __mmask16 valid =
            left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
        const __m512 v = _mm512_mask_mov_ps(ninf, valid, v512::load16(row, i, valid));
        flag |= is_bad(v) & valid;
        m[0] = _mm512_max_ps(v, m[0]);
      }
      const __m512 all = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
      ScanResult r{_mm512_reduce_max_ps(all), 0, flag != 0};
      const __m512 target = v512::set1(r.max);
      for (int64_t k = 0; k < n; k += 16) {
        const int64_t left = n - k;
        const __mmask16 valid =
            left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
        const __mmask16 eq =
            _mm512_cmp_ps_mask(v512::load16(row, k, valid), target, _CMP_EQ_OQ) & valid;
        if (eq) {
          r.argmax = k + __builtin_ctz(eq);
          break;
        }
      }
      return r;
    }
  }

  // The target weights: computed, stored for a later residual of the same row (logits only: a
  // probability row's weights are cheaper to reload than to cache) and summed canonically in one
  // pass.
  template <class T>
  float chunk_sums(int64_t n, const verify::RowWeight<T>& f, int which) {
    if constexpr (!v512::kFast<T>) {
      return CpuExecAvx512Generic::chunk_sums(n, f, which);
    } else {
      float* out = sums(which);
      const int chunks = verify::num_chunks(n);
      if (verify::IsProb<T>::value && pending_row_ == static_cast<const void*>(f.row) &&
          pending_n_ == n && f.kth == -verify::kInf && same_bits(f.wmin, 0.f)) {
        // Taken by the scan of this row (see scan()).
        for (int c = 0; c < chunks; ++c) out[c] = pending_[c];
        cached_row_ = nullptr;
        return verify::sequential_total(out, chunks);
      }
      const auto* row = v512::elems(f.row);
      constexpr bool cache = !verify::IsProb<T>::value;
      float* w = nullptr;
      if (cache) {
        row_weights_.resize(static_cast<size_t>(n));
        w = row_weights_.data();
      }
      const int full = static_cast<int>(n / verify::kChunk);
      const v512::Weight16<T> weight16(f);
      const auto w16 = [&](int64_t i) { return weight16(v512::load16(row, i)); };
      if (cache) {
        v512::full_chunk_sums_stored(full, out, w, w16);
      } else {
        v512::full_chunk_sums(full, out, w16);
      }
      if (full < chunks) {
        const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
        if (cache) {
          for (int64_t i = begin; i < n; ++i) w[i] = f(i);
          const auto read = [w](int64_t i) { return w[i]; };
          out[full] = verify::chunk_sum(read, begin, n);
        } else {
          out[full] = verify::chunk_sum(f, begin, n);
        }
      }
      if (cache) {
        remember_weights_of(f, n);
      } else {
        cached_row_ = nullptr;
      }
      return verify::sequential_total(out, chunks);
    }
  }

  // The first residual max(p - q, 0): from the cached weights when this row's were just computed,
  // else recomputed from the row; q read once.
  template <class T, class Q>
  float chunk_sums(int64_t n, const verify::FirstResidualWeight<T, Q>& f, int which) {
    if constexpr (!(v512::kFast<T> && v512::kFast<Q>)) {
      return CpuExecAvx512Generic::chunk_sums(n, f, which);
    } else {
      const auto* row = v512::elems(f.weight.row);
      const auto* qrow = v512::elems(f.qrow);
      const bool cached = holds_weights_of(f.weight, n);
      const float* cw = row_weights_.data();
      float* out = sums(which);
      const int full = static_cast<int>(n / verify::kChunk);
      const __m512 inv_total = v512::set1(f.inv_total);
      const v512::Weight16<T> weight16(f.weight);
      if (cached) {
        v512::full_chunk_sums(full, out, [&](int64_t i) {
          return v512::residual16(_mm512_loadu_ps(cw + i), v512::load16(qrow, i), inv_total);
        });
      } else {
        v512::full_chunk_sums(full, out, [&](int64_t i) {
          const __m512 wv = weight16(v512::load16(row, i));
          return v512::residual16(wv, v512::load16(qrow, i), inv_total);
        });
      }
      const int chunks = verify::num_chunks(n);
      if (full < chunks) {
        const int64_t begin = static_cast<int64_t>(full) * verify::kChunk;
        if (cached) {
          const auto rest = [&](int64_t i) { return f.from_weight(cw[i], i); };
          out[full] = verify::chunk_sum(rest, begin, n);
        } else {
          out[full] = verify::chunk_sum(f, begin, n);
        }
      }
      return verify::sequential_total(out, chunks);
    }
  }

  void reset(int64_t vocab) {
    CpuExecAvx512Generic::reset(vocab);
    pending_row_ = nullptr;
    pending_n_ = 0;
  }

 private:
  // Chunk sums of a probability row's plain weights taken by its scan, keyed by row and length.
  std::vector<float> pending_;
  const void* pending_row_ = nullptr;
  int64_t pending_n_ = 0;
};
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
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512 && cap != "avx2") return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
    return Isa::kBaseline;
  }();
  return isa;
}

template <class Ex, class T, class Q>
void run_range(const verify::VerifyArgs& args, int64_t begin, int64_t end) {
  // One executor per thread and ISA, reused across calls: its buffers are row-sized.
  static thread_local Ex ex;
  ex.reset(args.vocab);
  for (int64_t b = begin; b < end; ++b) verify::verify_sequence<Ex, T, Q>(ex, args, b);
}

template <class T, class Q>
void run(const verify::VerifyArgs& args) {
  // A row costs a few passes over V; small vocabularies (statistical tests) batch many rows.
  const int64_t per_row = std::max<int64_t>(1, args.vocab * args.n);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_row);
  const Isa isa = cpu_isa();
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
#ifdef SD_VERIFY_HAVE_AVX2
    if (isa == Isa::kAvx512) return run_range<CpuExecAvx512, T, Q>(args, begin, end);
    if (isa == Isa::kAvx2) return run_range<CpuExecAvx2, T, Q>(args, begin, end);
#endif
    run_range<CpuExec, T, Q>(args, begin, end);
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
