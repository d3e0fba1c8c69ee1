#include <cuda_runtime_api.h>

#include "runtime.cuh"

namespace sd {
namespace cuda {

RuntimeInfo query_runtime() {
  RuntimeInfo info{};
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.error = cudaGetErrorString(err);
    if (info.driver_version == 0) info.error = "no NVIDIA driver found (" + info.error + ")";
    cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    info.devices.push_back(DeviceInfo{i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  if (info.devices.empty()) info.error = "no CUDA device found";
  return info;
}

bool set_device(int index, std::string* error) {
  const cudaError_t err = cudaSetDevice(index);
  if (err != cudaSuccess) {
    *error = cudaGetErrorString(err);
    return false;
  }
  return true;
}

std::string error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cuda
}  // namespace sd
