// CUDA launcher for the 16-bit float conversions of src/specdecode/host_device.h as the device
// compiles them (a test hook: the device's cvt instructions against the host's bit code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sd {
namespace cuda {

// to_float: out[i] = half_to_float(in[i]) (in: n fp16 bit patterns, out: n floats); otherwise
// out[i] = float_to_half(in[i]) (in: n floats, out: n fp16 bit patterns). Device pointers.
cudaError_t convert_halves(const void* in, void* out, int64_t n, bool to_float,
                           cudaStream_t stream);

}  // namespace cuda
}  // namespace sd
