// Kernel launches and dynamic shared memory, written once for nvcc and for the CUDA emulator
// (cuda/emu/cuda_runtime_api.h), which compiles these sources with the host compiler:
//   SD_LAUNCH(grid, block, smem, stream, kernel)(args...)   kernel<<<grid, block, smem, stream>>>
//   SD_DYNAMIC_SHARED(float, smem);                           extern __shared__ float smem[];
#pragma once

#include <cuda_runtime_api.h>

#if defined(SPECDECODE_CUDA_EMULATED_RUNTIME)
#define SD_LAUNCH(grid, block, smem, stream, ...) \
  ::sd::emu::launch(grid, block, smem, stream, __VA_ARGS__)
#define SD_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::sd::emu::dynamic_shared())
#else
#define SD_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define SD_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
