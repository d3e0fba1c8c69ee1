// CUDA launcher for batched verification. Raw device pointers in VerifyArgs and the caller's
// stream in, cudaError_t out; nothing is allocated and nothing synchronises. Semantics as in
// src/specdecode/verify.h; the tokens equal the CPU backend's bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include "specdecode/verify.h"

namespace sd {
namespace cuda {

// target_dtype / draft_dtype: 0 float32, 1 float16, 2 bfloat16; draft_dtype -1 when no draft.
cudaError_t verify(const verify::VerifyArgs& args, int target_dtype, int draft_dtype,
                   cudaStream_t stream);

}  // namespace cuda
}  // namespace sd
