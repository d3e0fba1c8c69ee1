#include <cuda.h>
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

namespace {

using PrimaryCtxGetState = CUresult (*)(CUdevice, unsigned int*, int*);

// cuDevicePrimaryCtxGetState through the runtime's driver entry points: the module links the
// static runtime only, not libcuda. Null where this runtime cannot look it up.
PrimaryCtxGetState primary_ctx_get_state() {
  static const PrimaryCtxGetState fn = [] {
    void* p = nullptr;
#if CUDART_VERSION >= 12000
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &p,
                                                             12000, cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &p, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
#endif
    return reinterpret_cast<PrimaryCtxGetState>(p);
  }();
  return fn;
}

}  // namespace

bool has_primary_context(int index) {
  const PrimaryCtxGetState get_state = primary_ctx_get_state();
  unsigned int flags = 0;
  int active = 0;
  // Runtime and driver number the devices alike (both after CUDA_VISIBLE_DEVICES).
  if (get_state == nullptr ||
      get_state(static_cast<CUdevice>(index), &flags, &active) != CUDA_SUCCESS) {
    return true;  // unknown: give the device back, as the runtime alone would
  }
  return active != 0;
}

std::string error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cuda
}  // namespace sd
