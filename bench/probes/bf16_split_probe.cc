// A standalone probe of the AVX2 streaming scores for bf16 keys (src/attention.cc,
// stream_key_rows8 with 4 rows: T = 1 at GQA 4, D = 128): per key and KV head, 4 query rows dot
// one key row. Two ways to turn the bf16 key into fp32 lanes:
//   widen   8 elements at a time, zero-extended to 32 bits and shifted up (what load8 does);
//   split   16 elements in one 256-bit load, the even ones shifted up, the odd ones masked in
//           place, against query rows stored with each 16-element piece's even elements first.
// The split form saves a load and a shuffle per 16 elements; the probe asks whether that buys
// time. The keys are [keys, 8 KV heads, 128] bf16 (--keys, default 256: 512 KiB, in L2); the
// partial sums land in a scratch array, as in the kernel. One thread.
//
// Build and run (bench/RESULTS.md, tree_attention, session 22):
//   g++ -O3 -mavx2 -mfma -std=c++17 bench/probes/bf16_split_probe.cc -o /tmp/bf16_split_probe
//   /tmp/bf16_split_probe [--keys N]
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
constexpr int kSlots = 16;  // key slots of the partial-sum scratch (a streaming block)

inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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
    _mm256_store_ps(out + r * kSlots * 8, _mm256_add_ps(a0[r], a1[r]));
}

// q_split: each 16-element piece of a row as its 8 even elements, then its 8 odd ones.
inline void scores_split(const float* q_split, const uint16_t* key, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a0[kRows], a1[kRows];
  for (int r = 0; r < kRows; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int c = 0; c < kDim / 16; ++c) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 16 * c));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    for (int r = 0; r < kRows; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q_split + r * kDim + 16 * c), even, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q_split + r * kDim + 16 * c + 8), odd, a1[r]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    _mm256_store_ps(out + r * kSlots * 8, _mm256_add_ps(a0[r], a1[r]));
}

template <bool kSplit>
__attribute__((noinline)) void sweep(const float* q, const uint16_t* k, int keys, float* part) {
  for (int j = 0; j < keys; ++j) {
    for (int h = 0; h < kHeads; ++h) {
      const uint16_t* key = k + (static_cast<size_t>(j) * kHeads + h) * kDim;
      float* out = part + (h * kRows * kSlots + j % kSlots) * 8;
      if constexpr (kSplit) {
        scores_split(q + h * kRows * kDim, key, out);
      } else {
        scores_widen(q + h * kRows * kDim, key, out);
      }
    }
  }
}

float sum8(const float* p) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += p[i];
  return s;
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
  std::vector<uint16_t> k(static_cast<size_t>(keys) * kHeads * kDim);
  for (size_t i = 0; i < k.size(); ++i) {
    const float f = std::sin(0.37f * static_cast<float>(i));
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    k[i] = static_cast<uint16_t>(u >> 16);
  }
  alignas(32) static float q[kHeads * kRows * kDim], q_split[kHeads * kRows * kDim];
  for (int i = 0; i < kHeads * kRows * kDim; ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  for (int r = 0; r < kHeads * kRows; ++r) {
    for (int c = 0; c < kDim / 16; ++c) {
      for (int i = 0; i < 8; ++i) {
        q_split[r * kDim + 16 * c + i] = q[r * kDim + 16 * c + 2 * i];
        q_split[r * kDim + 16 * c + 8 + i] = q[r * kDim + 16 * c + 2 * i + 1];
      }
    }
  }
  alignas(32) static float part[2][kHeads * kRows * kSlots * 8];
  sweep<false>(q, k.data(), 1, part[0]);
  sweep<true>(q_split, k.data(), 1, part[1]);
  std::printf("first score, widen %.6f split %.6f\n", sum8(part[0]), sum8(part[1]));
  constexpr int kRepeats = 200;
  for (int round = 0; round < 4; ++round) {
    for (int split = 0; split < 2; ++split) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < kRepeats; ++it) {
        if (split) {
          sweep<true>(q_split, k.data(), keys, part[1]);
        } else {
          sweep<false>(q, k.data(), keys, part[0]);
        }
      }
      const double ns =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
          (static_cast<double>(kRepeats) * keys * kHeads);
      std::printf("round %d %s: %.2f ns per key and KV head\n", round, split ? "split" : "widen",
                  ns);
    }
  }
  return 0;
}
