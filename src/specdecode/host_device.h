// Math shared by the CPU core (src/) and the CUDA kernels (cuda/).
//
// Everything in an SD_HOST_DEVICE function is compiled twice: by the host compiler for the CPU
// backend and by nvcc for the GPU. The CPU tests therefore exercise the exact code the GPU runs,
// which is what lets the two backends agree bit for bit on integer results and tokens.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SD_HOST_DEVICE __host__ __device__
#define SD_FORCE_INLINE __forceinline__
#else
#define SD_HOST_DEVICE
#define SD_FORCE_INLINE inline __attribute__((always_inline))
#endif

#define SD_HD_INLINE SD_HOST_DEVICE SD_FORCE_INLINE

namespace sd {

// Padding value for token ids and node indices in ragged batches.
constexpr int32_t kPad = -1;

// Tree limits shared by every op that takes the tree format.
constexpr int kMaxTreeNodes = 1024;
constexpr int kMaskWordBits = 32;

SD_HD_INLINE int mask_words(int num_nodes) {
  return (num_nodes + kMaskWordBits - 1) / kMaskWordBits;
}

// ---- 16-bit floats, bit-exact on host and device -------------------------------------------
// Conversions work on the raw 16-bit patterns so the host needs no half-precision type.

SD_HD_INLINE float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

SD_HD_INLINE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

SD_HD_INLINE float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even, NaN kept quiet.
SD_HD_INLINE uint16_t float_to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The host's conversion, also the device's reference: every bit pattern, NaN payloads kept.
SD_HD_INLINE float half_to_float_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);
  // Subnormal half: normalise into a float.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  return bits_to_float(sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13));
}

// On the device one cvt instruction, exact like the bit code above for every pattern but NaN,
// which takes the bit code's result (the instruction's NaN payload is not specified to match).
// The bit code's branches and subnormal loop cost the CUDA kernels a dozen instructions per
// element, more where a warp's lanes take different branches.
SD_HD_INLINE float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return (h & 0x7fffu) > 0x7c00u ? half_to_float_bits(h) : f;
#else
  return half_to_float_bits(h);
#endif
}

// Round to nearest even, with overflow to inf and gradual underflow.
SD_HD_INLINE uint16_t float_to_half_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // nan
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x33000001u) return static_cast<uint16_t>(sign);             // underflow -> 0
  uint32_t exp = abs >> 23;
  uint32_t mant = abs & 0x7fffffu;
  if (exp < 113u) {  // subnormal half
    mant |= 0x800000u;
    const uint32_t shift = 126u - exp;
    uint32_t half_mant = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
    return static_cast<uint16_t>(sign | half_mant);
  }
  uint32_t h = ((exp - 112u) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

// On the device cvt.rn.f16.f32: the same rounding, overflow and underflow as the bit code above
// (IEEE round to nearest even) in one instruction; NaN takes the bit code's quiet NaN.
SD_HD_INLINE uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return (float_to_bits(f) & 0x7fffffffu) > 0x7f800000u ? float_to_half_bits(f) : h;
#else
  return float_to_half_bits(f);
#endif
}

}  // namespace sd
