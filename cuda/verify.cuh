// CUDA launcher for batched verification. Raw device pointers in VerifyArgs, a caller-allocated
// workspace and the caller's stream in, cudaError_t out; nothing is allocated and nothing
// synchronises. Semantics as in src/specdecode/verify.h; the tokens equal the CPU backend's bit
// for bit.
#pragma once

#include <cuda_runtime_api.h>

#include "specdecode/verify.h"

namespace sd {
namespace cuda {

// Three kernels in order on `stream` (src/specdecode/verify.h, "the final draw"): the walk, one
// block per sequence, which stops before the final draw and describes it in the workspace; the
// draw's chunk sums, one block per (sequence, slice of the vocabulary's chunks), `slices` slices
// per sequence (clamped to the chunk count); the total and the pick, one block per sequence.
// workspace: device memory of verify::final_workspace_bytes(batch, vocab) bytes, 16-byte aligned,
// owned by the caller (it may be reused once the kernels are done: stream order).
// target_dtype / draft_dtype: 0 float32, 1 float16, 2 bfloat16; draft_dtype -1 when no draft.
cudaError_t verify(const verify::VerifyArgs& args, int target_dtype, int draft_dtype,
                   void* workspace, int slices, cudaStream_t stream);

// The sampling distribution of every row (verify::distribution_sequence), one block per row, on
// `stream`. dtype: 0 float32, 1 float16, 2 bfloat16 (args.logits: logits or probabilities).
cudaError_t sampling_distribution(const verify::DistributionArgs& args, int dtype,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace sd
