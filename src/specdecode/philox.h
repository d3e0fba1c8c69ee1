// Counter-based random numbers shared by the CPU and CUDA backends: Philox4x32-10 (Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
//
// A draw is a pure function of (key, counter), so a random number depends only on what it is for
// (the sequence's seed and offset, the tree node, the purpose and an index) and never on batch
// order, thread count or backend. That is what lets the CPU and the GPU emit identical tokens.
#pragma once

#include <cstdint>

#include "specdecode/host_device.h"

namespace sd {

struct Philox4 {
  uint32_t v[4];
};

SD_HD_INLINE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t prod = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(prod >> 32);
  *lo = static_cast<uint32_t>(prod);
}

// Ten rounds; the key is bumped by the Weyl constants between rounds.
SD_HD_INLINE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                   uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, &hi0, &lo0);
    philox_mulhilo(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// What a random number is used for; part of the counter so that streams never overlap.
enum class RandPurpose : uint32_t {
  kAccept = 1,  // the uniform of an acceptance test of one draft node
  kSample = 2,  // the uniform of the inverse-CDF draw of a correction / bonus token
};

// The draw keyed by (seed, offset, node, purpose, index): key = seed, counter = (index,
// node | purpose << 16, offset). Node indices are < 2^16 (kMaxTreeNodes is 1024).
SD_HD_INLINE Philox4 philox_draw(uint64_t seed, uint64_t offset, uint32_t node, RandPurpose purpose,
                                 uint32_t index) {
  return philox4x32_10(index, (node & 0xffffu) | (static_cast<uint32_t>(purpose) << 16),
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// A uniform float in [0, 1) with 24 random bits; exact in float on both backends.
SD_HD_INLINE float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

}  // namespace sd
