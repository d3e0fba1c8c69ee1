// Tensor-core products and asynchronous copies into shared memory (sm_80 and newer), written
// once for nvcc and for the CUDA emulator (cuda/emu), which runs the product as a warp-wide
// operation with the same fragment layout and the copy as a plain one. Launchers use these only
// on a device of compute capability 8.0 or more; a kernel built for an older architecture traps
// if it gets here anyway.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

namespace sd {
namespace cuda {

// d = a b + c for one 16 x 8 tile, k = 16, 16-bit inputs (bf16 or fp16), float accumulators.
// With g = lane / 4 and t = lane % 4 the warp's lanes hold (two elements per 32-bit register,
// the lower-numbered in the low half):
//   a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   c[0], c[1] = C[g][2t, 2t+1]          c[2], c[3] = C[g+8][2t, 2t+1]
// A warp-wide instruction: every lane of the warp must reach it together.
template <bool kBF16>
__device__ __forceinline__ void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(SPECDECODE_CUDA_EMULATED_RUNTIME)
  ::sd::emu::mma_m16n8k16(kBF16, c, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Starts a copy of 16 bytes from global memory to shared memory (both 16-byte aligned) that
// completes by the cp_async_wait that follows its group's commit; the data may be read only
// after that wait and a barrier.
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
#if defined(SPECDECODE_CUDA_EMULATED_RUNTIME)
  std::memcpy(shared_dst, global_src, 16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src)
               : "memory");
#elif defined(__CUDA_ARCH__)
  *static_cast<uint4*>(shared_dst) = *static_cast<const uint4*>(global_src);
#endif
}

// Closes the group of the copies this thread started since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(SPECDECODE_CUDA_EMULATED_RUNTIME) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(SPECDECODE_CUDA_EMULATED_RUNTIME) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ uint32_t pack_halves(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: four 8 x 8 matrices of 16-bit elements from
// shared memory, one register of each per lane. Lane l gives the address of row l % 8 of matrix
// l / 8 (8 contiguous elements, 16-byte aligned). With g = lane / 4 and t = lane % 4, register i
// holds of matrix i (the lower-numbered element in the low half)
//   [g][2t], [g][2t+1]       without kTrans: an A fragment's layout, or a B fragment's where the
//                            matrix rows are B's columns (K rows for Q K^T);
//   [2t][g], [2t+1][g]       with kTrans: a B fragment's where the rows are B's rows (V rows for
//                            P V).
// A warp-wide instruction: every lane of the warp must reach it together. The emulator gathers
// the rows' addresses with shuffles (its lanes are threadIdx.x % 32: one-dimensional blocks).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const uint16_t* row) {
#if defined(SPECDECODE_CUDA_EMULATED_RUNTIME)
  const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    if constexpr (kTrans) {
      const uint16_t* r0 = __shfl_sync(0xffffffffu, row, 8 * i + 2 * t);
      const uint16_t* r1 = __shfl_sync(0xffffffffu, row, 8 * i + 2 * t + 1);
      r[i] = pack_halves(r0[g], r1[g]);
    } else {
      const uint16_t* src = __shfl_sync(0xffffffffu, row, 8 * i + g);
      r[i] = pack_halves(src[2 * t], src[2 * t + 1]);
    }
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace cuda
}  // namespace sd
