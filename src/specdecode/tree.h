// The tree format every op shares, and the per-row tree math used by both backends.
//
// A draft tree of one sequence is a row of `parents` of width N: node 0 is the root (the last
// committed token) with parent -1, every other valid node i has 0 <= parents[i] < i (parents come
// before children, which also rules out cycles), and the row is padded with -1 after the
// num_nodes valid nodes. N <= kMaxTreeNodes.
#pragma once

#include <cstdint>

#include "specdecode/host_device.h"

namespace sd {

enum class TreeError : int32_t {
  kOk = 0,
  kRootNotFirst = 1,      // parents[0] != -1
  kParentNotBefore = 2,   // parents[i] >= i (out of order, or a cycle)
  kBadParent = 3,         // parents[i] < -1
  kNodeAfterPadding = 4,  // a valid node after a -1 (padding in the middle, or a second root)
};

// Checks one row and finds its node count. Returns kOk or the first error; *bad_node is the
// offending node index (0 when the row is fine).
SD_HOST_DEVICE inline TreeError validate_tree_row(const int32_t* parents, int n, int* num_nodes,
                                                  int* bad_node) {
  *num_nodes = 0;
  *bad_node = 0;
  if (n <= 0) return TreeError::kOk;
  if (parents[0] != kPad) return TreeError::kRootNotFirst;
  int count = 1;
  bool padding = false;
  for (int i = 1; i < n; ++i) {
    const int32_t p = parents[i];
    if (p == kPad) {
      padding = true;
      continue;
    }
    *bad_node = i;
    if (p < kPad) return TreeError::kBadParent;
    if (padding) return TreeError::kNodeAfterPadding;
    if (p >= i) return TreeError::kParentNotBefore;
    ++count;
  }
  *bad_node = 0;
  *num_nodes = count;
  return TreeError::kOk;
}

// The deepest node's depth and the most children of one node, over nodes [0, count) of a valid
// row (validate_tree_row; count at most its nodes). Parents come before children, so one pass
// in index order; depth and children are scratch of count entries.
struct TreeLimits {
  int depth;
  int children;
};
SD_HOST_DEVICE inline TreeLimits tree_limits_row(const int32_t* parents, int count, int16_t* depth,
                                                 int16_t* children) {
  TreeLimits lim{0, 0};
  if (count <= 0) return lim;
  depth[0] = 0;
  children[0] = 0;
  for (int i = 1; i < count; ++i) {
    const int32_t p = parents[i];
    depth[i] = static_cast<int16_t>(depth[p] + 1);
    children[i] = 0;
    const int c = ++children[p];
    lim.depth = depth[i] > lim.depth ? depth[i] : lim.depth;
    lim.children = c > lim.children ? c : lim.children;
  }
  return lim;
}

// Fills the ancestor mask of one valid row for the mask words w = word_begin, word_begin +
// word_step, ... < words, and, when depth != nullptr, the depths. Row i of the mask has bit j set
// iff j == i or j is an ancestor of i. Padding rows get an all-zero mask and depth -1.
//
// Word columns are independent (row i, word w depends only on row parents[i], word w), so the
// CPU calls this once with step 1 while a GPU warp gives each lane its own word column; both run
// this same loop.
SD_HOST_DEVICE inline void fill_tree_row(const int32_t* parents, int n, int num_nodes, int words,
                                         int word_begin, int word_step, uint32_t* mask,
                                         int32_t* depth) {
  for (int i = 0; i < n; ++i) {
    uint32_t* row = mask + static_cast<int64_t>(i) * words;
    const bool valid = i < num_nodes;
    const int32_t p = valid ? parents[i] : kPad;
    const uint32_t* parent_row = p >= 0 ? mask + static_cast<int64_t>(p) * words : nullptr;
    for (int w = word_begin; w < words; w += word_step) {
      uint32_t v = parent_row ? parent_row[w] : 0u;
      if (valid && i / kMaskWordBits == w) v |= 1u << (i % kMaskWordBits);
      row[w] = v;
    }
    if (depth) depth[i] = !valid ? kPad : (p < 0 ? 0 : depth[p] + 1);
  }
}

// Marks the leaves (valid nodes with no child) of a valid row; returns their count.
SD_HOST_DEVICE inline int mark_tree_leaves(const int32_t* parents, int num_nodes,
                                           uint8_t* is_leaf) {
  for (int i = 0; i < num_nodes; ++i) is_leaf[i] = 1;
  for (int i = 1; i < num_nodes; ++i) is_leaf[parents[i]] = 0;
  int leaves = 0;
  for (int i = 0; i < num_nodes; ++i) leaves += is_leaf[i];
  return leaves;
}

// Writes the root-to-leaf path of every leaf, leaves in ascending node order, into a
// [max_paths, path_len] block, padding unused entries and rows with -1. Returns the number of
// paths written, or -1 when a path does not fit (a leaf deeper than path_len - 1, or more leaves
// than max_paths).
SD_HOST_DEVICE inline int fill_tree_paths(const int32_t* parents, const int32_t* depth,
                                          int num_nodes, const uint8_t* is_leaf, int max_paths,
                                          int path_len, int32_t* paths) {
  for (int64_t k = 0; k < static_cast<int64_t>(max_paths) * path_len; ++k) paths[k] = kPad;
  int row = 0;
  for (int leaf = 0; leaf < num_nodes; ++leaf) {
    if (!is_leaf[leaf]) continue;
    if (row >= max_paths || depth[leaf] >= path_len) return -1;
    int32_t* path = paths + static_cast<int64_t>(row) * path_len;
    for (int node = leaf; node >= 0; node = parents[node]) path[depth[node]] = node;
    ++row;
  }
  return row;
}

}  // namespace sd
