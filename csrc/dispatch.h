// Helpers shared by the bindings for CPU/CUDA dispatch.
#pragma once

#include <cstdint>

#ifdef SPECDECODE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sd {

#ifdef SPECDECODE_WITH_CUDA
// The Python layer passes torch.cuda.current_stream().cuda_stream as an integer.
inline cudaStream_t as_stream(std::intptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}
#endif

}  // namespace sd
