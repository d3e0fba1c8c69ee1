// Kernel launches and shared memory, written once for nvcc and for the CUDA emulator
// (cuda/emu/cuda_runtime_api.h), which compiles these sources with the host compiler:
//   SD_LAUNCH(grid, block, smem, stream, kernel)(args...)   kernel<<<grid, block, smem, stream>>>
//   SD_DYNAMIC_SHARED(float, smem);                           extern __shared__ float smem[];
//   SD_SHARED(Type, name);                                    __shared__ Type name;
// (an array type goes through an alias: using Row = int32_t[64]; SD_SHARED(Row, row);)
#pragma once

#include <cuda_runtime_api.h>

#if defined(SPECDECODE_CUDA_EMULATED_RUNTIME)
#define SD_LAUNCH(grid, block, smem, stream, ...) \
  ::sd::emu::launch(grid, block, smem, stream, __VA_ARGS__)
#define SD_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::sd::emu::dynamic_shared())
#define SD_SHARED(type, name) type& name = ::sd::emu::block_shared<type, __COUNTER__>()
#else
#define SD_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define SD_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define SD_SHARED(type, name) __shared__ type name
#endif
