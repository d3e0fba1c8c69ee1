// What the CUDA runtime linked into the module can see. Safe to call with no driver installed.
#pragma once

#include <string>
#include <vector>

namespace sd {
namespace cuda {

struct DeviceInfo {
  int index;
  std::string name;
  int major, minor;
  size_t total_memory;
};

struct RuntimeInfo {
  int runtime_version;  // e.g. 13000; 0 if unknown
  int driver_version;   // 0 when no driver is installed
  std::string error;    // why no device is usable, empty when devices were found
  std::vector<DeviceInfo> devices;
};

RuntimeInfo query_runtime();

// The device that owns `ptr`-like work: sets the current device for the calling thread.
bool set_device(int index, std::string* error);

// Empty when fine, else the runtime's message for the last asynchronous error.
std::string error_string(int code);

}  // namespace cuda
}  // namespace sd
