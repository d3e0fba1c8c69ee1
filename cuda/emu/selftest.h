// Kernels that check the CUDA emulator itself (tests/test_cuda_emu.py): the shuffle rules, a
// barrier that orders shared memory, and the rules a kernel can break. Emulator build only.
#pragma once

#include <cstdint>
#include <string>

namespace sd {
namespace emu {

// One warp of 32 threads; out[k * 32 + lane] is the result of shuffle case k (selftest.cc lists
// them) for each lane, with every lane's operand 100 + lane. Returns the number of cases.
int selftest_shuffles(int32_t* out);

// A block of `threads` threads: thread t writes t to shared[t], then (with_barrier) waits at
// __syncthreads, then out[t] = shared[(t + 1) % threads]. Shared memory starts as NaN.
std::string selftest_neighbour(float* out, int threads, bool with_barrier);

// Two blocks of one thread, each reading a static shared float before writing it: out[b] is what
// block b read (NaN: shared memory starts undefined, not with the previous block's value).
std::string selftest_static_shared(float* out);

// A block that writes one float past its 64 bytes of dynamic shared memory: the process faults
// (SIGSEGV) instead of corrupting memory. Tests run it in a child process.
std::string selftest_shared_overflow();

// One warp computes d = a b (a [16, 16] and b [16, 8] row-major, 16-bit patterns of bf16 or fp16
// values; d [16, 8] float) with one mma_m16n8k16, each lane loading its fragments by the layout
// mma.cuh documents. Returns the launch's error message (empty when it ran).
std::string selftest_mma(const uint16_t* a, const uint16_t* b, bool bf16, float* d);

// One warp loads the four 8 x 8 quadrants of m [16, 16] (16-bit patterns, row-major) from shared
// memory with one ldmatrix_x4 (transposed with `trans`), quadrant i = (rows 8 (i % 2), columns
// 8 (i / 2)); out [32, 4] gets each lane's four registers. Returns the launch's error message.
std::string selftest_ldmatrix(const uint16_t* m, bool trans, uint32_t* out);

// A kernel that breaks `rule` ("divergent_barrier", "exited_lane", "foreign_mask",
// "shared_memory", "shared_memory_allowed", "block_size", "partial_warp_mma"); returns the launch's
// error message (empty when the launch succeeded).
std::string selftest_rule(const std::string& rule);

}  // namespace emu
}  // namespace sd
