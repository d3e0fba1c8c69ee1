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

// The current device of the calling thread is the caller's (torch keeps its own "current
// device" there): an op on another device's arrays switches to that device for its launches and
// gives the caller's back afterwards, as torch's device guards do.
//
// Makes `index` current. *previous is the device for leave_device to give back, -1 when `index`
// already was current (nothing switched: the common case costs one cudaGetDevice). False, with
// the runtime's message in *error and no error left pending, when `index` cannot be used.
bool enter_device(int index, int* previous, std::string* error);
// Gives back `previous` from enter_device (-1: nothing to do). Where `previous` has no active
// primary context (a thread that never used it, e.g. device 0 of a worker thread that only ran
// on device 1), the op's device stays current instead: making `previous` current would create
// that context, hundreds of MiB of device memory, which torch's guards avoid the same way.
// Never throws, and a failure leaves no error pending for the caller's next cudaGetLastError.
void leave_device(int previous);
// Whether the primary context of device `index` is active (true where the driver cannot say).
bool has_primary_context(int index);

#ifdef SPECDECODE_CUDA_EMULATED
// The emulated device that host arrays are on (cuda/emu: sd::emu::reset_devices).
int emulated_array_device();
#endif

// Empty when fine, else the runtime's message for the last asynchronous error.
std::string error_string(int code);

}  // namespace cuda
}  // namespace sd
