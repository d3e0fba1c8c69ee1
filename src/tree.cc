#include <algorithm>

#include "specdecode/host_device.h"
#include "specdecode/parallel.h"
#include "specdecode/tree.h"
#include "specdecode/tree_ops.h"

namespace sd {
namespace cpu {

namespace {
// Rows are cheap (O(N * words)); batch them so a chunk is worth a thread hand-off.
int64_t rows_per_chunk(int n) { return std::max<int64_t>(1, 16384 / std::max(n, 1)); }
}  // namespace

void tree_info(const int32_t* parents, int64_t batch, int n, int32_t* depth, uint32_t* mask,
               int32_t* num_nodes, int32_t* status) {
  const int words = mask_words(n);
  parallel_for(batch, rows_per_chunk(n), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* row = parents + b * n;
      int count = 0, bad = 0;
      const TreeError err = validate_tree_row(row, n, &count, &bad);
      status[2 * b] = static_cast<int32_t>(err);
      status[2 * b + 1] = bad;
      num_nodes[b] = count;
      if (err != TreeError::kOk) continue;
      uint32_t* mask_row = mask ? mask + b * static_cast<int64_t>(n) * words : nullptr;
      if (mask_row) {
        fill_tree_row(row, n, count, words, 0, 1, mask_row, depth + b * n);
      } else {
        // Depth only: the same recurrence without mask words.
        fill_tree_row(row, n, count, 0, 0, 1, nullptr, depth + b * n);
      }
    }
  });
}

void tree_paths(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                int64_t batch, int n, int max_paths, int path_len, int32_t* paths,
                int32_t* num_paths, int32_t* status) {
  parallel_for(batch, rows_per_chunk(n), [&](int64_t begin, int64_t end) {
    uint8_t is_leaf[kMaxTreeNodes];
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* row = parents + b * n;
      const int count = std::min(num_nodes[b], n);
      num_paths[b] = mark_tree_leaves(row, count, is_leaf);
      status[b] = 0;
      if (!paths) continue;
      int32_t* out = paths + b * static_cast<int64_t>(max_paths) * path_len;
      if (fill_tree_paths(row, depth + b * n, count, is_leaf, max_paths, path_len, out) < 0) {
        status[b] = 1;
      }
    }
  });
}

}  // namespace cpu
}  // namespace sd
