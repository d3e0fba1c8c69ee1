// CUDA launchers for tree-masked attention and KV compaction. Raw device pointers and the
// caller's stream in, cudaError_t out; nothing is allocated and nothing synchronises. Semantics
// as in src/specdecode/attention_ops.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "specdecode/attention_ops.h"

namespace sd {
namespace cuda {

// Flash-decoding: the prefix of each (sequence, KV head) is cut into `splits` ranges that run in
// separate thread blocks (the last one also takes the masked tree part), each writing a finished
// partial (o, lse) into part_o [splits, B, T, Hq, D] / part_lse [splits, B, T, Hq] (caller's
// workspace, float32); a second kernel merges them with the log-sum-exp rule into out and lse.
cudaError_t tree_attention(const AttentionArgs& args, int splits, float* part_o, float* part_lse,
                           cudaStream_t stream);

// The query rows (of the T x Hq / Hkv that share a KV head) one thread block of tree_attention
// takes for a launch of `batch` sequences, `kv_heads` KV heads and `rows` such rows on device
// `device` (-1: the current one): the unit by which the caller sizes `splits`. fp16 / bf16
// assume caches on 16-byte boundaries (the tensor-core kernel; others run the CUDA-core
// kernel's blocks, the fp32 figure).
int tree_attention_block_rows(int64_t batch, int64_t kv_heads, int64_t rows, int head_dim,
                              AttnDType dtype, int device);

cudaError_t compact_kv(void* k, void* v, int elem_size, const int64_t kv_strides[3], int64_t batch,
                       int64_t cache_len, int64_t kv_heads, int64_t head_dim,
                       const int32_t* prefix_lens, const int32_t* path, int path_len,
                       const int32_t* num_accepted, int32_t* new_lens, int32_t* status,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace sd
