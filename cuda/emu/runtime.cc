// cuda/runtime.cuh for the CUDA emulator: one device, the host.
#include <string>

#include "cuda_runtime_api.h"
#include "runtime.cuh"

namespace sd {
namespace cuda {

RuntimeInfo query_runtime() {
  RuntimeInfo info{};
  info.devices.push_back(DeviceInfo{0, "specdecode CUDA emulator (host)",
                                    emu::compute_capability_major(),
                                    emu::compute_capability_minor(), 0});
  return info;
}

bool set_device(int index, std::string* error) {
  if (index == 0) return true;
  *error = "the CUDA emulator has one device, 0";
  return false;
}

std::string error_string(int code) {
  std::string s = cudaGetErrorString(static_cast<cudaError_t>(code));
  const std::string detail = emu::last_message();
  if (!detail.empty()) s += " (CUDA emulator: " + detail + ")";
  return s;
}

}  // namespace cuda
}  // namespace sd
