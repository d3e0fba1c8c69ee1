// Batched tree utilities on the CPU. Every array is contiguous row-major; B rows of width N.
#pragma once

#include <cstdint>

namespace sd {
namespace cpu {

// Validates each row of parents [B, N] and fills num_nodes [B], depth [B, N] and, unless mask is
// null, the ancestor mask [B, N, mask_words(N)]. status [B, 2] receives (TreeError, bad node) per
// row; the other outputs of a row with an error are unspecified.
void tree_info(const int32_t* parents, int64_t batch, int n, int32_t* depth, uint32_t* mask,
               int32_t* num_nodes, int32_t* status);

// For rows already validated by tree_info: num_paths [B] receives each row's leaf count and,
// unless paths is null, paths [B, max_paths, path_len] the root-to-leaf paths (see
// fill_tree_paths). status [B] is 0, or 1 where a row's paths do not fit.
void tree_paths(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                int64_t batch, int n, int max_paths, int path_len, int32_t* paths,
                int32_t* num_paths, int32_t* status);

}  // namespace cpu
}  // namespace sd
