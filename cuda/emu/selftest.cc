// The emulator's self-test kernels (selftest.h), written as CUDA and built against the emulator.
#include "selftest.h"

#include <cuda_runtime_api.h>

#include <stdexcept>

#include "launch.cuh"
#include "mma.cuh"
#include "runtime.cuh"

namespace sd {
namespace emu {
namespace {

constexpr int kShuffleCases = 8;

__global__ void shuffles_kernel(int32_t* out) {
  const int lane = static_cast<int>(threadIdx.x);
  const int32_t v = 100 + lane;
  int32_t r[kShuffleCases];
  r[0] = __shfl_sync(0xffffffffu, v, 5);         // every lane reads lane 5
  r[1] = __shfl_sync(0xffffffffu, v, lane + 1);  // lane 31 wraps to lane 0
  r[2] = __shfl_sync(0xffffffffu, v, 3, 8);      // lane 3 of each group of 8
  r[3] = __shfl_xor_sync(0xffffffffu, v, 1);     // pairs swap
  r[4] = __shfl_xor_sync(0xffffffffu, v, 8, 8);  // a later group: the own value
  r[5] = __shfl_up_sync(0xffffffffu, v, 2);      // lanes 0, 1: own value
  r[6] = __shfl_down_sync(0xffffffffu, v, 3, 16);
  // Only the 8 lanes of each group take part: a group's mask, as the verify kernels use it.
  const unsigned group = 0xffu << (lane & 24);
  r[7] = __shfl_sync(group, v, 7, 8);
  for (int k = 0; k < kShuffleCases; ++k) out[k * 32 + lane] = r[k];
}

__global__ void neighbour_kernel(float* out, int threads, bool with_barrier) {
  SD_DYNAMIC_SHARED(float, shared);
  const int t = static_cast<int>(threadIdx.x);
  shared[t] = static_cast<float>(t);
  if (with_barrier) __syncthreads();
  out[t] = shared[(t + 1) % threads];
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x < 16) return;
  __syncthreads();
}

__global__ void exited_lane_kernel(int32_t* out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<int32_t>(threadIdx.x), 1);
}

__global__ void foreign_mask_kernel(int32_t* out) {
  // Lanes 0-15 name only their half, but read lane 20.
  const unsigned half = threadIdx.x < 16 ? 0xffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_sync(half, static_cast<int32_t>(threadIdx.x), 20);
}

__global__ void shared_memory_kernel(float* out) {
  SD_DYNAMIC_SHARED(float, shared);
  shared[threadIdx.x] = 1.0f;
  out[threadIdx.x] = shared[threadIdx.x];
}

__global__ void static_shared_kernel(float* out) {
  SD_SHARED(float, x);
  out[blockIdx.x] = x;
  x = 1.0f + static_cast<float>(blockIdx.x);
}

__global__ void shared_overflow_kernel(int floats) {
  SD_DYNAMIC_SHARED(float, shared);
  shared[floats] = 1.0f;
}

template <bool kBF16>
__global__ void mma_kernel(const uint16_t* a, const uint16_t* b, float* d) {
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  const uint32_t af[4] = {
      cuda::pack_halves(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
      cuda::pack_halves(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
      cuda::pack_halves(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
      cuda::pack_halves(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9])};
  const uint32_t bf[2] = {cuda::pack_halves(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                          cuda::pack_halves(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  cuda::mma_m16n8k16<kBF16>(c, af, bf);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = c[i];
}

// The rows of m [16, 16] in shared memory 24 elements apart (padded, as the attention kernel's
// tiles are); lane l addresses row l % 8 + 8 ((l / 8) % 2), column 8 (l / 16): matrix i is the
// quadrant (rows 8 (i % 2), columns 8 (i / 2)). out [32, 4]: each lane's four registers.
template <bool kTrans>
__global__ void ldmatrix_kernel(const uint16_t* m, uint32_t* out) {
  constexpr int kPitch = 24;
  SD_DYNAMIC_SHARED(uint16_t, tile);
  const int lane = static_cast<int>(threadIdx.x);
  for (int e = lane; e < 16 * 16; e += 32) tile[e / 16 * kPitch + e % 16] = m[e];
  __syncwarp();
  uint32_t r[4];
  cuda::ldmatrix_x4<kTrans>(r, tile + (lane % 8 + 8 * (lane / 8 % 2)) * kPitch + 8 * (lane / 16));
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

__global__ void partial_warp_mma_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  const uint32_t a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  cuda::mma_m16n8k16<true>(c, a, b);
  out[threadIdx.x] = c[0];
}

std::string launch_message(cudaError_t err) {
  return err == cudaSuccess ? std::string() : cuda::error_string(err);
}

}  // namespace

int selftest_shuffles(int32_t* out) {
  SD_LAUNCH(1, 32, 0, nullptr, shuffles_kernel)(out);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(launch_message(err));
  return kShuffleCases;
}

std::string selftest_neighbour(float* out, int threads, bool with_barrier) {
  SD_LAUNCH(1, threads, threads * sizeof(float), nullptr, neighbour_kernel)(out, threads,
                                                                            with_barrier);
  return launch_message(cudaGetLastError());
}

std::string selftest_static_shared(float* out) {
  SD_LAUNCH(2, 1, 0, nullptr, static_shared_kernel)(out);
  return launch_message(cudaGetLastError());
}

std::string selftest_shared_overflow() {
  constexpr int kFloats = 16;
  SD_LAUNCH(1, 1, kFloats * sizeof(float), nullptr, shared_overflow_kernel)(kFloats);
  return launch_message(cudaGetLastError());
}

std::string selftest_mma(const uint16_t* a, const uint16_t* b, bool bf16, float* d) {
  if (bf16) {
    SD_LAUNCH(1, 32, 0, nullptr, mma_kernel<true>)(a, b, d);
  } else {
    SD_LAUNCH(1, 32, 0, nullptr, mma_kernel<false>)(a, b, d);
  }
  return launch_message(cudaGetLastError());
}

std::string selftest_ldmatrix(const uint16_t* m, bool trans, uint32_t* out) {
  constexpr size_t kBytes = 16 * 24 * sizeof(uint16_t);
  if (trans) {
    SD_LAUNCH(1, 32, kBytes, nullptr, ldmatrix_kernel<true>)(m, out);
  } else {
    SD_LAUNCH(1, 32, kBytes, nullptr, ldmatrix_kernel<false>)(m, out);
  }
  return launch_message(cudaGetLastError());
}

std::string selftest_rule(const std::string& rule) {
  int32_t ints[64] = {};
  float floats[64] = {};
  if (rule == "divergent_barrier") {
    SD_LAUNCH(1, 64, 0, nullptr, divergent_barrier_kernel)();
  } else if (rule == "exited_lane") {
    SD_LAUNCH(1, 32, 0, nullptr, exited_lane_kernel)(ints);
  } else if (rule == "foreign_mask") {
    SD_LAUNCH(1, 32, 0, nullptr, foreign_mask_kernel)(ints);
  } else if (rule == "shared_memory" || rule == "shared_memory_allowed") {
    constexpr int kBytes = 64 * 1024;  // over the default 48 KiB
    // The attribute stays set for the kernel: each call sets it (back to the default first).
    const int allow = rule == "shared_memory_allowed" ? kBytes : 48 * 1024;
    const cudaError_t err = cudaFuncSetAttribute(
        shared_memory_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, allow);
    if (err != cudaSuccess) return launch_message(err);
    SD_LAUNCH(1, 64, kBytes, nullptr, shared_memory_kernel)(floats);
  } else if (rule == "partial_warp_mma") {
    SD_LAUNCH(1, 32, 0, nullptr, partial_warp_mma_kernel)(floats);
  } else if (rule == "block_size") {
    SD_LAUNCH(1, 2048, 0, nullptr, divergent_barrier_kernel)();
  } else {
    throw std::invalid_argument("unknown rule: " + rule);
  }
  return launch_message(cudaGetLastError());
}

}  // namespace emu
}  // namespace sd
