// The CUDA emulator's scheduler: one fiber per thread of the running block. See
// cuda_runtime_api.h for what it emulates and what it checks.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_runtime_api.h"
#include "specdecode/host_device.h"

// ---- fibers -------------------------------------------------------------------------------------
// A switch saves the callee-saved registers and the FP control words on the running stack and
// resumes another stack. On x86-64 this is a few instructions (sd_emu_switch below). glibc's
// swapcontext also saves the signal mask with a system call: with it, a small emulated
// tree_attention (16632 warp shuffles, each 64 switches) took 8-10 times as long and a small
// verify 6-10 times (bench/RESULTS.md, "CUDA emulator"). Other architectures use ucontext.
#if defined(__x86_64__) && defined(__linux__)
#define SD_EMU_FAST_SWITCH 1
extern "C" void sd_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl sd_emu_switch
  .type sd_emu_switch, @function
sd_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sd_emu_switch, .-sd_emu_switch
)");
#endif

namespace sd {
namespace emu {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;
constexpr int kDefaultSharedLimit = 48 * 1024;
constexpr int kMaxShared = 227 * 1024;  // per block on sm_90
constexpr int kMaxBlockThreads = 1024;

enum class Wait { kReady, kBlock, kWarp, kDone, kFailed };

struct Context {
#if defined(SD_EMU_FAST_SWITCH)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct Fiber {
  Context ctx;
  ThreadState ts;
  Wait wait = Wait::kReady;
  // At a warp barrier: the call and this lane's operand, then the shuffled result.
  bool shuffle = false;
  bool mma = false;  // a tensor-core product: its fragments below, no shuffle
  bool mma_bf16 = false;
  float* mma_c = nullptr;
  const uint32_t* mma_a = nullptr;
  const uint32_t* mma_b = nullptr;
  unsigned mask = 0;
  ShuffleKind kind = ShuffleKind::kIndex;
  int arg = 0, width = kWarp;
  uint64_t bits = 0, result = 0;
};

// A stack with a guard page below it, so an overflow faults instead of corrupting a neighbour.
struct Stack {
  char* base = nullptr;
  size_t bytes = 0;
};

struct Emulator {
  std::mutex mutex;  // one launch at a time; everything below is guarded by it
  Schedule schedule = Schedule::kForward;
  std::mt19937_64 rng{0};
  Stats stats{};
  int cc_major = 9, cc_minor = 0;
  int array_device = 0;
  std::vector<bool> contexts = std::vector<bool>(1, false);  // one per device: active or not
  std::map<const void*, int> max_dynamic;
  std::vector<Stack> stacks;
  // The block being run.
  std::vector<Fiber> fibers;
  Context scheduler;
  Fiber* running = nullptr;
  const std::function<void()>* body = nullptr;
  // Dynamic shared memory: `dynamic_bytes` bytes that end where a PROT_NONE page begins.
  char* dynamic_map = nullptr;
  size_t dynamic_map_bytes = 0;
  char* dynamic = nullptr;
  size_t dynamic_bytes = 0;
  std::string failure;  // set by the rule a block broke
  // Static shared memory (SD_SHARED) of every kernel that has run: poisoned before each block.
  std::vector<std::pair<void*, size_t>> shared;
};

Emulator& the_emulator() {
  static Emulator* e = new Emulator;  // never destroyed: fibers may still reference it at exit
  return *e;
}

// Per host thread, as CUDA's error state is. The message of an error moves to t_reported when
// cudaGetLastError takes the error (cuda::error_string reads it right after), so a later error
// that does not come from the emulator is never given an old message.
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local std::string t_message;
thread_local std::string t_reported;
thread_local int t_device = 0;  // the current device, per host thread as in CUDA

std::string dims(uint3 d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

Fiber& running_fiber(const char* what) {
  Emulator& e = the_emulator();
  if (!e.running) {
    std::fprintf(stderr, "specdecode CUDA emulator: %s called outside a kernel\n", what);
    std::abort();
  }
  return *e.running;
}

void switch_to(Context* save, Context* load) {
#if defined(SD_EMU_FAST_SWITCH)
  sd_emu_switch(&save->sp, load->sp);
#else
  swapcontext(&save->uc, &load->uc);
#endif
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
void yield_to_scheduler(Fiber& f) { switch_to(&f.ctx, &the_emulator().scheduler); }

// Records a broken rule and never returns to the fiber (its block is abandoned).
[[noreturn]] void fail_from_fiber(Fiber& f, const std::string& why) {
  Emulator& e = the_emulator();
  if (e.failure.empty()) e.failure = "thread " + dims(f.ts.thread_idx) + ": " + why;
  f.wait = Wait::kFailed;
  yield_to_scheduler(f);
  std::abort();  // a failed fiber is never resumed
}

// A fiber's first frame: runs the kernel body as the running thread, then hands control back
// for good.
void fiber_main() {
  Emulator& e = the_emulator();
  (*e.body)();
  Fiber& f = *e.running;
  f.wait = Wait::kDone;
  switch_to(&f.ctx, &e.scheduler);
  std::abort();  // a finished fiber is never resumed
}

// Prepares f.ctx so that the first switch to it enters fiber_main on stack s.
void init_context(Fiber& f, const Stack& s) {
#if defined(SD_EMU_FAST_SWITCH)
  // The frame sd_emu_switch pops (FP control words, r15 .. rbp, return address), with a null
  // return address for fiber_main above it: fiber_main starts with rsp = 8 mod 16, as after a
  // call.
  uintptr_t top = reinterpret_cast<uintptr_t>(s.base + s.bytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12 .. r15
  uint32_t control[2];
  asm volatile("stmxcsr %0" : "=m"(control[0]));
  asm volatile("fnstcw %0" : "=m"(control[1]));
  --sp;
  std::memcpy(sp, control, sizeof(control));
  f.ctx.sp = sp;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = s.base;
  f.ctx.uc.uc_stack.ss_size = s.bytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, &fiber_main, 0);
#endif
}

Stack& stack_at(Emulator& e, size_t i) {
  while (e.stacks.size() <= i) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t bytes = kStackBytes + page;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "specdecode CUDA emulator: cannot map a thread stack\n");
      std::abort();
    }
    mprotect(p, page, PROT_NONE);
    e.stacks.push_back(Stack{static_cast<char*>(p), bytes});
  }
  return e.stacks[i];
}

// Points e.dynamic at `bytes` bytes (16-byte aligned, as CUDA aligns dynamic shared memory)
// that end at most 15 bytes before a page the process may not touch.
void map_dynamic_shared(Emulator& e, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (bytes + 15) / 16 * 16;
  const size_t need = (rounded + page - 1) / page * page + page;
  if (e.dynamic_map_bytes < need) {
    if (e.dynamic_map) munmap(e.dynamic_map, e.dynamic_map_bytes);
    void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "specdecode CUDA emulator: cannot map shared memory\n");
      std::abort();
    }
    e.dynamic_map = static_cast<char*>(p);
    e.dynamic_map_bytes = need;
    mprotect(e.dynamic_map + need - page, page, PROT_NONE);
  }
  e.dynamic = e.dynamic_map + e.dynamic_map_bytes - page - rounded;
  e.dynamic_bytes = bytes;
}

// Shared memory as the GPU leaves it at a block's start: undefined, here 0xff bytes.
void poison_shared(Emulator& e) {
  if (e.dynamic_bytes) std::memset(e.dynamic, 0xff, e.dynamic_bytes);
  for (const auto& region : e.shared) std::memset(region.first, 0xff, region.second);
}

uint3 thread_index(unsigned linear, dim3 block) {
  return uint3{linear % block.x, (linear / block.x) % block.y, linear / (block.x * block.y)};
}

// The order of `n` items under the current schedule.
void order_of(Emulator& e, std::vector<int>* order, int n) {
  order->resize(static_cast<size_t>(n));
  std::iota(order->begin(), order->end(), 0);
  if (e.schedule == Schedule::kReverse) std::reverse(order->begin(), order->end());
  if (e.schedule == Schedule::kShuffled) std::shuffle(order->begin(), order->end(), e.rng);
}

// The lane whose value lane `lane` receives (CUDA's __shfl*_sync rules), or `lane` itself where
// the rules return the caller's own value.
int shuffle_source(const Fiber& f, int lane) {
  const int w = f.width;
  const int group = lane & ~(w - 1);
  switch (f.kind) {
    case ShuffleKind::kIndex:
      return group + (((f.arg % w) + w) % w);
    case ShuffleKind::kXor: {
      const int src = lane ^ f.arg;
      return src >= group + w || src < 0 ? lane : src;  // a later group: the own value
    }
    case ShuffleKind::kUp: {
      const int src = lane - f.arg;
      return src < group ? lane : src;
    }
    case ShuffleKind::kDown: {
      const int src = lane + f.arg;
      return src >= group + w ? lane : src;
    }
  }
  return lane;
}

float half_value(bool bf16, uint32_t word, int high) {
  const auto h = static_cast<uint16_t>(high ? word >> 16 : word & 0xffffu);
  return bf16 ? bf16_to_float(h) : half_to_float(h);
}

// The product of an mma_m16n8k16 that every lane of the warp at `first` has reached. Fragment
// layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 and t = lane % 4:
//   a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   c[0], c[1] = C[g][2t, 2t+1]          c[2], c[3] = C[g+8][2t, 2t+1]
void run_mma(Emulator& e, int first, bool bf16) {
  float a[16][16], b[16][8];
  for (int lane = 0; lane < kWarp; ++lane) {
    const Fiber& f = e.fibers[static_cast<size_t>(first + lane)];
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
      a[row][col] = half_value(bf16, f.mma_a[r], 0);
      a[row][col + 1] = half_value(bf16, f.mma_a[r], 1);
    }
    for (int r = 0; r < 2; ++r) {
      b[2 * t + 8 * r][g] = half_value(bf16, f.mma_b[r], 0);
      b[2 * t + 8 * r + 1][g] = half_value(bf16, f.mma_b[r], 1);
    }
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    const Fiber& f = e.fibers[static_cast<size_t>(first + lane)];
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][col];
      f.mma_c[i] += sum;
    }
  }
}

// Releases the warp barrier that lane `lane` of the warp at `first` waits at, if every lane its
// mask names has arrived. Returns false with e.failure set when the barrier can never release.
bool try_release_warp(Emulator& e, int first, int lanes, int lane, bool* released) {
  Fiber& f = e.fibers[static_cast<size_t>(first + lane)];
  const unsigned mask = f.mask;
  // The caller, for a failure's message only (built lazily: every shuffle passes here).
  const auto who = [&] {
    return "thread " + dims(f.ts.thread_idx) + " (lane " + std::to_string(lane) + ") at " +
           (f.mma       ? "mma.sync"
            : f.shuffle ? "a shuffle"
                        : "__syncwarp");
  };
  if (!((mask >> lane) & 1u)) {
    e.failure = who() + " with a mask that does not name its own lane";
    return false;
  }
  for (int m = 0; m < kWarp; ++m) {
    if (!((mask >> m) & 1u)) continue;
    if (m >= lanes) {
      e.failure = who() + " names lane " + std::to_string(m) + ", which this block does not have";
      return false;
    }
    const Fiber& g = e.fibers[static_cast<size_t>(first + m)];
    if (g.wait == Wait::kDone) {
      e.failure = who() + " names lane " + std::to_string(m) + ", which has exited";
      return false;
    }
    if (g.wait == Wait::kBlock) {
      e.failure = who() + " names lane " + std::to_string(m) + ", which waits at __syncthreads";
      return false;
    }
    if (g.wait != Wait::kWarp) return true;  // not arrived yet (cannot happen between rounds)
    if (g.mask != mask || g.shuffle != f.shuffle || g.mma != f.mma ||
        (f.shuffle && (g.kind != f.kind || g.width != f.width))) {
      e.failure = who() + " and lane " + std::to_string(m) + " wait at different warp operations";
      return false;
    }
  }
  if (f.mma) {
    if (mask != 0xffffffffu || lanes != kWarp) {
      e.failure =
          who() + " with mask " + std::to_string(mask) + ": it needs all 32 lanes of a warp";
      return false;
    }
    run_mma(e, first, f.mma_bf16);
    ++e.stats.mmas;
  } else if (f.shuffle) {
    for (int m = 0; m < kWarp; ++m) {
      if (!((mask >> m) & 1u)) continue;
      Fiber& g = e.fibers[static_cast<size_t>(first + m)];
      const int src = shuffle_source(g, m);
      if (src < 0 || src >= kWarp || !((mask >> src) & 1u)) {
        e.failure = "lane " + std::to_string(m) + " reads lane " + std::to_string(src) +
                    " in a shuffle whose mask does not name it";
        return false;
      }
      g.result = e.fibers[static_cast<size_t>(first + src)].bits;
    }
    ++e.stats.shuffles;
  } else {
    ++e.stats.warp_syncs;
  }
  for (int m = 0; m < kWarp; ++m) {
    if ((mask >> m) & 1u) e.fibers[static_cast<size_t>(first + m)].wait = Wait::kReady;
  }
  *released = true;
  return true;
}

// Runs one block to completion; false with e.failure set when it broke a rule.
bool run_block(Emulator& e, uint3 block_idx, dim3 grid, dim3 block) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  e.fibers.assign(static_cast<size_t>(n), Fiber{});
  e.failure.clear();
  for (int i = 0; i < n; ++i) {
    Fiber& f = e.fibers[static_cast<size_t>(i)];
    f.ts = ThreadState{thread_index(static_cast<unsigned>(i), block), block_idx, block, grid};
    init_context(f, stack_at(e, static_cast<size_t>(i)));
  }
  poison_shared(e);
  std::vector<int> order;
  for (;;) {
    order_of(e, &order, n);
    for (int i : order) {
      Fiber& f = e.fibers[static_cast<size_t>(i)];
      if (f.wait != Wait::kReady) continue;
      e.running = &f;
      switch_to(&e.scheduler, &f.ctx);
      e.running = nullptr;
      if (!e.failure.empty()) return false;
    }
    int done = 0, at_block = 0;
    for (const Fiber& f : e.fibers) {
      done += f.wait == Wait::kDone;
      at_block += f.wait == Wait::kBlock;
    }
    if (done == n) return true;
    bool released = false;
    for (int first = 0; first < n; first += kWarp) {
      const int lanes = std::min(kWarp, n - first);
      for (int lane = 0; lane < lanes; ++lane) {
        if (e.fibers[static_cast<size_t>(first + lane)].wait != Wait::kWarp) continue;
        if (!try_release_warp(e, first, lanes, lane, &released)) return false;
      }
    }
    if (released) continue;
    if (at_block == n) {
      for (Fiber& f : e.fibers) f.wait = Wait::kReady;
      ++e.stats.block_barriers;
      continue;
    }
    if (done > 0 && at_block + done == n) {
      e.failure = std::to_string(at_block) + " threads wait at __syncthreads that " +
                  std::to_string(done) + " threads of the block exited without reaching";
    } else {
      e.failure = "deadlock: " + std::to_string(at_block) + " threads wait at __syncthreads, " +
                  std::to_string(n - at_block - done) + " at warp barriers that cannot release";
    }
    return false;
  }
}

cudaError_t set_error(cudaError_t code, const std::string& message) {
  t_last_error = code;
  t_message = message;
  return code;
}

}  // namespace

const ThreadState& current() { return running_fiber("a built-in variable").ts; }

// Called by the first thread that declares a variable, inside run_grid (the mutex is held). The
// variable is poisoned now too: this block started before it was known.
void register_shared(void* p, size_t bytes) {
  the_emulator().shared.emplace_back(p, bytes);
  std::memset(p, 0xff, bytes);
}

void sync_threads() {
  Fiber& f = running_fiber("__syncthreads");
  f.wait = Wait::kBlock;
  yield_to_scheduler(f);
}

void sync_warp(unsigned mask) {
  Fiber& f = running_fiber("__syncwarp");
  f.wait = Wait::kWarp;
  f.shuffle = false;
  f.mma = false;
  f.mask = mask;
  yield_to_scheduler(f);
}

uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width) {
  Fiber& f = running_fiber("a warp shuffle");
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0) {
    fail_from_fiber(f, "shuffle width " + std::to_string(width) + " is not a power of 2 <= 32");
  }
  f.wait = Wait::kWarp;
  f.shuffle = true;
  f.mma = false;
  f.mask = mask;
  f.kind = kind;
  f.arg = arg;
  f.width = width;
  f.bits = bits;
  yield_to_scheduler(f);
  return f.result;
}

void mma_m16n8k16(bool bf16, float* c, const uint32_t* a, const uint32_t* b) {
  Fiber& f = running_fiber("mma.sync");
  f.wait = Wait::kWarp;
  f.shuffle = false;
  f.mma = true;
  f.mask = 0xffffffffu;
  f.mma_bf16 = bf16;
  f.mma_c = c;
  f.mma_a = a;
  f.mma_b = b;
  yield_to_scheduler(f);
}

void* dynamic_shared() {
  running_fiber("dynamic shared memory");
  Emulator& e = the_emulator();
  return e.dynamic_bytes ? e.dynamic : nullptr;
}

cudaError_t run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem,
                     const std::function<void()>& body) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxBlockThreads || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    return set_error(cudaErrorInvalidConfiguration,
                     "invalid launch configuration: grid " + dims({grid.x, grid.y, grid.z}) +
                         ", block " + dims({block.x, block.y, block.z}));
  }
  const auto limit = e.max_dynamic.find(kernel);
  const int allowed = limit == e.max_dynamic.end() ? kDefaultSharedLimit : limit->second;
  if (smem > static_cast<size_t>(allowed)) {
    return set_error(cudaErrorInvalidValue, std::to_string(smem) +
                                                " bytes of dynamic shared memory, but the kernel " +
                                                "allows " + std::to_string(allowed) +
                                                " (cudaFuncSetAttribute raises the limit up to " +
                                                std::to_string(kMaxShared) + ")");
  }
  if (t_device >= static_cast<int>(e.contexts.size())) {
    return set_error(cudaErrorInvalidDevice, "launch on device " + std::to_string(t_device) +
                                                 ", but the emulator has " +
                                                 std::to_string(e.contexts.size()));
  }
  ++e.stats.launches;
  e.stats.launch_device = t_device;
  e.contexts[t_device] = true;
  e.body = &body;
  map_dynamic_shared(e, smem);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), uint64_t{0});
  if (e.schedule == Schedule::kReverse) std::reverse(order.begin(), order.end());
  if (e.schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), e.rng);
  for (uint64_t linear : order) {
    const uint3 idx{static_cast<unsigned>(linear % grid.x),
                    static_cast<unsigned>((linear / grid.x) % grid.y),
                    static_cast<unsigned>(linear / (uint64_t{grid.x} * grid.y))};
    ++e.stats.blocks;
    e.stats.threads += threads;
    if (!run_block(e, idx, grid, block)) {
      e.body = nullptr;
      return set_error(cudaErrorLaunchFailure, "block " + dims(idx) + ", " + e.failure);
    }
  }
  e.body = nullptr;
  return cudaSuccess;
}

cudaError_t set_max_dynamic_shared(const void* kernel, int bytes) {
  const int limit = max_shared_optin();
  if (bytes < 0 || bytes > limit) {
    // The caller gets the code itself (not through cudaGetLastError): the message is reported.
    t_reported = "cudaFuncSetAttribute: " + std::to_string(bytes) +
                 " bytes of dynamic shared memory is over " + std::to_string(limit);
    return cudaErrorInvalidValue;
  }
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.max_dynamic[kernel] = bytes;
  return cudaSuccess;
}

cudaError_t take_last_error() {
  const cudaError_t code = t_last_error;
  t_reported = code == cudaSuccess ? std::string() : t_message;
  t_last_error = cudaSuccess;
  t_message.clear();
  return code;
}

const char* last_message() { return t_reported.c_str(); }

void set_schedule(Schedule schedule, uint64_t seed) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.schedule = schedule;
  e.rng.seed(seed);
}

void set_compute_capability(int major, int minor) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.cc_major = major;
  e.cc_minor = minor;
}

// Read by launchers inside run_grid's callers, never while a launch holds the mutex.
int compute_capability_major() { return the_emulator().cc_major; }
int compute_capability_minor() { return the_emulator().cc_minor; }

int max_shared_optin() {
  const Emulator& e = the_emulator();
  const int cc = e.cc_major * 10 + e.cc_minor;
  if (cc == 90 || cc == 100) return kMaxShared;
  if (cc == 80 || cc == 87) return 163 * 1024;
  if (cc >= 80) return 99 * 1024;  // sm_86, sm_89, sm_120
  if (cc == 70 || cc == 72) return 96 * 1024;
  return 64 * 1024;
}

void reset_devices(int count, int array_device) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.contexts.assign(static_cast<size_t>(count), false);
  e.array_device = array_device;
  t_device = 0;
}

int device_count() {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  return static_cast<int>(e.contexts.size());
}

int array_device() {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.array_device;
}

int current_device() { return t_device; }

cudaError_t set_current_device(int device) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (device < 0 || device >= static_cast<int>(e.contexts.size())) {
    return set_error(cudaErrorInvalidDevice, "device " + std::to_string(device) +
                                                 ", but the emulator has " +
                                                 std::to_string(e.contexts.size()));
  }
  t_device = device;
  e.contexts[device] = true;
  return cudaSuccess;
}

bool primary_context_active(int device) {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  return device >= 0 && device < static_cast<int>(e.contexts.size()) && e.contexts[device];
}

Stats stats() {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.stats;
}

void reset_stats() {
  Emulator& e = the_emulator();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats = Stats{};
}

}  // namespace emu
}  // namespace sd

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
  }
  return "unknown error";
}
