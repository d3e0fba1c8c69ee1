// A standalone probe of the AVX2 streaming path's two products at T = 1 (4 query rows per KV
// head at GQA 4, D = 128, bf16 keys and values; src/attention.cc): how close each comes to the
// core's FMA rate, and whether other register tilings get closer.
//   peak      independent FMA chains: the core's FMA rate (2 per cycle), hence its clock;
//   scores    widen: stream_key_rows8 (each key piece loaded once for the 4 rows, two chains per
//             row); pair: two keys per pass, each query piece loaded once for both keys;
//   P V       4x2: pv_tile8<4, 2> (4 rows x 16 columns in registers over a block of 16 keys);
//             4x3: 4 rows x 24 columns (fewer loads per FMA); 2x6: 2 rows x 48 columns.
// Keys / values [keys, 8 KV heads, 128] bf16 (--keys, default 256: 512 KiB each, in L2; 16:
// in L1). One thread. Times are per key and KV head; 64 FMAs (each product) take 32 cycles.
//
// Build and run (bench/RESULTS.md, tree_attention, session 23):
//   g++ -O3 -mavx2 -mfma -std=c++17 bench/probes/stream_tiles_probe.cc -o /tmp/stream_tiles_probe
//   /tmp/stream_tiles_probe [--keys N]
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kDim = 128;   // head dim
constexpr int kHeads = 8;   // KV heads
constexpr int kRows = 4;    // query rows per KV head
constexpr int kBlock = 16;  // keys per streaming block (and partial-sum slots)

inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Ten independent chains: more than the 4-cycle latency times 2 pipes needs.
double fma_rate() {
  volatile float seed = 1.0f;
  __m256 a[10];
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(seed + static_cast<float>(i));
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  const long n = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    for (int k = 0; k < 10; ++k) a[k] = _mm256_fmadd_ps(a[k], m, c);
  }
  const double s = seconds_since(t0);
  float sink[8];
  __m256 t = a[0];
  for (int k = 1; k < 10; ++k) t = _mm256_add_ps(t, a[k]);
  _mm256_storeu_ps(sink, t);
  if (sink[0] == 42.0f) std::puts("");
  return static_cast<double>(n) * 10 / s;
}

// Two FMA chains per row over 8-element pieces, as stream_key_rows8.
inline void scores_widen(const float* q, const uint16_t* key, float* out) {
  __m256 a0[kRows], a1[kRows];
  for (int r = 0; r < kRows; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int c = 0; c < kDim / 8; c += 2) {
    const __m256 k0 = widen8(key + 8 * c);
    const __m256 k1 = widen8(key + 8 * c + 8);
    for (int r = 0; r < kRows; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kDim + 8 * c), k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kDim + 8 * c + 8), k1, a1[r]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    _mm256_store_ps(out + r * kBlock * 8, _mm256_add_ps(a0[r], a1[r]));
}

// Two keys per pass: 4 query loads and 2 key loads per 8 FMAs (widen: 8 + 2 per 8); one chain
// per row and key.
inline void scores_pair(const float* q, const uint16_t* key0, const uint16_t* key1, float* out) {
  __m256 a0[kRows], a1[kRows];
  for (int r = 0; r < kRows; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int c = 0; c < kDim / 8; ++c) {
    const __m256 k0 = widen8(key0 + 8 * c);
    const __m256 k1 = widen8(key1 + 8 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * kDim + 8 * c);
      a0[r] = _mm256_fmadd_ps(qv, k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(qv, k1, a1[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_store_ps(out + r * kBlock * 8, a0[r]);
    _mm256_store_ps(out + r * kBlock * 8 + 8, a1[r]);
  }
}

template <bool kPair>
__attribute__((noinline)) void scores_sweep(const float* q, const uint16_t* k, int keys,
                                            float* part) {
  constexpr int kStep = kPair ? 2 : 1;
  for (int j = 0; j < keys; j += kStep) {
    for (int h = 0; h < kHeads; ++h) {
      const uint16_t* key = k + (static_cast<size_t>(j) * kHeads + h) * kDim;
      float* out = part + (h * kRows * kBlock + j % kBlock) * 8;
      if constexpr (kPair) {
        scores_pair(q + h * kRows * kDim, key, key + kHeads * kDim, out);
      } else {
        scores_widen(q + h * kRows * kDim, key, out);
      }
    }
  }
}

// o[r][0, 8 CV) = alpha[r] o + sum_j p[r][j] v[j] for RB rows, as pv_tile8.
template <int RB, int CV>
inline void pv_tile(const float* p, const uint16_t* vb, int64_t vs, const float* alpha, float* o) {
  __m256 acc[RB][CV];
  for (int r = 0; r < RB; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    for (int c = 0; c < CV; ++c)
      acc[r][c] = _mm256_mul_ps(a, _mm256_loadu_ps(o + r * kDim + 8 * c));
  }
  for (int j = 0; j < kBlock; ++j) {
    __m256 v[CV];
    for (int c = 0; c < CV; ++c) v[c] = widen8(vb + j * vs + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kBlock + j);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_fmadd_ps(pj, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(o + r * kDim + 8 * c, acc[r][c]);
  }
}

// Tiling 0: 4x2; 1: 4x3 (then 4x1 for the last 8 columns); 2: 2x6 (then 2x2).
template <int kTiling>
__attribute__((noinline)) void pv_sweep(const float* p, const uint16_t* v, int keys,
                                        const float* alpha, float* o) {
  constexpr int64_t vs = kHeads * kDim;
  for (int j0 = 0; j0 < keys; j0 += kBlock) {
    for (int h = 0; h < kHeads; ++h) {
      const uint16_t* vb = v + (static_cast<size_t>(j0) * kHeads + h) * kDim;
      float* oh = o + h * kRows * kDim;
      const float* ph = p + h * kRows * kBlock;
      if constexpr (kTiling == 0) {
        for (int c = 0; c < kDim; c += 16) pv_tile<4, 2>(ph, vb + c, vs, alpha, oh + c);
      } else if constexpr (kTiling == 1) {
        int c = 0;
        for (; c + 24 <= kDim; c += 24) pv_tile<4, 3>(ph, vb + c, vs, alpha, oh + c);
        for (; c < kDim; c += 8) pv_tile<4, 1>(ph, vb + c, vs, alpha, oh + c);
      } else {
        for (int r = 0; r < kRows; r += 2) {
          const float* pr = ph + r * kBlock;
          float* orow = oh + r * kDim;
          int c = 0;
          for (; c + 48 <= kDim; c += 48) pv_tile<2, 6>(pr, vb + c, vs, alpha + r, orow + c);
          for (; c < kDim; c += 16) pv_tile<2, 2>(pr, vb + c, vs, alpha + r, orow + c);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int keys = 256;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--keys") == 0 && i + 1 < argc) {
      keys = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--keys N]\n", argv[0]);
      return 2;
    }
  }
  if (keys < kBlock || keys % kBlock != 0) {
    std::fprintf(stderr, "--keys: expected a positive multiple of %d\n", kBlock);
    return 2;
  }
  std::vector<uint16_t> k(static_cast<size_t>(keys) * kHeads * kDim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    const float fk = std::sin(0.37f * static_cast<float>(i));
    const float fv = std::cos(0.23f * static_cast<float>(i));
    uint32_t uk, uv;
    std::memcpy(&uk, &fk, sizeof(uk));
    std::memcpy(&uv, &fv, sizeof(uv));
    k[i] = static_cast<uint16_t>(uk >> 16);
    v[i] = static_cast<uint16_t>(uv >> 16);
  }
  alignas(32) static float q[kHeads * kRows * kDim];
  alignas(32) static float part[2][kHeads * kRows * kBlock * 8];
  alignas(32) static float p[kHeads * kRows * kBlock], o[3][kHeads * kRows * kDim];
  const float alpha[kRows] = {1.0f, 1.0f, 1.0f, 1.0f};
  for (int i = 0; i < kHeads * kRows * kDim; ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  for (int i = 0; i < kHeads * kRows * kBlock; ++i) p[i] = 1e-3f * static_cast<float>(i % 7);

  const double rate = fma_rate();
  std::printf("peak: %.2f G FMA/s (%.2f GHz at 2 per cycle); 64 FMAs take %.2f ns\n", rate / 1e9,
              rate / 2e9, 64 / rate * 1e9);
  // Same partial sums either way (each chain's additions differ in order only for pair).
  scores_sweep<false>(q, k.data(), kBlock, part[0]);
  scores_sweep<true>(q, k.data(), kBlock, part[1]);
  constexpr int kRepeats = 200;
  const double per = 1e9 / (static_cast<double>(kRepeats) * keys * kHeads);
  for (int round = 0; round < 4; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < kRepeats; ++it) scores_sweep<false>(q, k.data(), keys, part[0]);
    const double widen = seconds_since(t0) * per;
    t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < kRepeats; ++it) scores_sweep<true>(q, k.data(), keys, part[1]);
    const double pair = seconds_since(t0) * per;
    double tiles[3];
    for (int t = 0; t < 3; ++t) {
      t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < kRepeats; ++it) {
        if (t == 0) pv_sweep<0>(p, v.data(), keys, alpha, o[0]);
        if (t == 1) pv_sweep<1>(p, v.data(), keys, alpha, o[1]);
        if (t == 2) pv_sweep<2>(p, v.data(), keys, alpha, o[2]);
      }
      tiles[t] = seconds_since(t0) * per;
    }
    std::printf(
        "round %d: scores widen %.2f pair %.2f | P V 4x2 %.2f 4x3 %.2f 2x6 %.2f ns per key and "
        "KV head\n",
        round, widen, pair, tiles[0], tiles[1], tiles[2]);
  }
  std::printf("check: o %.4f %.4f %.4f\n", o[0][5], o[1][5], o[2][5]);
  return 0;
}
