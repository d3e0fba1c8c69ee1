// CUDA launchers for the tree utilities. Raw device pointers and the caller's stream in,
// cudaError_t out; nothing is allocated and nothing synchronises. Semantics as in
// src/specdecode/tree_ops.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sd {
namespace cuda {

cudaError_t tree_info(const int32_t* parents, int64_t batch, int n, int32_t* depth, uint32_t* mask,
                      int32_t* num_nodes, int32_t* status, cudaStream_t stream);

cudaError_t tree_paths(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                       int64_t batch, int n, int max_paths, int path_len, int32_t* paths,
                       int32_t* num_paths, int32_t* status, cudaStream_t stream);

}  // namespace cuda
}  // namespace sd
