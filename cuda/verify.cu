#include <cstdint>

#include "launch.cuh"
#include "specdecode/verify.h"
#include "verify.cuh"

namespace sd {
namespace cuda {
namespace {

using verify::ScanResult;

constexpr int kThreads = 256;
static_assert(verify::kTopPBuckets % 32 == 0 && kThreads >= 32,
              "the histogram's suffix sums take one warp");

// BlockShared::chunk_state bits of the top-p search (verify::top_p_settling_search).
constexpr uint8_t kSettled = 1, kBelow = 2, kAbove = 4;

struct BlockShared {
  // tree_limits' scratch shares the chunk sums' space: it runs at the start of a sequence's walk,
  // before any chunk sums, and the previous sequence's were copied out (walk_kernel).
  union {
    float sums0[verify::kMaxChunks];
    int16_t tree_depth[kMaxTreeNodes];
  };
  union {
    float sums1[verify::kMaxChunks];
    int16_t tree_children[kMaxTreeNodes];
  };
  float chunk_max[verify::kMaxChunks];
  float chunk_scale[verify::kMaxChunks];
  float red_value[kThreads];
  int64_t red_index[kThreads];
  int red_flag[kThreads];
  unsigned hist[256];
  uint8_t chunk_state[verify::kMaxChunks];    // top-p search: kSettled | kBelow | kAbove
  float top_p_cum[verify::kTopPBuckets + 1];  // top-p search: the last histogram (suffix sums)
  float total;
  uint32_t prefix;
  int64_t remaining;
  TreeLimits tree_limits;
};

// Order-preserving key of a float with the largest value first (smallest key).
__device__ __forceinline__ uint32_t descending_key(float v) {
  const uint32_t bits = float_to_bits(v);
  const uint32_t ascending = bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
  return ~ascending;
}

__device__ __forceinline__ float key_value(uint32_t key) {
  const uint32_t ascending = ~key;
  return bits_to_float((ascending & 0x80000000u) ? (ascending ^ 0x80000000u) : ~ascending);
}

// The executor of the shared walk for one thread block: every thread runs the walk; the
// collectives below start with a barrier (so shared scratch is never overwritten while another
// thread still reads it) and hand every thread the same result.
class BlockExec {
 public:
  __device__ explicit BlockExec(BlockShared* shared) : sh_(shared) {}

  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ float* sums(int which) { return which ? sh_->sums1 : sh_->sums0; }

  // One pass in node order (each depth needs its parent's) by the leader; at most 1024 nodes,
  // next to rows of up to 2^19 tokens the walk reads.
  __device__ TreeLimits tree_limits(const int32_t* parents, int count) {
    __syncthreads();
    if (leader()) {
      sh_->tree_limits = tree_limits_row(parents, count, sh_->tree_depth, sh_->tree_children);
    }
    __syncthreads();
    return sh_->tree_limits;
  }

  // A sampling_probs row (verify::distribution_sequence), the block's threads striding over it.
  template <class T>
  __device__ void write_probs(int64_t n, const verify::RowWeight<T>& f, float total, float* out) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) out[i] = verify::fdiv(f(i), total);
  }
  __device__ void write_one_hot(int64_t n, int64_t hot, float* out) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) out[i] = i == hot ? 1.f : 0.f;
  }
  __device__ const float* chunk_max() const { return sh_->chunk_max; }
  __device__ const float* chunk_scale() const { return sh_->chunk_scale; }

  // One thread per chunk: its largest raw value, then m_c and g_c (verify::chunk_scale_of).
  template <class Load>
  __device__ void chunk_scales(int64_t n, const Load& load, float inv_temp, float scaled_max) {
    __syncthreads();
    const int chunks = verify::num_chunks(n);
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = begin + verify::kChunk < n ? begin + verify::kChunk : n;
      float m = -verify::kInf;
      for (int64_t i = begin; i < end; ++i) {
        const float v = load(i);
        m = v > m ? v : m;
      }
      verify::chunk_scale_of(m, inv_temp, scaled_max, &sh_->chunk_max[c], &sh_->chunk_scale[c]);
    }
    __syncthreads();
  }

  // The hint is not used: the block reads the row again for each later pass.
  template <class Load, class Bad>
  __device__ ScanResult scan(int64_t n, const Load& load, const Bad& bad, const verify::ScanHint&) {
    const int tid = threadIdx.x;
    float best = -verify::kInf;
    int64_t arg = INT64_MAX;
    int flag = 0;
    // Each thread sees its indices in increasing order: a strict > keeps its lowest argmax.
    for (int64_t i = tid; i < n; i += kThreads) {
      const float v = load(i);
      flag |= bad(v) ? 1 : 0;
      if (v > best) {
        best = v;
        arg = i;
      }
    }
    __syncthreads();
    sh_->red_value[tid] = best;
    sh_->red_index[tid] = arg;
    sh_->red_flag[tid] = flag;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (tid < s) {
        const float v = sh_->red_value[tid + s];
        const int64_t j = sh_->red_index[tid + s];
        if (v > sh_->red_value[tid] || (v == sh_->red_value[tid] && j < sh_->red_index[tid])) {
          sh_->red_value[tid] = v;
          sh_->red_index[tid] = j;
        }
        sh_->red_flag[tid] |= sh_->red_flag[tid + s];
      }
      __syncthreads();
    }
    ScanResult r;
    r.max = sh_->red_value[0];
    r.argmax = sh_->red_index[0] == INT64_MAX ? 0 : sh_->red_index[0];
    r.bad = sh_->red_flag[0] != 0;
    return r;
  }

  template <class F>
  __device__ float chunk_sums(int64_t n, const F& f, int which) {
    __syncthreads();
    float* out = sums(which);
    const int chunks = verify::num_chunks(n);
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = begin + verify::kChunk < n ? begin + verify::kChunk : n;
      out[c] = verify::canonical_chunk_sum(f, begin, end);
    }
    __syncthreads();
    // The canonical total adds the chunk sums in order; one thread does it for all.
    if (threadIdx.x == 0) sh_->total = verify::sequential_total(out, chunks);
    __syncthreads();
    return sh_->total;
  }

  template <class Pred>
  __device__ int64_t count_if(int64_t n, const Pred& pred) {
    const int tid = threadIdx.x;
    int64_t count = 0;
    for (int64_t i = tid; i < n; i += kThreads) count += pred(i) ? 1 : 0;
    __syncthreads();
    sh_->red_index[tid] = count;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (tid < s) sh_->red_index[tid] += sh_->red_index[tid + s];
      __syncthreads();
    }
    return sh_->red_index[0];
  }

  // Radix select, 8 bits per pass, on the descending keys: the k-th smallest key is the k-th
  // largest value. Integer histograms, so the result is exact and order-free.
  template <class Load>
  __device__ float kth_largest(int64_t n, const Load& load, int64_t k) {
    const int tid = threadIdx.x;
    uint32_t prefix = 0u, mask = 0u;
    int64_t rest = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      __syncthreads();
      for (int i = tid; i < 256; i += kThreads) sh_->hist[i] = 0u;
      __syncthreads();
      for (int64_t i = tid; i < n; i += kThreads) {
        const uint32_t key = descending_key(load(i));
        if ((key & mask) == prefix) atomicAdd(&sh_->hist[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        int64_t below = 0;
        int digit = 0;
        for (; digit < 255; ++digit) {
          if (below + sh_->hist[digit] >= rest) break;
          below += sh_->hist[digit];
        }
        sh_->prefix = prefix | (static_cast<uint32_t>(digit) << shift);
        sh_->remaining = rest - below;
      }
      __syncthreads();
      prefix = sh_->prefix;
      rest = sh_->remaining;
      mask |= 0xffu << shift;
    }
    return key_value(prefix);
  }

  // The top-p threshold by the shared search with settled chunks (verify.h).
  template <class T>
  __device__ uint32_t top_p_threshold(int64_t n, const verify::RowWeight<T>& f, float wanted,
                                      uint32_t hi) {
    return verify::top_p_settling_search(*this, n, f, wanted, hi);
  }

  // The search's per-chunk steps, one thread per chunk (the same chunks in every step, so a
  // thread reads back only what it wrote until the barrier before the total). The settled
  // chunks' S_c live in sums0 and each try's in sums1: both are free during the search
  // (prepare_row takes the row's sums again after it).
  template <class T>
  __device__ void top_p_unsettle(int64_t n, const verify::RowWeight<T>& f) {
    __syncthreads();
    const int chunks = verify::num_chunks(n);
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const bool empty = verify::top_p_chunk_empty(f, c);
      sh_->chunk_state[c] = empty ? kSettled : 0;
      if (empty) sh_->sums0[c] = 0.f;
    }
  }

  template <class T>
  __device__ float top_p_trial(int64_t n, const verify::RowWeight<T>& f, uint32_t lo, uint32_t mid,
                               uint32_t hi) {
    __syncthreads();
    const int chunks = verify::num_chunks(n);
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      if (sh_->chunk_state[c] & kSettled) continue;
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = begin + verify::kChunk < n ? begin + verify::kChunk : n;
      const verify::TopPChunkTrial r = verify::top_p_chunk_trial(f, begin, end, lo, mid, hi);
      sh_->sums1[c] = r.sum;
      sh_->chunk_state[c] = static_cast<uint8_t>((r.below ? kBelow : 0) | (r.above ? kAbove : 0));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int c = 0; c < chunks; ++c) {
        total =
            verify::fadd(total, (sh_->chunk_state[c] & kSettled) ? sh_->sums0[c] : sh_->sums1[c]);
      }
      sh_->total = total;
    }
    __syncthreads();
    return sh_->total;
  }

  // A histogram of the search (verify::top_p_locate): every thread adds its chunks' weights
  // inside the span with shared-memory atomics (an order-free, approximate mass: the search
  // only takes its proposals from it), then the first warp turns the buckets into suffix sums,
  // each lane over kPerLane buckets, the lanes' totals joined by shuffles.
  template <class T>
  __device__ const float* top_p_histogram(int64_t n, const verify::RowWeight<T>& f,
                                          const verify::TopPSpan& sp) {
    constexpr int kPerLane = verify::kTopPBuckets / 32;
    float* cum = sh_->top_p_cum;
    __syncthreads();
    for (int k = threadIdx.x; k <= verify::kTopPBuckets; k += kThreads) cum[k] = 0.f;
    __syncthreads();
    const int chunks = verify::num_chunks(n);
    const auto add = [cum](int k, float w) { atomicAdd(&cum[k], w); };
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      if (sh_->chunk_state[c] & kSettled) continue;
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = begin + verify::kChunk < n ? begin + verify::kChunk : n;
      verify::top_p_chunk_histogram(f, begin, end, sp, add);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      float* mine = cum + lane * kPerLane;
      float run = 0.f;
      for (int i = kPerLane - 1; i >= 0; --i) {
        run = verify::fadd(run, mine[i]);
        mine[i] = run;
      }
      // Inclusive suffix sums of the lanes' totals, then each lane adds those of the lanes above.
      float suffix = run;
      for (int d = 1; d < 32; d <<= 1) {
        const float v = __shfl_down_sync(0xffffffffu, suffix, d);
        if (lane + d < 32) suffix = verify::fadd(suffix, v);
      }
      float beyond = __shfl_down_sync(0xffffffffu, suffix, 1);
      if (lane == 31) beyond = 0.f;
      for (int i = 0; i < kPerLane; ++i) mine[i] = verify::fadd(mine[i], beyond);
    }
    __syncthreads();
    return cum;
  }

  // The tries are top_p_next_try's (the block keeps no list of weights).
  __device__ bool top_p_candidate(uint32_t, uint32_t, uint32_t*) { return false; }

  __device__ void top_p_settle(int64_t n, bool keep, uint32_t, uint32_t) {
    const int chunks = verify::num_chunks(n);
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const uint8_t st = sh_->chunk_state[c];
      if ((st & kSettled) || !verify::top_p_settles(keep, (st & kBelow) != 0, (st & kAbove) != 0)) {
        continue;
      }
      sh_->chunk_state[c] = kSettled;
      sh_->sums0[c] = sh_->sums1[c];
    }
  }

 private:
  BlockShared* sh_;
};

// ---- phase 1: the walk, one block per sequence -------------------------------------------------
// The walk is inherently sequential over the tree; each node's row work (max, canonical chunk
// sums, selections) is spread over the block's threads. It stops before the final draw and hands
// it to phases 2 and 3 through the workspace: the FinalDraw, the stop row's m_c and g_c (logits)
// and, for a draw from the row itself (kFinalRow), the row's S_c that prepare_row left in sums0.
// Blocks stride over the sequences, so any batch fits the grid.
template <class T, class Q>
__global__ void __launch_bounds__(kThreads)
    walk_kernel(verify::VerifyArgs args, verify::FinalWorkspace ws) {
  SD_SHARED(BlockShared, shared);
  BlockExec ex(&shared);
  for (int64_t b = blockIdx.x; b < args.batch; b += gridDim.x) {
    verify::FinalDraw fd;
    verify::walk_sequence<BlockExec, T, Q>(ex, args, b, fd);
    if (ex.leader()) ws.draws[b] = fd;
    // fd.form is the same in every thread (the walk's control flow is). The last writes of
    // chunk_max / chunk_scale / sums0 were in collectives that end with a barrier.
    if (fd.form != verify::kFinalNone) {
      const int64_t at = b * ws.chunks;
      for (int c = threadIdx.x; c < ws.chunks; c += kThreads) {
        if constexpr (!verify::IsProb<T>::value) {
          ws.chunk_max[at + c] = shared.chunk_max[c];
          ws.chunk_scale[at + c] = shared.chunk_scale[c];
        }
        if (fd.form == verify::kFinalRow) ws.sums[at + c] = shared.sums0[c];
      }
    }
    // The next sequence's collectives overwrite the shared arrays read above.
    __syncthreads();
  }
}

// ---- sampling_probs: one block per row ---------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(kThreads) distribution_kernel(verify::DistributionArgs args) {
  SD_SHARED(BlockShared, shared);
  BlockExec ex(&shared);
  for (int64_t b = blockIdx.x; b < args.batch; b += gridDim.x) {
    verify::distribution_sequence<BlockExec, T>(ex, args, b);
    // The next row's collectives overwrite the shared arrays this row's writes read.
    __syncthreads();
  }
}

// ---- phases 2 and 3: eight threads per chunk
// -----------------------------------------------------
constexpr int kLaneThreads = 128;
constexpr int kLaneGroups = kLaneThreads / 8;  // chunks taken at once by a block
static_assert(kLaneThreads % 32 == 0, "whole warps");

// The executor of the final draw's phases: each chunk's canonical sum is taken by a group of 8
// consecutive threads (aligned within a warp), thread j of the group adding lane j
// (verify::canonical_lane_sum); the group's first thread gathers the eight lanes and combines
// them in the canonical order (verify::combine_lanes, verify::canonical_finish), so the sums are
// chunk_sum's bit for bit. range_sums starts and ends with a barrier: phase 3 reads `out` before
// and after its fallback passes.
class LaneExec {
 public:
  __device__ bool leader() const { return threadIdx.x == 0; }

  template <class F>
  __device__ void range_sums(int64_t n, const F& f, int c_begin, int c_end, float* out) {
    __syncthreads();
    const int lane = static_cast<int>(threadIdx.x & 7u);
    // The 8 threads of this group within the warp; they iterate over the same chunks, so each
    // shuffle below is reached by all of them (other groups of the warp may have left the loop).
    const unsigned group_mask = 0xffu << (threadIdx.x & 24u);
    for (int c = c_begin + static_cast<int>(threadIdx.x >> 3); c < c_end; c += kLaneGroups) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      const int64_t end = begin + verify::kChunk < n ? begin + verify::kChunk : n;
      const float mine = verify::canonical_lane_sum(f, begin, end, lane);
      float lanes[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) lanes[j] = __shfl_sync(group_mask, mine, j, 8);
      if (lane == 0) out[c] = verify::canonical_finish(f, verify::combine_lanes(lanes), begin);
    }
    __syncthreads();
  }
};

// Copies sequence b's FinalDraw into the block's shared copy (32-bit words, all threads), between
// barriers: the first keeps it from overwriting what the previous item still reads.
__device__ void load_draw(const verify::FinalDraw* src, verify::FinalDraw* dst) {
  constexpr int kWords = static_cast<int>(sizeof(verify::FinalDraw) / 4);
  __syncthreads();
  const uint32_t* from = reinterpret_cast<const uint32_t*>(src);
  uint32_t* to = reinterpret_cast<uint32_t*>(dst);
  for (int w = threadIdx.x; w < kWords; w += blockDim.x) to[w] = from[w];
  __syncthreads();
}

// Phase 2: one block per (sequence, slice): the canonical chunk sums of the draw's distribution
// over the slice's chunks (verify::final_chunk_sums). Blocks stride over the B * slices items.
template <class T, class Q>
__global__ void __launch_bounds__(kLaneThreads)
    final_sums_kernel(verify::VerifyArgs args, verify::FinalWorkspace ws, int slices) {
  SD_SHARED(verify::FinalDraw, fd);
  LaneExec ex;
  const int64_t items = args.batch * slices;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t b = item / slices;
    const int s = static_cast<int>(item % slices);
    load_draw(ws.draws + b, &fd);
    int c_begin = 0, c_end = 0;
    verify::slice_chunks(ws.chunks, slices, s, &c_begin, &c_end);
    // Uniform over the block (fd is shared); a draw with no pass, or an empty slice, skips.
    if (!verify::final_needs_sums(fd.form) || c_begin >= c_end) continue;
    verify::final_chunk_sums<LaneExec, T, Q>(ex, args, b, fd, ws.rows(b), c_begin, c_end);
  }
}

// Phase 3: one block per sequence: the total in chunk order, the checks and fallbacks, the pick
// and the outputs (verify::finish_sequence).
template <class T, class Q>
__global__ void __launch_bounds__(kLaneThreads)
    final_pick_kernel(verify::VerifyArgs args, verify::FinalWorkspace ws) {
  SD_SHARED(verify::FinalDraw, fd);
  LaneExec ex;
  for (int64_t b = blockIdx.x; b < args.batch; b += gridDim.x) {
    load_draw(ws.draws + b, &fd);
    verify::finish_sequence<LaneExec, T, Q>(ex, args, b, fd, ws.rows(b));
  }
}

// Grid sizes: at most this many blocks (they stride over the rest), far below gridDim.x's limit.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
inline unsigned grid_for(int64_t items) {
  return static_cast<unsigned>(items < kMaxBlocks ? items : kMaxBlocks);
}

// The three phases, in order on the caller's stream (each reads what the previous one wrote).
template <class T, class Q>
cudaError_t launch(const verify::VerifyArgs& args, void* workspace, int slices,
                   cudaStream_t stream) {
  const verify::FinalWorkspace ws = verify::final_workspace_at(workspace, args.batch, args.vocab);
  // More slices than chunks would only add empty blocks.
  const int used = slices < ws.chunks ? slices : ws.chunks;
  SD_LAUNCH(grid_for(args.batch), kThreads, 0, stream, walk_kernel<T, Q>)(args, ws);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SD_LAUNCH(grid_for(args.batch * used), kLaneThreads, 0, stream, final_sums_kernel<T, Q>)(args, ws,
                                                                                           used);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SD_LAUNCH(grid_for(args.batch), kLaneThreads, 0, stream, final_pick_kernel<T, Q>)(args, ws);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_draft(const verify::VerifyArgs& args, int draft_dtype, void* workspace,
                         int slices, cudaStream_t stream) {
  switch (draft_dtype) {
    case 1:
      return launch<T, verify::Half>(args, workspace, slices, stream);
    case 2:
      return launch<T, verify::BFloat16>(args, workspace, slices, stream);
    default:
      return launch<T, float>(args, workspace, slices, stream);
  }
}

// Rows of probabilities are their own element type (no exp in their loops), as on the CPU.
template <class E>
cudaError_t launch_target(const verify::VerifyArgs& args, int draft_dtype, void* workspace,
                          int slices, cudaStream_t stream) {
  if (args.logits) return launch_draft<E>(args, draft_dtype, workspace, slices, stream);
  return launch_draft<verify::Prob<E>>(args, draft_dtype, workspace, slices, stream);
}

template <class E>
cudaError_t launch_distribution(const verify::DistributionArgs& args, cudaStream_t stream) {
  if (args.logits) {
    SD_LAUNCH(grid_for(args.batch), kThreads, 0, stream, distribution_kernel<E>)(args);
  } else {
    SD_LAUNCH(grid_for(args.batch), kThreads, 0, stream,
              distribution_kernel<verify::Prob<E>>)(args);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t sampling_distribution(const verify::DistributionArgs& args, int dtype,
                                  cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  switch (dtype) {
    case 1:
      return launch_distribution<verify::Half>(args, stream);
    case 2:
      return launch_distribution<verify::BFloat16>(args, stream);
    default:
      return launch_distribution<float>(args, stream);
  }
}

cudaError_t verify(const verify::VerifyArgs& args, int target_dtype, int draft_dtype,
                   void* workspace, int slices, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  if (!workspace || slices < 1) return cudaErrorInvalidValue;
  switch (target_dtype) {
    case 1:
      return launch_target<verify::Half>(args, draft_dtype, workspace, slices, stream);
    case 2:
      return launch_target<verify::BFloat16>(args, draft_dtype, workspace, slices, stream);
    default:
      return launch_target<float>(args, draft_dtype, workspace, slices, stream);
  }
}

}  // namespace cuda
}  // namespace sd
