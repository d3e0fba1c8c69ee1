// Tree-masked attention on the GPU, flash-decoding style.
//
// Kernel 1 (attend): a thread block owns one KV head of one sequence, one range of the prefix
// (its split) and up to kRowsPerBlock of the T x (Hq / Hkv) query rows that share the head; it
// streams the range through shared memory in tiles of 32 keys (16-byte loads where the cache's
// layout allows), so each key is read from global memory once per block and used by every row of
// the block. A warp serves kRowsPerWarp rows, spread so that a small group fills every warp:
// for scores, lane j takes key j of the tile; for the output, lane i takes dims i, i + 32, ...
// The last split also runs the masked tree part. Prefix and tree keep separate online-softmax
// states, merged with the log-sum-exp rule of specdecode/attention.h (the same functions the CPU
// runs). Kernel 2 (merge) folds the splits' partials in split order.
//
// For fp16 / bf16 caches on 16-byte boundaries on sm_80 and newer, kernel 1 is attend_mma_kernel
// instead: the same split of the work, with both products (Q K^T and P V) on the tensor cores
// (mma.sync m16n8k16, float accumulators) and the K/V tiles fetched asynchronously (cp.async) into
// two shared-memory stages, so the next tile is in flight while the current one is used.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "specdecode/attention.h"
#include "specdecode/host_device.h"

namespace sd {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kTile = 32;  // keys per shared-memory tile: one per lane
constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;

template <AttnDType DT>
struct Elem;
// load / store: one element as float; word: the elements of a 32-bit word of memory (one float
// or two 16-bit values, low half first), as floats in memory order.
template <>
struct Elem<AttnDType::kFloat32> {
  using T = float;
  static __device__ float load(const T* p) { return *p; }
  static __device__ T store(float f) { return f; }
  static __device__ void word(uint32_t w, float* out) { out[0] = bits_to_float(w); }
};
template <>
struct Elem<AttnDType::kFloat16> {
  using T = uint16_t;
  static __device__ float load(const T* p) { return half_to_float(*p); }
  static __device__ T store(float f) { return float_to_half(f); }
  static __device__ void word(uint32_t w, float* out) {
    out[0] = half_to_float(static_cast<uint16_t>(w & 0xffffu));
    out[1] = half_to_float(static_cast<uint16_t>(w >> 16));
  }
};
template <>
struct Elem<AttnDType::kBFloat16> {
  using T = uint16_t;
  static __device__ float load(const T* p) { return bf16_to_float(*p); }
  static __device__ T store(float f) { return float_to_bf16(f); }
  static __device__ void word(uint32_t w, float* out) {
    out[0] = bf16_to_float(static_cast<uint16_t>(w & 0xffffu));
    out[1] = bf16_to_float(static_cast<uint16_t>(w >> 16));
  }
};

// One 16-byte chunk of memory (p 16-byte aligned): a single 128-bit load on the GPU.
__device__ __forceinline__ uint4 load_chunk(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const uint4*>(p);
#else
  uint4 c;
  std::memcpy(&c, p, sizeof(c));
  return c;
#endif
}

// An attribute of a device (-1: the current one); 0 if the runtime cannot say. Attributes only:
// no synchronisation.
int device_attribute(cudaDeviceAttr attr, int device) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return 0;
  int value = 0;
  return cudaDeviceGetAttribute(&value, attr, device) == cudaSuccess ? value : 0;
}
// mma.sync with bf16 / fp16 inputs and cp.async: sm_80 and newer.
bool has_tensor_core_mma(int device) {
  return device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 8;
}

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ float warp_max(float x) {
  for (int o = kWarp / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = kWarp / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

struct Params {
  AttentionArgs a;
  int splits;
  int row_tiles;
  int row_groups;  // attend_mma_kernel: 16-row groups of query rows per block (1, 2, 4 or 8)
  int words;
  bool vec_kv;  // K and V rows start on 16-byte boundaries: tiles move in 16-byte chunks
  float* part_o;
  float* part_lse;
};

// Row r of a block's kRowsPerBlock query rows is row r / kWarps of warp r % kWarps: the rows of
// a small group (decoding: T = 1, Hq / Hkv rows) land on different warps and run in parallel.
__device__ __forceinline__ int block_row(int warp, int i) { return i * kWarps + warp; }

// Shared memory: K tile [kTile][D + 1] (padded: lane j reads row j, so rows must fall in
// different banks), V tile [kTile][D], query rows [kRowsPerBlock][D], all float.
template <int D>
constexpr int smem_floats() {
  return kTile * (D + 1) + kTile * D + kRowsPerBlock * D;
}

// Copies keys [j0, j0 + n) of K and V (row stride rs) into the shared tiles as floats; rows n ..
// kTile - 1 become zero. With vec, a thread moves 16-byte chunks and issues all its loads before
// its first shared store, so a tile costs one memory round trip, not one per element it holds.
template <int D, AttnDType DT>
__device__ __forceinline__ void load_tile(const typename Elem<DT>::T* k,
                                          const typename Elem<DT>::T* v, int64_t rs, int64_t j0,
                                          int n, bool vec, float* ks, float* vs) {
  using T = typename Elem<DT>::T;
  constexpr int kThreads = kWarps * kWarp;
  if (vec) {
    constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
    constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
    static_assert(D % kPerChunk == 0, "a head's row is a whole number of 16-byte chunks");
    constexpr int kChunksPerRow = D / kPerChunk;
    constexpr int kChunks = kTile * kChunksPerRow;
    constexpr int kLoads = (kChunks + kThreads - 1) / kThreads;
    uint4 kc[kLoads], vc[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int c = static_cast<int>(threadIdx.x) + u * kThreads;
      const int j = c / kChunksPerRow, d0 = c % kChunksPerRow * kPerChunk;
      kc[u] = vc[u] = uint4{0u, 0u, 0u, 0u};
      if (c < kChunks && j < n) {
        kc[u] = load_chunk(k + (j0 + j) * rs + d0);
        vc[u] = load_chunk(v + (j0 + j) * rs + d0);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int c = static_cast<int>(threadIdx.x) + u * kThreads;
      if (c >= kChunks) continue;
      const int j = c / kChunksPerRow, d0 = c % kChunksPerRow * kPerChunk;
      const uint32_t kw[4] = {kc[u].x, kc[u].y, kc[u].z, kc[u].w};
      const uint32_t vw[4] = {vc[u].x, vc[u].y, vc[u].z, vc[u].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float kf[kPerWord], vf[kPerWord];
        Elem<DT>::word(kw[w], kf);
        Elem<DT>::word(vw[w], vf);
#pragma unroll
        for (int e = 0; e < kPerWord; ++e) {
          ks[j * (D + 1) + d0 + w * kPerWord + e] = kf[e];
          vs[j * D + d0 + w * kPerWord + e] = vf[e];
        }
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < kTile * D; e += kThreads) {
    const int j = e / D, d = e % D;
    float kv = 0.0f, vv = 0.0f;
    if (j < n) {
      kv = Elem<DT>::load(k + (j0 + j) * rs + d);
      vv = Elem<DT>::load(v + (j0 + j) * rs + d);
    }
    ks[j * (D + 1) + d] = kv;
    vs[j * D + d] = vv;
  }
}

// Streams keys [begin, end) (relative to `k`/`v`, which point at position 0 of the range's
// origin for this head) through the online softmax of the warp's rows. tree: the keys are tree
// nodes and use the mask; otherwise every key < end is visible.
template <int D, AttnDType DT>
__device__ __forceinline__ void attend_range(const Params& p, const typename Elem<DT>::T* k,
                                             const typename Elem<DT>::T* v, int64_t begin,
                                             int64_t end, bool tree, const uint32_t* mask_b,
                                             const int* row_t, const bool* row_ok, float* ks,
                                             float* vs, const float* qs, SoftmaxState* st,
                                             float (*acc)[(D + kWarp - 1) / kWarp]) {
  constexpr int kNV = (D + kWarp - 1) / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t rs = p.a.kv_strides[1];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    st[i] = softmax_init();
#pragma unroll
    for (int c = 0; c < kNV; ++c) acc[i][c] = 0.0f;
  }
  for (int64_t j0 = begin; j0 < end; j0 += kTile) {
    const int n = static_cast<int>(min64(kTile, end - j0));
    __syncthreads();  // the previous tile is no longer read
    load_tile<D, DT>(k, v, rs, j0, n, p.vec_kv, ks, vs);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = block_row(warp, i);
      if (!row_ok[i]) continue;  // uniform across the warp
      const float* q = qs + r * D;
      const int j = lane;
      bool visible = j < n;
      if (tree && visible) {
        const uint32_t* mrow = mask_b ? mask_b + static_cast<int64_t>(row_t[i]) * p.words : nullptr;
        visible = tree_key_visible(mrow, row_t[i], static_cast<int>(j0 + j));
      }
      float s = -INFINITY;
      if (visible) {
        float dot = 0.0f;
        const float* kr = ks + j * (D + 1);
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot = fmaf(q[d], kr[d], dot);
        s = dot;
      }
      const float alpha = softmax_rescale(&st[i], warp_max(s));
      const float prob = exp2f(s - softmax_reference(st[i].m));  // 0 for masked keys
      st[i].l += warp_sum(prob);
#pragma unroll
      for (int c = 0; c < kNV; ++c) acc[i][c] *= alpha;
      for (int jj = 0; jj < n; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, prob, jj);
        if (pj == 0.0f) continue;  // uniform: pj is the same in every lane
        const float* vr = vs + jj * D;
#pragma unroll
        for (int c = 0; c < kNV; ++c) {
          const int d = lane + c * kWarp;
          if (d < D) acc[i][c] = fmaf(pj, vr[d], acc[i][c]);
        }
      }
    }
  }
}

// kMinBlocks: blocks per SM the registers must allow (launch bounds). 1 leaves the compiler free
// (decoding: few rows per block, memory-bound, and the 16-byte tile loads want registers); 2
// caps them at 128 per thread, for blocks of many rows, whose compute wants two blocks per SM.
template <int D, AttnDType DT, int kMinBlocks>
__global__ void __launch_bounds__(kWarps* kWarp, kMinBlocks) attend_kernel(Params p) {
  using T = typename Elem<DT>::T;
  constexpr int kNV = (D + kWarp - 1) / kWarp;
  SD_DYNAMIC_SHARED(float, smem);
  float* ks = smem;
  float* vs = ks + kTile * (D + 1);
  float* qs = vs + kTile * D;

  const AttentionArgs& a = p.a;
  const int64_t b = blockIdx.z, kvh = blockIdx.y;
  const int tile = blockIdx.x % p.row_tiles, split = blockIdx.x / p.row_tiles;
  const int64_t g = a.q_heads / a.kv_heads;
  const int64_t rows = a.tree_len * g;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  const int64_t prefix = a.prefix_lens[b];
  const bool ok = prefix >= 0 && prefix + a.tree_len <= a.cache_len;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) a.status[b] = ok ? 0 : 1;

  // Query rows of this block, scaled into the log2 domain.
  const T* q = static_cast<const T*>(a.q);
  const float mult = a.scale * kLog2e;
  for (int e = threadIdx.x; e < kRowsPerBlock * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    const int64_t rr = static_cast<int64_t>(tile) * kRowsPerBlock + r;
    float x = 0.0f;
    if (rr < rows) {
      const int64_t t = rr / g, h = kvh * g + rr % g;
      x = Elem<DT>::load(q + b * a.q_strides[0] + t * a.q_strides[1] + h * a.q_strides[2] + d) *
          mult;
    }
    qs[e] = x;
  }
  int row_t[kRowsPerWarp];
  bool row_ok[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t rr = static_cast<int64_t>(tile) * kRowsPerBlock + block_row(warp, i);
    row_ok[i] = ok && rr < rows;
    row_t[i] = static_cast<int>(rr / g);
  }

  // This split's prefix range; the last split also takes the tree.
  const int64_t chunk = ok ? ((prefix + p.splits - 1) / p.splits + kTile - 1) / kTile * kTile : 0;
  const int64_t kb = min64(prefix, split * chunk), ke = min64(prefix, kb + chunk);
  const bool last = split == p.splits - 1;
  const T* kbase = static_cast<const T*>(a.k) + b * a.kv_strides[0] + kvh * a.kv_strides[2];
  const T* vbase = static_cast<const T*>(a.v) + b * a.kv_strides[0] + kvh * a.kv_strides[2];

  SoftmaxState st_p[kRowsPerWarp], st_t[kRowsPerWarp];
  float acc_p[kRowsPerWarp][kNV], acc_t[kRowsPerWarp][kNV];
  attend_range<D, DT>(p, kbase, vbase, ok ? kb : 0, ok ? ke : 0, false, nullptr, row_t, row_ok, ks,
                      vs, qs, st_p, acc_p);
  const int64_t rs = a.kv_strides[1];
  const uint32_t* mask_b = a.mask ? a.mask + b * a.tree_len * p.words : nullptr;
  attend_range<D, DT>(p, kbase + (ok ? prefix : 0) * rs, vbase + (ok ? prefix : 0) * rs, 0,
                      ok && last ? a.tree_len : 0, true, mask_b, row_t, row_ok, ks, vs, qs, st_t,
                      acc_t);

#pragma unroll

  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t rr = static_cast<int64_t>(tile) * kRowsPerBlock + block_row(warp, i);
    if (rr >= rows) continue;
    float inv_p, inv_t;
    const float lse_p = softmax_finish(st_p[i], &inv_p);
    const float lse_t = softmax_finish(st_t[i], &inv_t);
    float wp, wt;
    const float lse = lse_merge_weights(lse_p, lse_t, &wp, &wt);
    wp *= inv_p;
    wt *= inv_t;
    const int64_t t = rr / g, h = kvh * g + rr % g;
    const int64_t row = (b * a.tree_len + t) * a.q_heads + h;
    if (p.splits == 1) {
      T* out = static_cast<T*>(a.out) + row * D;
#pragma unroll
      for (int c = 0; c < kNV; ++c) {
        const int d = lane + c * kWarp;
        if (d < D) out[d] = Elem<DT>::store(wp * acc_p[i][c] + wt * acc_t[i][c]);
      }
      if (a.lse && lane == 0) a.lse[row] = lse * kLn2;
    } else {
      const int64_t prow = static_cast<int64_t>(split) * a.batch * a.tree_len * a.q_heads + row;
      float* po = p.part_o + prow * D;
#pragma unroll
      for (int c = 0; c < kNV; ++c) {
        const int d = lane + c * kWarp;
        if (d < D) po[d] = wp * acc_p[i][c] + wt * acc_t[i][c];
      }
      if (lane == 0) p.part_lse[prow] = lse;
    }
  }
}

// ---- tensor-core path (fp16 / bf16, sm_80+) ---------------------------------------------------
//
// A block has kMmaWarps warps and owns p.row_groups groups of 16 query rows of one KV head (1,
// 2, 4 or 8; see mma_row_groups). With up to four, warp w serves row group w % row_groups and,
// of every tile of keys, the chunks c with c % parts == w / row_groups (parts = kMmaWarps /
// row_groups): a decoding step's few rows keep all four warps busy on different keys. With
// eight, each warp serves two row groups (kGroups 2) and every chunk. Each warp keeps one
// online-softmax state per row across its keys; prefix keys are all visible, keys at prefix + j
// are tree node j and follow the mask (one running state over both ranges is the same
// log-sum-exp merge, applied key by key). A tile of prefix keys alone skips the mask test
// (kMasked false): on an H100 that test and the rescale of the output, not the products, held
// the T 64 kernel (bench/RESULTS.md, session 31). At the end the parts of a row group merge
// through shared memory with lse_merge_weights, in part order.
//
// Per chunk of 8 kHalves keys a warp computes S = Q K^T (16 x 8 kHalves, D / 16 k-steps of
// kHalves m16n8k16 products), scales and masks it in the accumulator layout, and multiplies P
// (rounded to the input type) by V (kHalves / 2 x D / 8 products). The accumulator layout of two
// adjacent 8-key halves of S is exactly the A-fragment layout of P (see mma.cuh), so P never
// leaves the registers. A chunk is 16 keys (kHalves 2) where a block's warps share a row group
// and split the tile's chunks among them (few rows: decoding), and 32 keys (kHalves 4) where each
// warp owns a row group and takes every chunk: then a k-step of Q K^T issues four independent
// products instead of two, against the chain of dependent ones that stalls a warp (Nsight
// Compute at T 64, bench/RESULTS.md), and the output is rescaled once per 32 keys.

constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16;  // rows of one m16n8k16 product: one row group

// Keys per shared-memory tile: two stages of K and V tiles fit the 99 KiB an sm_86 / sm_89 block
// may use, for every head dim.
constexpr int mma_tile_keys(int d) { return d > 128 ? 32 : 64; }
// 16-bit elements between two rows of a shared tile: 16 bytes of padding put the eight rows a
// fragment load touches on different banks.
constexpr int mma_pitch(int d) { return d + 8; }
constexpr int mma_stage_elems(int d) {
  return 2 * mma_tile_keys(d) * mma_pitch(d);  // K tile, then V tile
}
// The parts' finished partials, written over the stages once the keys are done.
constexpr int mma_merge_bytes(int d) {
  return kMmaWarps * kMmaRows * (d + 1) * static_cast<int>(sizeof(float));
}
constexpr size_t mma_smem_bytes(int d, int row_groups) {
  return (2 * static_cast<size_t>(mma_stage_elems(d)) +
          static_cast<size_t>(row_groups) * kMmaRows * mma_pitch(d)) *
         sizeof(uint16_t);
}
static_assert(mma_merge_bytes(256) <= 2 * mma_stage_elems(256) * 2 &&
                  mma_merge_bytes(128) <= 2 * mma_stage_elems(128) * 2,
              "the merge area fits the stages");
// Two row groups per warp: the accumulators of 32 rows fit the registers up to D 128.
constexpr bool mma_two_groups_fit(int d) { return d <= 128; }

// Row groups per block of attend_mma_kernel for `rows` query rows per KV head and `heads` KV
// heads in all (B x Hkv). Up to one per warp. More rows than that take two per warp (128-row
// blocks: each K and V fragment serves both groups) where the head dim allows, the block's
// shared memory fits the device (227 KiB on sm_90, 163 on sm_80; not the 99 KiB of sm_86 /
// sm_89 at D 128), and the 64-row blocks would fill every SM's two slots at least twice: on an
// H100 (bench/RESULTS.md, session 31) 128-row blocks took 7-13 % less time at B 32 T 64, where
// the 64-row grid is 7.8 times the SMs, but 8-48 % more at B 1-8 S 512-4096 (0.2-1.9 times,
// 10 % less at B 8 S 16384), where halving the blocks leaves SMs idle.
int mma_row_groups(int64_t heads, int64_t rows, int head_dim, int device) {
  if (rows <= kMmaRows) return 1;
  if (rows <= 2 * kMmaRows) return 2;
  const int64_t blocks = heads * ((rows + kMmaWarps * kMmaRows - 1) / (kMmaWarps * kMmaRows));
  const bool two =
      mma_two_groups_fit(head_dim) && rows > kMmaWarps * kMmaRows &&
      blocks >=
          4 * static_cast<int64_t>(device_attribute(cudaDevAttrMultiProcessorCount, device)) &&
      mma_smem_bytes(head_dim, 2 * kMmaWarps) <=
          static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return two ? 2 * kMmaWarps : kMmaWarps;
}

// Starts the copies of keys [j0, j0 + n) of K and V into one stage; rows n .. kKeys - 1 are
// zeroed (their scores are masked, and a zero value keeps 0 * V finite in the P V product).
template <int D>
__device__ __forceinline__ void mma_load_tile(const uint16_t* k, const uint16_t* v, int64_t rs,
                                              int64_t j0, int n, uint16_t* stage) {
  constexpr int kKeys = mma_tile_keys(D), kPitch = mma_pitch(D);
  constexpr int kChunksPerRow = D / 8;
  uint16_t* ks = stage;
  uint16_t* vs = stage + kKeys * kPitch;
  for (int e = threadIdx.x; e < kKeys * kChunksPerRow; e += kMmaWarps * kWarp) {
    const int j = e / kChunksPerRow, d0 = e % kChunksPerRow * 8;
    uint16_t* kd = ks + j * kPitch + d0;
    uint16_t* vd = vs + j * kPitch + d0;
    if (j < n) {
      cp_async_16(kd, k + (j0 + j) * rs + d0);
      cp_async_16(vd, v + (j0 + j) * rs + d0);
    } else {
      *reinterpret_cast<uint4*>(kd) = uint4{0u, 0u, 0u, 0u};
      *reinterpret_cast<uint4*>(vd) = uint4{0u, 0u, 0u, 0u};
    }
  }
}

// What a lane knows of its two query rows (g and g + 8 of its warp's row group).
struct MmaRows {
  bool valid[2];
  int node[2];              // tree node of the row's query
  const uint32_t* mask[2];  // its mask row (null: causal chain)
};

// One chunk (keys kc .. kc + 8 kHalves - 1 of the tile that starts at key j0) for one warp's
// kGroups row groups (16 kGroups rows, the groups' Q one after the other at qs): S = Q K^T,
// masking, the online-softmax update of st, and o += P V. A warp of two row groups loads each K
// and V fragment once for both: half the shared-memory reads per product, and twice the
// independent products between one load and the next.
template <int D, AttnDType DT, int kHalves, int kGroups, bool kMasked>
__device__ __forceinline__ void mma_chunk(const uint16_t* qs, const uint16_t* ks,
                                          const uint16_t* vs, int kc, int64_t j0, int n,
                                          int64_t prefix, float mult, const MmaRows* rows,
                                          SoftmaxState (*st)[2], float (*o)[D / 8][4]) {
  constexpr bool kBF16 = DT == AttnDType::kBFloat16;
  constexpr int kPitch = mma_pitch(D);
  const int lane = threadIdx.x % kWarp, t = lane % 4;

  static_assert(kHalves == 2 || kHalves == 4, "a chunk is one or two k-steps of P V");
  static_assert(kGroups == 1 || kGroups == 2, "a warp serves one or two row groups");
  // The fragments come from shared memory by ldmatrix.x4, lane l addressing row l % 8 of matrix
  // l / 8. Q: matrices (rows 0-7 | 8-15) x (dims d0 | d0 + 8) in the order of a's registers; K:
  // (keys kk | kk + 8) x (dims d0 | d0 + 8) for each 16 keys kk of the chunk, each key half's pair
  // a B fragment; V (transposed): (keys kk | kk + 8) x (dims of n-tiles nd | nd + 1).
  const int lrow = lane % 8 + 8 * (lane / 8 % 2), lcol = 8 * (lane / 16);
  const uint16_t* q_at = qs + lrow * kPitch + lcol;
  const uint16_t* k_at = ks + (kc + lane % 8 + 8 * (lane / 16)) * kPitch + 8 * (lane / 8 % 2);
  const uint16_t* v_at = vs + (kc + lrow) * kPitch + lcol;

  float s[kGroups][kHalves][4];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[gi][h][i] = 0.0f;
    }
  }
#pragma unroll
  for (int d0 = 0; d0 < D; d0 += 16) {
    uint32_t a[kGroups][4];
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
      ldmatrix_x4<false>(a[gi], q_at + gi * kMmaRows * kPitch + d0);
    }
#pragma unroll
    for (int h = 0; h < kHalves; h += 2) {
      uint32_t kf[4];
      ldmatrix_x4<false>(kf, k_at + 8 * h * kPitch + d0);
#pragma unroll
      for (int gi = 0; gi < kGroups; ++gi) {
        mma_m16n8k16<kBF16>(s[gi][h], a[gi], kf);
        mma_m16n8k16<kBF16>(s[gi][h + 1], a[gi], kf + 2);
      }
    }
  }

  // s[gi][h][i] is the score of row lane / 4 + 8 (i / 2) of group gi and key
  // kc + 8 h + 2 t + i % 2.
  float p[kGroups][kHalves][4];
  float alpha[kGroups][2];
  bool rescale = false;
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          bool visible = true;
          if constexpr (kMasked) {
            const int key = kc + 8 * h + 2 * t + c;
            const int64_t pos = j0 + key;
            visible = rows[gi].valid[r] && key < n;
            if (visible && pos >= prefix) {
              visible = tree_key_visible(rows[gi].mask[r], rows[gi].node[r],
                                         static_cast<int>(pos - prefix));
            }
          }
          const float x = visible ? s[gi][h][2 * r + c] * mult : -INFINITY;
          s[gi][h][2 * r + c] = x;
          mx = fmaxf(mx, x);
        }
      }
      // The row's scores in the chunk are spread over the four lanes of its group.
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      alpha[gi][r] = softmax_rescale(&st[gi][r], mx);  // st.l: this lane's share of the sum
      const float ref = softmax_reference(st[gi][r].m);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          p[gi][h][2 * r + c] = exp2f(s[gi][h][2 * r + c] - ref);  // 0 for a masked key
          st[gi][r].l += p[gi][h][2 * r + c];
        }
      }
      rescale = rescale || alpha[gi][r] != 1.0f;  // NaN too
    }
  }
  // Once the running maxima settle, alpha is 1 in every row of the warp: the accumulators
  // (D / 2 products per lane and row group) are left alone then.
  if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        o[gi][nd][0] *= alpha[gi][0];
        o[gi][nd][1] *= alpha[gi][0];
        o[gi][nd][2] *= alpha[gi][1];
        o[gi][nd][3] *= alpha[gi][1];
      }
    }
  }

  static_assert(D % 16 == 0, "V's n-tiles are loaded in pairs");
#pragma unroll
  for (int h = 0; h < kHalves; h += 2) {
    // P's keys kc + 8 h .. kc + 8 h + 15 as the A fragment of a 16 x 16 (rows x keys) product.
    uint32_t pa[kGroups][4];
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
      pa[gi][0] = pack_halves(Elem<DT>::store(p[gi][h][0]), Elem<DT>::store(p[gi][h][1]));
      pa[gi][1] = pack_halves(Elem<DT>::store(p[gi][h][2]), Elem<DT>::store(p[gi][h][3]));
      pa[gi][2] = pack_halves(Elem<DT>::store(p[gi][h + 1][0]), Elem<DT>::store(p[gi][h + 1][1]));
      pa[gi][3] = pack_halves(Elem<DT>::store(p[gi][h + 1][2]), Elem<DT>::store(p[gi][h + 1][3]));
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; nd += 2) {
      uint32_t vf[4];
      ldmatrix_x4<true>(vf, v_at + 8 * h * kPitch + nd * 8);
#pragma unroll
      for (int gi = 0; gi < kGroups; ++gi) {
        mma_m16n8k16<kBF16>(o[gi][nd], pa[gi], vf);
        mma_m16n8k16<kBF16>(o[gi][nd + 1], pa[gi], vf + 2);
      }
    }
  }
}

// Writes one finished row: the output (or the split's partial) and its lse (log2 domain in).
template <int D, AttnDType DT>
__device__ __forceinline__ void mma_store_row(const Params& p, int64_t row, int split, int d,
                                              float o0, float o1, bool with_lse, float lse) {
  using T = typename Elem<DT>::T;
  const AttentionArgs& a = p.a;
  if (p.splits == 1) {
    T* out = static_cast<T*>(a.out) + row * D + d;
    out[0] = Elem<DT>::store(o0);
    out[1] = Elem<DT>::store(o1);
    if (a.lse && with_lse) a.lse[row] = lse * kLn2;
  } else {
    const int64_t prow = static_cast<int64_t>(split) * a.batch * a.tree_len * a.q_heads + row;
    float* po = p.part_o + prow * D + d;
    po[0] = o0;
    po[1] = o1;
    if (with_lse) p.part_lse[prow] = lse;
  }
}

// kGroups: row groups per warp. 2 only where each warp owns its groups (p.row_groups ==
// kGroups * kMmaWarps, parts == 1), so the merge of parts below is for kGroups == 1 alone.
template <int D, AttnDType DT, int kHalves, int kGroups>
__global__ void __launch_bounds__(kMmaWarps* kWarp) attend_mma_kernel(Params p) {
  constexpr int kKeys = mma_tile_keys(D), kPitch = mma_pitch(D);
  constexpr int kChunkKeys = 8 * kHalves, kChunks = kKeys / kChunkKeys, kNT = D / 8;
  static_assert(kKeys % kChunkKeys == 0, "a tile holds whole chunks");
  SD_DYNAMIC_SHARED(uint4, smem16);
  uint16_t* stages = reinterpret_cast<uint16_t*>(smem16);
  uint16_t* qs = stages + 2 * mma_stage_elems(D);

  const AttentionArgs& a = p.a;
  const int64_t b = blockIdx.z, kvh = blockIdx.y;
  const int tile = blockIdx.x % p.row_tiles, split = blockIdx.x / p.row_tiles;
  // owners: the warps that share out the block's row groups, kGroups each; parts: the warps
  // that share one row group's keys.
  const int groups = p.row_groups, owners = groups / kGroups, parts = kMmaWarps / owners;
  const int64_t gq = a.q_heads / a.kv_heads, rows = a.tree_len * gq;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int group0 = warp % owners * kGroups, part = warp / owners;
  const int g = lane / 4, t = lane % 4;
  const int64_t block_row0 = static_cast<int64_t>(tile) * groups * kMmaRows;

  const int64_t prefix = a.prefix_lens[b];
  const bool ok = prefix >= 0 && prefix + a.tree_len <= a.cache_len;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) a.status[b] = ok ? 0 : 1;

  // The block's query rows, as they are (the scale is applied to the float scores).
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  for (int e = threadIdx.x; e < groups * kMmaRows * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    const int64_t rr = block_row0 + r;
    uint16_t x = 0;
    if (rr < rows) {
      const int64_t tq = rr / gq, h = kvh * gq + rr % gq;
      x = q[b * a.q_strides[0] + tq * a.q_strides[1] + h * a.q_strides[2] + d];
    }
    qs[r * kPitch + d] = x;
  }
  // Row r of row group gi of this warp: block row row_of(gi, r).
  const auto row_of = [&](int gi, int r) {
    return block_row0 + (group0 + gi) * kMmaRows + g + 8 * r;
  };
  MmaRows mine[kGroups];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t rr = row_of(gi, r);
      mine[gi].valid[r] = ok && rr < rows;
      mine[gi].node[r] = mine[gi].valid[r] ? static_cast<int>(rr / gq) : 0;
      mine[gi].mask[r] = a.mask && mine[gi].valid[r]
                             ? a.mask + (b * a.tree_len + mine[gi].node[r]) * mask_words(a.tree_len)
                             : nullptr;
    }
  }

  // This split's keys: its range of the prefix, and for the last split the tree after it.
  const int64_t chunk = ok ? ((prefix + p.splits - 1) / p.splits + kTile - 1) / kTile * kTile : 0;
  const int64_t kb = min64(prefix, split * chunk);
  const int64_t ke = split == p.splits - 1 ? prefix + a.tree_len : min64(prefix, kb + chunk);
  const int64_t begin = ok ? kb : 0, end = ok ? ke : 0;
  const int64_t rs = a.kv_strides[1];
  const uint16_t* kbase =
      static_cast<const uint16_t*>(a.k) + b * a.kv_strides[0] + kvh * a.kv_strides[2];
  const uint16_t* vbase =
      static_cast<const uint16_t*>(a.v) + b * a.kv_strides[0] + kvh * a.kv_strides[2];
  const float mult = a.scale * kLog2e;

  SoftmaxState st[kGroups][2];
  float o[kGroups][kNT][4];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
    st[gi][0] = st[gi][1] = softmax_init();
#pragma unroll
    for (int nd = 0; nd < kNT; ++nd) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[gi][nd][i] = 0.0f;
    }
  }

  const int64_t tiles = (end - begin + kKeys - 1) / kKeys;
  if (tiles > 0) {
    mma_load_tile<D>(kbase, vbase, rs, begin, static_cast<int>(min64(kKeys, end - begin)), stages);
    cp_async_commit();
  }
  for (int64_t it = 0; it < tiles; ++it) {
    const int64_t j0 = begin + it * kKeys;
    if (it + 1 < tiles) {
      // The other stage was last read in iteration it - 1, which ended at a barrier.
      const int64_t j1 = j0 + kKeys;
      mma_load_tile<D>(kbase, vbase, rs, j1, static_cast<int>(min64(kKeys, end - j1)),
                       stages + ((it + 1) % 2) * mma_stage_elems(D));
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of tile it have landed
    const uint16_t* ks = stages + (it % 2) * mma_stage_elems(D);
    const uint16_t* vs = ks + kKeys * kPitch;
    const int n = static_cast<int>(min64(kKeys, end - j0));
    // A whole tile of prefix keys (a split's last tile may be short): every key visible to
    // every row (rows past the last are never stored), no mask to test.
    if (n == kKeys && j0 + kKeys <= prefix) {
      for (int c = part; c < kChunks; c += parts) {  // uniform in the warp
        mma_chunk<D, DT, kHalves, kGroups, false>(qs + group0 * kMmaRows * kPitch, ks, vs,
                                                  c * kChunkKeys, j0, n, prefix, mult, mine, st, o);
      }
    } else {
      for (int c = part; c < kChunks && c * kChunkKeys < n; c += parts) {
        mma_chunk<D, DT, kHalves, kGroups, true>(qs + group0 * kMmaRows * kPitch, ks, vs,
                                                 c * kChunkKeys, j0, n, prefix, mult, mine, st, o);
      }
    }
    __syncthreads();  // tile it is no longer read: its stage may be refilled
  }

  // Finish: each lane held a share of its rows' sums.
  float lse[kGroups][2];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st[gi][r].l += __shfl_xor_sync(0xffffffffu, st[gi][r].l, 1);
      st[gi][r].l += __shfl_xor_sync(0xffffffffu, st[gi][r].l, 2);
      float inv;
      lse[gi][r] = softmax_finish(st[gi][r], &inv);
#pragma unroll
      for (int nd = 0; nd < kNT; ++nd) {
        o[gi][nd][2 * r] *= inv;
        o[gi][nd][2 * r + 1] *= inv;
      }
    }
  }
  const auto out_row = [&](int64_t rr) {
    const int64_t tq = rr / gq, h = kvh * gq + rr % gq;
    return (b * a.tree_len + tq) * a.q_heads + h;
  };
  if (parts == 1) {
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t rr = row_of(gi, r);
        if (rr >= rows) continue;
#pragma unroll
        for (int nd = 0; nd < kNT; ++nd) {
          mma_store_row<D, DT>(p, out_row(rr), split, nd * 8 + 2 * t, o[gi][nd][2 * r],
                               o[gi][nd][2 * r + 1], nd == 0 && t == 0, lse[gi][r]);
        }
      }
    }
    return;
  }
  if constexpr (kGroups == 1) {
    // Several parts per row group: their partials meet in shared memory (over the stages; the
    // loop's last barrier has passed, so no thread still reads them). Row r of warp w: D floats
    // of o, then its lse.
    float* merge = reinterpret_cast<float*>(smem16);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* row = merge + (warp * kMmaRows + g + 8 * r) * (D + 1);
#pragma unroll
      for (int nd = 0; nd < kNT; ++nd) {
        row[nd * 8 + 2 * t] = o[0][nd][2 * r];
        row[nd * 8 + 2 * t + 1] = o[0][nd][2 * r + 1];
      }
      if (t == 0) row[D] = lse[0][r];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < groups * kMmaRows * (D / 2); e += blockDim.x) {
      const int gi = e / (kMmaRows * (D / 2)), r = e / (D / 2) % kMmaRows, d = e % (D / 2) * 2;
      const int64_t rr = block_row0 + gi * kMmaRows + r;
      if (rr >= rows) continue;
      float acc0 = 0.0f, acc1 = 0.0f, lse_all = -INFINITY;
      for (int k = 0; k < parts; ++k) {
        const float* row = merge + ((k * groups + gi) * kMmaRows + r) * (D + 1);
        float wa, wb;
        lse_all = lse_merge_weights(lse_all, row[D], &wa, &wb);
        acc0 = wa * acc0 + (wb != 0.0f ? wb * row[d] : 0.0f);
        acc1 = wa * acc1 + (wb != 0.0f ? wb * row[d + 1] : 0.0f);
      }
      mma_store_row<D, DT>(p, out_row(rr), split, d, acc0, acc1, d == 0, lse_all);
    }
  }
}

// One warp per (b, t, h) row: folds the splits in order with the log-sum-exp rule.
template <int D, AttnDType DT>
__global__ void merge_kernel(Params p) {
  using T = typename Elem<DT>::T;
  constexpr int kNV = (D + kWarp - 1) / kWarp;
  const AttentionArgs& a = p.a;
  const int64_t nrows = a.batch * a.tree_len * a.q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= nrows) return;
  const int lane = threadIdx.x % kWarp;
  float acc[kNV];
#pragma unroll
  for (int c = 0; c < kNV; ++c) acc[c] = 0.0f;
  float lse = -INFINITY;
  for (int s = 0; s < p.splits; ++s) {
    const int64_t prow = static_cast<int64_t>(s) * nrows + row;
    float wa, wb;
    lse = lse_merge_weights(lse, p.part_lse[prow], &wa, &wb);
    const float* po = p.part_o + prow * D;
#pragma unroll
    for (int c = 0; c < kNV; ++c) {
      const int d = lane + c * kWarp;
      if (d < D) acc[c] = wa * acc[c] + (wb != 0.0f ? wb * po[d] : 0.0f);
    }
  }
  T* out = static_cast<T*>(a.out) + row * D;
#pragma unroll
  for (int c = 0; c < kNV; ++c) {
    const int d = lane + c * kWarp;
    if (d < D) out[d] = Elem<DT>::store(acc[c]);
  }
  if (a.lse && lane == 0) a.lse[row] = lse * kLn2;
}

template <int D, AttnDType DT>
cudaError_t launch_merge(const Params& p, cudaStream_t stream) {
  if (p.splits == 1) return cudaSuccess;
  constexpr int kMergeWarps = 4;
  const AttentionArgs& a = p.a;
  const int64_t nrows = a.batch * a.tree_len * a.q_heads;
  const unsigned blocks = static_cast<unsigned>((nrows + kMergeWarps - 1) / kMergeWarps);
  SD_LAUNCH(blocks, kMergeWarps * kWarp, 0, stream, merge_kernel<D, DT>)(p);
  return cudaGetLastError();
}

template <int D, AttnDType DT, int kMinBlocks>
cudaError_t launch_cuda_cores(const Params& p, cudaStream_t stream) {
  const AttentionArgs& a = p.a;
  const size_t smem = smem_floats<D>() * sizeof(float);
  cudaError_t err =
      cudaFuncSetAttribute(attend_kernel<D, DT, kMinBlocks>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.splits), static_cast<unsigned>(a.kv_heads),
                  static_cast<unsigned>(a.batch));
  SD_LAUNCH(grid, kWarps * kWarp, smem, stream, attend_kernel<D, DT, kMinBlocks>)(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_merge<D, DT>(p, stream);
}

// The kernel for blocks of row_groups row groups (see mma_row_groups): where each warp owns its
// row groups (every chunk is its own), 32-key chunks; else 16, so that the tile's chunks go
// round all the warps.
template <int D, AttnDType DT>
void (*mma_kernel(int row_groups))(Params) {
  if constexpr (mma_two_groups_fit(D)) {
    if (row_groups == 2 * kMmaWarps) return attend_mma_kernel<D, DT, 4, 2>;
  }
  return row_groups == kMmaWarps ? attend_mma_kernel<D, DT, 4, 1> : attend_mma_kernel<D, DT, 2, 1>;
}

template <int D, AttnDType DT>
cudaError_t launch_tensor_cores(Params p, cudaStream_t stream) {
  const AttentionArgs& a = p.a;
  const int64_t rows = a.tree_len * (a.q_heads / a.kv_heads);
  p.row_groups = mma_row_groups(a.batch * a.kv_heads, rows, D, -1);
  const int64_t block_rows = static_cast<int64_t>(p.row_groups) * kMmaRows;
  p.row_tiles = static_cast<int>((rows + block_rows - 1) / block_rows);
  const auto kernel = mma_kernel<D, DT>(p.row_groups);
  const size_t smem = mma_smem_bytes(D, p.row_groups);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.splits), static_cast<unsigned>(a.kv_heads),
                  static_cast<unsigned>(a.batch));
  SD_LAUNCH(grid, kMmaWarps * kWarp, smem, stream, kernel)(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_merge<D, DT>(p, stream);
}

// The tensor-core kernel takes fp16 / bf16 caches whose rows start on 16-byte boundaries (its
// copies move 16 bytes) on devices of compute capability 8.0 or more; everything else runs on
// the CUDA cores, with two blocks per SM where a KV head has more than one block of rows.
template <int D, AttnDType DT>
cudaError_t launch(const Params& p, bool tensor_cores, cudaStream_t stream) {
  if constexpr (DT != AttnDType::kFloat32) {
    if (tensor_cores && p.vec_kv) return launch_tensor_cores<D, DT>(p, stream);
  }
  if (p.row_tiles > 1) return launch_cuda_cores<D, DT, 2>(p, stream);
  return launch_cuda_cores<D, DT, 1>(p, stream);
}

template <AttnDType DT>
cudaError_t launch_dtype(const Params& p, bool tensor_cores, cudaStream_t stream) {
  switch (p.a.head_dim) {
    case 32:
      return launch<32, DT>(p, tensor_cores, stream);
    case 64:
      return launch<64, DT>(p, tensor_cores, stream);
    case 80:
      return launch<80, DT>(p, tensor_cores, stream);
    case 96:
      return launch<96, DT>(p, tensor_cores, stream);
    case 128:
      return launch<128, DT>(p, tensor_cores, stream);
    case 256:
      return launch<256, DT>(p, tensor_cores, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// ---- compact_kv ------------------------------------------------------------------------------

__global__ void compact_validate_kernel(const int32_t* prefix_lens, const int32_t* path,
                                        int path_len, const int32_t* num_accepted, int64_t batch,
                                        int64_t cache_len, int32_t* status) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int bad = 0;
  const CompactError err = validate_compact_row(path + b * path_len, path_len, num_accepted[b],
                                                prefix_lens[b], cache_len, &bad);
  status[2 * b] = static_cast<int32_t>(err);
  status[2 * b + 1] = bad;
}

// One block per sequence. Moves run in increasing i with a barrier between them: move i may
// overwrite the source of an earlier move (never of a later one, see validate_compact_row), so
// every move must have finished reading before the next one writes.
__global__ void compact_move_kernel(char* k, char* v, int elem_size, int64_t s0, int64_t s1,
                                    int64_t s2, int64_t batch, int64_t kv_heads, int64_t head_dim,
                                    const int32_t* prefix_lens, const int32_t* path, int path_len,
                                    const int32_t* num_accepted, int32_t* new_lens,
                                    const int32_t* status) {
  const int64_t b = blockIdx.x;
  for (int64_t i = 0; i < batch; ++i) {
    if (status[2 * i] != 0) return;  // all or nothing: any invalid row cancels every move
  }
  const int64_t prefix = prefix_lens[b];
  const int32_t* row = path + b * path_len;
  const int count = num_accepted[b];
  const int64_t row_bytes = head_dim * elem_size;
  for (int i = 0; i < count; ++i) {
    const int32_t node = row[i];
    if (node != i) {
      for (int64_t e = threadIdx.x; e < 2 * kv_heads * row_bytes; e += blockDim.x) {
        char* base = e < kv_heads * row_bytes ? k : v;
        const int64_t f = e % (kv_heads * row_bytes);
        const int64_t h = f / row_bytes, byte = f % row_bytes;
        const int64_t off = (b * s0 + h * s2) * elem_size + byte;
        const char val = base[off + (prefix + node) * s1 * elem_size];
        base[off + (prefix + i) * s1 * elem_size] = val;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) new_lens[b] = static_cast<int32_t>(prefix + count);
}

}  // namespace

cudaError_t tree_attention(const AttentionArgs& args, int splits, float* part_o, float* part_lse,
                           cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  Params p;
  p.a = args;
  p.splits = std::max(1, splits);
  const int64_t rows = args.tree_len * (args.q_heads / args.kv_heads);
  p.row_tiles = static_cast<int>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  p.words = mask_words(static_cast<int>(args.tree_len));
  p.part_o = part_o;
  p.part_lse = part_lse;
  const int64_t per_chunk = args.dtype == AttnDType::kFloat32 ? 4 : 8;  // elements in 16 bytes
  p.vec_kv = reinterpret_cast<uintptr_t>(args.k) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(args.v) % 16 == 0 && args.kv_strides[0] % per_chunk == 0 &&
             args.kv_strides[1] % per_chunk == 0 && args.kv_strides[2] % per_chunk == 0;
  p.row_groups = 0;
  const bool tensor_cores = has_tensor_core_mma(-1);
  switch (args.dtype) {
    case AttnDType::kFloat32:
      return launch_dtype<AttnDType::kFloat32>(p, tensor_cores, stream);
    case AttnDType::kFloat16:
      return launch_dtype<AttnDType::kFloat16>(p, tensor_cores, stream);
    case AttnDType::kBFloat16:
      return launch_dtype<AttnDType::kBFloat16>(p, tensor_cores, stream);
  }
  return cudaErrorInvalidValue;
}

int tree_attention_block_rows(int64_t batch, int64_t kv_heads, int64_t rows, int head_dim,
                              AttnDType dtype, int device) {
  if (dtype == AttnDType::kFloat32 || !has_tensor_core_mma(device)) return kRowsPerBlock;
  return mma_row_groups(batch * kv_heads, rows, head_dim, device) * kMmaRows;
}

cudaError_t compact_kv(void* k, void* v, int elem_size, const int64_t kv_strides[3], int64_t batch,
                       int64_t cache_len, int64_t kv_heads, int64_t head_dim,
                       const int32_t* prefix_lens, const int32_t* path, int path_len,
                       const int32_t* num_accepted, int32_t* new_lens, int32_t* status,
                       cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  SD_LAUNCH(static_cast<unsigned>((batch + kThreads - 1) / kThreads), kThreads, 0, stream,
            compact_validate_kernel)(prefix_lens, path, path_len, num_accepted, batch, cache_len,
                                     status);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SD_LAUNCH(static_cast<unsigned>(batch), 256, 0, stream, compact_move_kernel)(
      static_cast<char*>(k), static_cast<char*>(v), elem_size, kv_strides[0], kv_strides[1],
      kv_strides[2], batch, kv_heads, head_dim, prefix_lens, path, path_len, num_accepted, new_lens,
      status);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace sd
