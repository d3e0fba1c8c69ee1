#include <cstdint>

#include "halves.cuh"
#include "launch.cuh"
#include "specdecode/host_device.h"

namespace sd {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void halves_to_float_kernel(const uint16_t* in, float* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) out[i] = half_to_float(in[i]);
}

__global__ void floats_to_half_kernel(const float* in, uint16_t* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) out[i] = float_to_half(in[i]);
}

}  // namespace

cudaError_t convert_halves(const void* in, void* out, int64_t n, bool to_float,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads));
  if (to_float) {
    SD_LAUNCH(grid, kThreads, 0, stream, halves_to_float_kernel)
    (static_cast<const uint16_t*>(in), static_cast<float*>(out), n);
  } else {
    SD_LAUNCH(grid, kThreads, 0, stream, floats_to_half_kernel)
    (static_cast<const float*>(in), static_cast<uint16_t*>(out), n);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace sd
