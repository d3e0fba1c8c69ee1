// Tree-masked attention and KV compaction on the CPU.
//
// Layouts (element strides, so the caches may be views into larger buffers; the head dim is
// always contiguous):
//   q        [B, T, Hq, D]       strides q_strides[0..2]
//   k, v     [B, S, Hkv, D]      strides kv_strides[0..2] (k and v share them)
//   out      [B, T, Hq, D]       contiguous
//   lse      [B, T, Hq] float32  contiguous, natural log of the softmax denominator of the
//                                scaled scores (-inf for a row that sees no key); may be null
//   mask     [B, T, mask_words(T)] uint32 contiguous, or null for a causal chain
//   status   [B] int32: 0, or 1 where prefix_lens[b] < 0 or prefix_lens[b] + T > S (that row is
//            skipped and its output zeroed; nothing is read out of bounds)
#pragma once

#include <cstdint>

namespace sd {

enum class AttnDType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct AttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* prefix_lens;
  const uint32_t* mask;  // null: causal chain
  void* out;
  float* lse;  // may be null
  int32_t* status;
  AttnDType dtype;
  int64_t batch, tree_len, cache_len;   // B, T, S
  int64_t q_heads, kv_heads, head_dim;  // Hq, Hkv, D
  int64_t q_strides[3];                 // b, t, h
  int64_t kv_strides[3];                // b, s, h
  float scale;
};

namespace cpu {

// Which vector code path the CPU kernels use on this machine: "avx512", "avx2" or "generic".
const char* attention_isa();

// Forces a code path for testing ("avx512", "avx2", "generic", or "" for the best available).
// Returns false (and changes nothing) when the machine lacks the requested instructions.
bool set_attention_isa(const char* name);

void tree_attention(const AttentionArgs& args);

// Moves, per row b, the K/V rows at prefix_lens[b] + path[b, i] to prefix_lens[b] + i for
// i < num_accepted[b], in place, and writes new_lens[b] = prefix_lens[b] + num_accepted[b].
// status [B, 2] receives (CompactError, bad index) per row; if any row is invalid nothing moves
// (see validate_compact_row).
void compact_kv(void* k, void* v, int elem_size, const int64_t kv_strides[3], int64_t batch,
                int64_t cache_len, int64_t kv_heads, int64_t head_dim, const int32_t* prefix_lens,
                const int32_t* path, int path_len, const int32_t* num_accepted, int32_t* new_lens,
                int32_t* status);

}  // namespace cpu
}  // namespace sd
