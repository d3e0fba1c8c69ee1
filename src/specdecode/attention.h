// Math of tree-masked attention shared by the CPU core and the CUDA kernels.
//
// Scores live in the log2 domain: the query is pre-multiplied by scale * log2(e), so that every
// exponential is an exp2 (one instruction on the GPU, a short polynomial on the CPU). A partial
// result over any subset of the keys is either
//   * a running online-softmax state (max m, sum l, unnormalised accumulator acc = sum 2^(s-m) v),
//     while keys are still being added, or
//   * a finished pair (o = acc / l, lse2 = m + log2 l), which is what is stored between passes.
// Two finished pairs over disjoint key sets merge exactly with the log-sum-exp rule
// (lse_merge_weights), whichever order they come in; that is how the dense prefix is combined with
// the masked tree part, and how KV splits are combined (flash-decoding).
//
// A row that sees no key at all (empty prefix and an all-zero mask row) has l = 0; it finishes
// as o = 0, lse2 = -inf, and merges as the identity. A +inf or NaN score (non-finite q or K) makes
// l NaN (2^(inf - inf)); such a partial finishes as o = NaN, lse2 = NaN, and NaN spreads through
// every merge, so the row is NaN as with a dense softmax, whichever split holds the key.
#pragma once

#include <cmath>
#include <cstdint>

#include "specdecode/host_device.h"

namespace sd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Head dims the kernels are instantiated for (all multiples of 16, which the vector paths use).
SD_HD_INLINE bool attention_head_dim_supported(int64_t d) {
  return d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

SD_HD_INLINE float neg_inf() { return -INFINITY; }

// The value subtracted before exponentiating. With no finite score seen yet the max is -inf, and
// -inf - (-inf) would be NaN; subtracting 0 instead makes every masked term 2^-inf = 0.
SD_HD_INLINE float softmax_reference(float m) { return m == -INFINITY ? 0.0f : m; }

struct SoftmaxState {
  float m;  // running max of the log2-domain scores (-inf before the first visible key)
  float l;  // running sum of 2^(s - m)
};

SD_HD_INLINE SoftmaxState softmax_init() { return SoftmaxState{-INFINITY, 0.0f}; }

// Raises the running max to cover a block whose max is block_max. Returns the factor the old
// accumulator (and the old sum, already applied here) must be multiplied by; the caller then adds
// the block's terms 2^(s - softmax_reference(state.m)).
SD_HD_INLINE float softmax_rescale(SoftmaxState* state, float block_max) {
  // A block that does not raise a finite max leaves the state as it is: the factor below would be
  // exp2f(0) = 1, returned here without the call (the AMX tiles rescale once per row and chunk).
  if (block_max <= state->m && state->m > -INFINITY && state->m < INFINITY) return 1.0f;
  const float new_max = block_max > state->m ? block_max : state->m;
  // Nothing seen yet: the factor exp2f(-inf - x) is 0 for every reference x, so the call is
  // skipped (each row's first block of every split, where it was the kernels' commonest call).
  if (state->m == -INFINITY) {
    state->m = new_max;
    state->l *= 0.0f;  // 0, or NaN kept from a NaN score, as the product with exp2f would give
    return 0.0f;
  }
  const float alpha = exp2f(state->m - softmax_reference(new_max));
  state->m = new_max;
  state->l *= alpha;
  return alpha;
}

// Finishes a state: the accumulator is scaled by *inv_l (0 for a row that saw nothing) and the
// return value is lse2 = m + log2(l) (-inf for a row that saw nothing). A NaN l (a +inf or NaN
// score) gives a NaN factor and lse2: were it taken for an empty row, its -inf lse2 would give
// the split weight 0 in a merge and the non-finite key would vanish from the result.
SD_HD_INLINE float softmax_finish(SoftmaxState state, float* inv_l) {
  if (state.l == 0.0f) {
    *inv_l = 0.0f;
    return -INFINITY;
  }
  *inv_l = 1.0f / state.l;
  return state.m + log2f(state.l);
}

// Merge of two finished partials over disjoint key sets: o = wa * oa + wb * ob, returns the
// merged lse2. Exact regardless of order; either side may be empty (-inf), both may be. A NaN
// side (a non-finite score, see softmax_finish) makes both weights and the result NaN: the
// comparison below would otherwise pick the other side, and an empty other side would drop it.
SD_HD_INLINE float lse_merge_weights(float lse_a, float lse_b, float* wa, float* wb) {
  if (lse_a != lse_a || lse_b != lse_b) {
    *wa = NAN;
    *wb = NAN;
    return NAN;
  }
  const float hi = lse_a > lse_b ? lse_a : lse_b;
  if (hi == -INFINITY) {
    *wa = 0.0f;
    *wb = 0.0f;
    return -INFINITY;
  }
  // One side empty and the other finite: the weights below would be exactly 0 and 1 and the sum
  // 1, so the three calls are skipped (the first split of every merge, a row without a tree part).
  if ((lse_a == -INFINITY || lse_b == -INFINITY) && hi < INFINITY) {
    *wa = lse_a == -INFINITY ? 0.0f : 1.0f;
    *wb = 1.0f - *wa;
    return hi;
  }
  const float ea = exp2f(lse_a - hi);
  const float eb = exp2f(lse_b - hi);
  const float sum = ea + eb;
  *wa = ea / sum;
  *wb = eb / sum;
  return hi + log2f(sum);
}

// The low n bits of a word (none for n <= 0, all for n >= 64): a block of n keys.
SD_HD_INLINE uint64_t low_bits(int n) {
  return n <= 0 ? 0 : (n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1);
}

// The tree nodes [j0, j0 + n) visible from tree node `query`, bit j for node j0 + j: bits j0 ..
// j0 + n - 1 of the query's mask row, or, without a mask, the causal chain rule key <= query.
// Needs 0 <= j0, 0 <= n, j0 % 32 + n <= 64 (the bits lie in at most two mask words) and j0 + n
// at most the row's nodes. The one statement of the rule: the CPU reads its blocks through it
// (16 or 64 keys from a multiple of their size), the CUDA kernels one key (tree_key_visible).
SD_HD_INLINE uint64_t tree_visible_bits(const uint32_t* mask_row, int query, int j0, int n) {
  if (n <= 0) return 0;
  const uint64_t keys = low_bits(n);
  if (!mask_row) return keys & low_bits(query - j0 + 1);  // keys j0 .. query
  // A second word only where the bits run past the first (never for one node: shift <= 31).
  const int w0 = j0 >> 5, shift = j0 & 31;
  uint64_t bits = static_cast<uint64_t>(mask_row[w0]) >> shift;
  if (shift + n > 32) bits |= static_cast<uint64_t>(mask_row[w0 + 1]) << (32 - shift);
  return bits & keys;
}

// Whether tree node `key` is visible from tree node `query` (tree_visible_bits of one node).
SD_HD_INLINE bool tree_key_visible(const uint32_t* mask_row, int query, int key) {
  return (tree_visible_bits(mask_row, query, key, 1) & 1u) != 0;
}

// ---- compact_kv --------------------------------------------------------------------------

enum class CompactError : int32_t {
  kOk = 0,
  kBadCount = 1,       // num_accepted < 0 or > L
  kBadNode = 2,        // path[i] < 0 for an accepted i
  kNotIncreasing = 3,  // path[i] <= path[i - 1]
  kOutOfCache = 4,     // prefix_len + path[i] >= S, or prefix_len < 0
};

// Checks one row of compact_kv. The moves of a valid row are safe in increasing i: path is strictly
// increasing with path[0] >= 0, so path[i] >= i, and for every k > i the source prefix + path[k]
// is > prefix + path[i] >= prefix + i = the destination of move i. A move therefore never
// overwrites a source that a later move still has to read; it may only overwrite its own source
// (when path[i] == i, a no-op) or sources already read.
SD_HD_INLINE CompactError validate_compact_row(const int32_t* path, int path_len, int32_t count,
                                               int32_t prefix_len, int64_t cache_len,
                                               int* bad_index) {
  *bad_index = 0;
  if (count < 0 || count > path_len) return CompactError::kBadCount;
  if (prefix_len < 0) return CompactError::kOutOfCache;
  for (int i = 0; i < count; ++i) {
    *bad_index = i;
    if (path[i] < 0) return CompactError::kBadNode;
    if (i > 0 && path[i] <= path[i - 1]) return CompactError::kNotIncreasing;
    if (static_cast<int64_t>(prefix_len) + path[i] >= cache_len) return CompactError::kOutOfCache;
  }
  *bad_index = 0;
  return CompactError::kOk;
}

}  // namespace sd
