// Switching the calling thread's current device for one op and giving the caller's back
// (runtime.cuh). Shared by the CUDA build and the CUDA emulator, which checks this logic on
// emulated devices; only has_primary_context differs (a driver query, runtime.cu).
#include <cuda_runtime_api.h>

#include <string>

#include "runtime.cuh"

namespace sd {
namespace cuda {

bool enter_device(int index, int* previous, std::string* error) {
  *previous = -1;
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current == index) return true;
  if (err == cudaSuccess) err = cudaSetDevice(index);
  if (err != cudaSuccess) {
    cudaGetLastError();  // reported by the caller's exception, not by its next CUDA check
    *error = cudaGetErrorString(err);
    return false;
  }
  *previous = current;
  return true;
}

void leave_device(int previous) {
  if (previous < 0 || !has_primary_context(previous)) return;
  if (cudaSetDevice(previous) != cudaSuccess) cudaGetLastError();
}

}  // namespace cuda
}  // namespace sd
