// cuda/runtime.cuh for the CUDA emulator: its devices are the host (sd::emu::reset_devices).
#include <string>

#include "cuda_runtime_api.h"
#include "runtime.cuh"

namespace sd {
namespace cuda {

RuntimeInfo query_runtime() {
  RuntimeInfo info{};
  for (int i = 0; i < emu::device_count(); ++i) {
    info.devices.push_back(DeviceInfo{i, "specdecode CUDA emulator (host)",
                                      emu::compute_capability_major(),
                                      emu::compute_capability_minor(), 0});
  }
  return info;
}

bool has_primary_context(int index) { return emu::primary_context_active(index); }

int emulated_array_device() { return emu::array_device(); }

std::string error_string(int code) {
  std::string s = cudaGetErrorString(static_cast<cudaError_t>(code));
  const std::string detail = emu::last_message();
  if (!detail.empty()) s += " (CUDA emulator: " + detail + ")";
  return s;
}

}  // namespace cuda
}  // namespace sd
