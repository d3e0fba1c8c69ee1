// The CUDA emulator: what the kernels of cuda/ need from CUDA, for the host compiler.
//
// The emulator build compiles cuda/*.cu as C++ with this directory first on the include path, so
// `#include <cuda_runtime_api.h>` finds this file instead of the toolkit's. A launch runs the
// grid on the calling thread, one block after another; each thread of a block is a fiber with
// its own stack, run until it reaches a barrier (__syncthreads, __syncwarp, a shuffle) or
// returns. A barrier releases once every thread it names has reached it, so shared memory,
// barriers and warp shuffles behave as the CUDA programming model specifies them, with no
// lockstep: a thread never runs ahead of a barrier and never waits on one it does not name.
//
// What it checks (a launch that breaks a rule fails with cudaErrorLaunchFailure and a message,
// see sd::emu::last_message):
// - every thread of the block reaches the same __syncthreads (none exits or waits on a warp
//   barrier meanwhile);
// - a shuffle or __syncwarp names only lanes that exist, each of which makes the same call with
//   the same mask; the width is a power of two up to 32; an exited lane is never named;
// - a tensor-core product (mma_m16n8k16 below, cuda/mma.cuh) is reached by all 32 lanes of a
//   full warp;
// - the launch configuration: block and grid sizes within CUDA's limits, dynamic shared memory
//   over 48 KiB only after cudaFuncSetAttribute allowed it, and never over 227 KiB.
// The order in which threads run between two barriers (and blocks within a grid) is chosen by
// sd::emu::set_schedule: forward, reverse or shuffled, so a read of shared data that lacks its
// barrier sees a different writer under some order and gives a different result.
//
// Shared memory starts every block as 0xff bytes (NaN as float), static and dynamic alike, and
// the dynamic part ends at a page the process may not touch, so a write past it faults.
//
// Not emulated: real parallelism between blocks (they run one at a time, so an inter-block race
// is not seen), the weak memory model, timing, and device memory as a separate address space
// (device pointers are host pointers).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define SPECDECODE_CUDA_EMULATED_RUNTIME 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// Static shared memory is declared with SD_SHARED (cuda/launch.cuh), which the emulator maps to
// block_shared below; a bare __shared__ would be a function static that keeps its contents from
// block to block, which is why it is left undefined here.

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {  // CUDA's 16-byte vector type: one 128-bit load or store
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace sd {
namespace emu {

// The built-in variables of the running thread.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadState& current();

void sync_threads();
void sync_warp(unsigned mask);
// The raw bits of `value` exchanged among the lanes of `mask`: lane i gets the bits of lane
// src(i), computed by the emulator from (kind, arg, width) as CUDA's __shfl*_sync define it.
enum class ShuffleKind { kIndex, kXor, kUp, kDown };
uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width);
// PTX's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d = a b + c over one 16 x 8 tile, a
// warp-wide operation on the fragments the 32 lanes hold (in the layout the PTX manual gives for
// m16n8k16 with 16-bit inputs; each 32-bit register holds two elements, the lower-numbered in its
// low half). c [4] is updated in place. Products are summed in float, in increasing k.
void mma_m16n8k16(bool bf16, float* c, const uint32_t* a, const uint32_t* b);
// The block's dynamic shared memory (the launch's `smem` bytes, filled with 0xff: NaN as float).
void* dynamic_shared();

// Runs `body` as every thread of every block of the grid; returns the launch's error, which
// cudaGetLastError reports next.
cudaError_t run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem,
                     const std::function<void()>& body);
cudaError_t set_max_dynamic_shared(const void* kernel, int bytes);
cudaError_t take_last_error();
// The message of the error the last cudaGetLastError returned (empty after a success).
const char* last_message();

// Order of the threads between barriers and of the blocks of a grid.
enum class Schedule { kForward = 0, kReverse = 1, kShuffled = 2 };
void set_schedule(Schedule schedule, uint64_t seed);

// The compute capability the emulated device reports (default 9.0): launchers that pick a
// tensor-core path for sm_80 and newer take their older path below 8.0.
void set_compute_capability(int major, int minor);
int compute_capability_major();
int compute_capability_minor();
// The dynamic shared memory a block may opt into on a real device of that capability (227 KiB
// on sm_90 and sm_100, 163 KiB on sm_80 / sm_87, 99 KiB on sm_86 / sm_89 / sm_120, 64 KiB on
// sm_75): cudaFuncSetAttribute refuses more, as the driver would.
int max_shared_optin();
// The SMs the emulated device reports: few, so that small test grids cover launch choices that
// depend on filling the device.
constexpr int kMultiProcessors = 4;

// Devices: `count` alike emulated devices (default 1). Each host thread has a current device (0
// until cudaSetDevice), and each device a primary context, made active by cudaSetDevice or a
// launch on it (as on CUDA 12 and later) and inactive again only by reset_devices. Host arrays
// given to the ops are on device `array_device` (default 0): tests set it apart from the current
// device to check that an op runs on its arrays' device and gives the caller's back.
void reset_devices(int count, int array_device);
int device_count();
int array_device();
int current_device();
cudaError_t set_current_device(int device);
bool primary_context_active(int device);

// Counters since the last reset, for tests that a path really ran through the emulator;
// launch_device is the device current at the last launch (-1 before the first).
struct Stats {
  uint64_t launches, blocks, threads, block_barriers, warp_syncs, shuffles, mmas;
  int launch_device = -1;
};
Stats stats();
void reset_stats();

// A kernel launch: SD_LAUNCH(grid, block, smem, stream, kernel)(args...) becomes
// launch(...)(args...). The arguments are converted to the kernel's parameter types once, as a
// real launch copies them into the parameter space; each thread receives its own copy.
template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  template <class... A>
  void operator()(A&&... args) const {
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    auto* k = kernel;
    run_grid(reinterpret_cast<const void*>(k), grid, block, smem,
             [k, &params] { std::apply(k, params); });
  }
};
template <class... P>
Launch<P...> launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, void (*kernel)(P...)) {
  return Launch<P...>{kernel, grid, block, smem};
}

// Registers [p, p + bytes) as static shared memory, filled with 0xff before every block.
void register_shared(void* p, size_t bytes);

// The storage of SD_SHARED(T, name) at declaration site `Site`: one object per (type, site),
// shared by the threads of the running block (blocks run one at a time).
template <class T, int Site>
T& block_shared() {
  static T storage;
  static const bool registered = (register_shared(&storage, sizeof(T)), true);
  (void)registered;
  return storage;
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a word");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <class T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace emu
}  // namespace sd

#define threadIdx (::sd::emu::current().thread_idx)
#define blockIdx (::sd::emu::current().block_idx)
#define blockDim (::sd::emu::current().block_dim)
#define gridDim (::sd::emu::current().grid_dim)

inline void __syncthreads() { ::sd::emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::sd::emu::sync_warp(mask); }

template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  using namespace ::sd::emu;
  return from_bits<T>(shuffle(mask, to_bits(v), ShuffleKind::kIndex, src_lane, width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace ::sd::emu;
  return from_bits<T>(shuffle(mask, to_bits(v), ShuffleKind::kXor, lane_mask, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::sd::emu;
  return from_bits<T>(shuffle(mask, to_bits(v), ShuffleKind::kUp, static_cast<int>(delta), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::sd::emu;
  return from_bits<T>(
      shuffle(mask, to_bits(v), ShuffleKind::kDown, static_cast<int>(delta), width));
}

// A vote of the lanes in mask: nonzero in every one of them if pred is nonzero in any. Built
// from xor shuffles (the same exchange as the hardware's vote), so mask must be a whole warp or
// an aligned power-of-two group of lanes, as the shuffle checks require.
inline int __any_sync(unsigned mask, int pred) {
  int vote = pred != 0 ? 1 : 0;
  for (int o = 16; o > 0; o /= 2) vote |= __shfl_xor_sync(mask, vote, o);
  return vote;
}

// One emulated thread runs at a time, so a read-modify-write is atomic.
template <class T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline cudaError_t cudaGetLastError() { return ::sd::emu::take_last_error(); }
inline cudaError_t cudaGetDevice(int* device) {
  *device = ::sd::emu::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) { return ::sd::emu::set_current_device(device); }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device < 0 || device >= ::sd::emu::device_count()) return cudaErrorInvalidDevice;
  switch (attribute) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = ::sd::emu::compute_capability_major();
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = ::sd::emu::compute_capability_minor();
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = ::sd::emu::max_shared_optin();
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = ::sd::emu::kMultiProcessors;
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}
const char* cudaGetErrorString(cudaError_t error);
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return ::sd::emu::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value);
}
