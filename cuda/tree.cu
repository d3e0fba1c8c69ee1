#include <algorithm>

#include "launch.cuh"
#include "specdecode/host_device.h"
#include "specdecode/tree.h"
#include "tree.cuh"

namespace sd {
namespace cuda {
namespace {

constexpr int kWarp = 32;

// One warp per tree: lane 0 validates the row, then each lane fills its own mask word columns
// with the shared fill_tree_row loop (word columns never depend on each other).
__global__ void tree_info_kernel(const int32_t* __restrict__ parents, int n, int32_t* depth,
                                 uint32_t* mask, int32_t* num_nodes, int32_t* status) {
  using Row = int32_t[kMaxTreeNodes];
  SD_SHARED(Row, row);
  SD_SHARED(int, shared_count);
  SD_SHARED(int, shared_err);
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x;
  for (int i = lane; i < n; i += kWarp) row[i] = parents[b * n + i];
  __syncwarp();
  if (lane == 0) {
    int count = 0, bad = 0;
    const TreeError err = validate_tree_row(row, n, &count, &bad);
    status[2 * b] = static_cast<int32_t>(err);
    status[2 * b + 1] = bad;
    num_nodes[b] = count;
    shared_count = count;
    shared_err = static_cast<int>(err);
  }
  __syncwarp();
  if (shared_err != 0) return;
  const int words = mask_words(n);
  int32_t* depth_row = depth + b * n;
  if (mask) {
    fill_tree_row(row, n, shared_count, words, lane, kWarp, mask + b * int64_t(n) * words,
                  lane == 0 ? depth_row : nullptr);
  } else if (lane == 0) {
    fill_tree_row(row, n, shared_count, 0, 0, 1, nullptr, depth_row);
  }
}

// One thread per tree: the walk is O(N) and tiny next to the launch.
__global__ void tree_paths_kernel(const int32_t* __restrict__ parents,
                                  const int32_t* __restrict__ depth,
                                  const int32_t* __restrict__ num_nodes, int64_t batch, int n,
                                  int max_paths, int path_len, int32_t* paths, int32_t* num_paths,
                                  int32_t* status) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  uint8_t is_leaf[kMaxTreeNodes];
  const int32_t* row = parents + b * n;
  const int count = min(num_nodes[b], n);
  num_paths[b] = mark_tree_leaves(row, count, is_leaf);
  status[b] = 0;
  if (!paths) return;
  int32_t* out = paths + b * int64_t(max_paths) * path_len;
  if (fill_tree_paths(row, depth + b * n, count, is_leaf, max_paths, path_len, out) < 0) {
    status[b] = 1;
  }
}

}  // namespace

cudaError_t tree_info(const int32_t* parents, int64_t batch, int n, int32_t* depth, uint32_t* mask,
                      int32_t* num_nodes, int32_t* status, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  SD_LAUNCH(static_cast<unsigned>(batch), kWarp, 0, stream, tree_info_kernel)(
      parents, n, depth, mask, num_nodes, status);
  return cudaGetLastError();
}

cudaError_t tree_paths(const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                       int64_t batch, int n, int max_paths, int path_len, int32_t* paths,
                       int32_t* num_paths, int32_t* status, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  constexpr int kThreads = 64;
  const unsigned blocks = static_cast<unsigned>((batch + kThreads - 1) / kThreads);
  SD_LAUNCH(blocks, kThreads, 0, stream, tree_paths_kernel)(
      parents, depth, num_nodes, batch, n, max_paths, path_len, paths, num_paths, status);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace sd
