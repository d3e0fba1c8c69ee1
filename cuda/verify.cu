#include <cstdint>

#include "specdecode/verify.h"
#include "verify.cuh"

namespace sd {
namespace cuda {
namespace {

using verify::ScanResult;

constexpr int kThreads = 256;

struct BlockShared {
  float sums0[verify::kMaxChunks];
  float sums1[verify::kMaxChunks];
  float chunk_max[verify::kMaxChunks];
  float chunk_scale[verify::kMaxChunks];
  float red_value[kThreads];
  int64_t red_index[kThreads];
  int red_flag[kThreads];
  unsigned hist[256];
  float total;
  uint32_t prefix;
  int64_t remaining;
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

 private:
  BlockShared* sh_;
};

// One block per sequence: the walk is inherently sequential over the tree, and each node's row
// work (max, canonical chunk sums, selections) is spread over the block's threads.
template <class T, class Q>
__global__ void __launch_bounds__(kThreads) verify_kernel(verify::VerifyArgs args) {
  __shared__ BlockShared shared;
  BlockExec ex(&shared);
  verify::verify_sequence<BlockExec, T, Q>(ex, args, static_cast<int64_t>(blockIdx.x));
}

template <class T, class Q>
cudaError_t launch(const verify::VerifyArgs& args, cudaStream_t stream) {
  verify_kernel<T, Q><<<static_cast<unsigned>(args.batch), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_draft(const verify::VerifyArgs& args, int draft_dtype, cudaStream_t stream) {
  switch (draft_dtype) {
    case 1:
      return launch<T, verify::Half>(args, stream);
    case 2:
      return launch<T, verify::BFloat16>(args, stream);
    default:
      return launch<T, float>(args, stream);
  }
}

// Rows of probabilities are their own element type (no exp in their loops), as on the CPU.
template <class E>
cudaError_t launch_target(const verify::VerifyArgs& args, int draft_dtype, cudaStream_t stream) {
  if (args.logits) return launch_draft<E>(args, draft_dtype, stream);
  return launch_draft<verify::Prob<E>>(args, draft_dtype, stream);
}

}  // namespace

cudaError_t verify(const verify::VerifyArgs& args, int target_dtype, int draft_dtype,
                   cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  switch (target_dtype) {
    case 1:
      return launch_target<verify::Half>(args, draft_dtype, stream);
    case 2:
      return launch_target<verify::BFloat16>(args, draft_dtype, stream);
    default:
      return launch_target<float>(args, draft_dtype, stream);
  }
}

}  // namespace cuda
}  // namespace sd
