// A standalone probe of how many independent accumulator chains vdpbf16ps needs to reach its
// issue rate (src/attention.cc, lane_dots_bf16: the bf16 lane path's scores keep one accumulator
// per key of a group of 8). Each case runs N independent chains acc[i] = dpbf16(acc[i], a, b)
// for ymm and zmm, and fused multiply-adds on zmm for comparison, and prints nanoseconds per
// product and products per nanosecond. One chain gives the latency, many the throughput; the
// chain count at which the rate stops rising is what a loop must keep in flight. A dependent
// chain of one-cycle integer adds estimates the clock, to turn both into cycles. One thread.
//
// Build and run (bench/RESULTS.md, tree_attention, session 47):
//   g++ -O2 -std=c++17 bench/probes/dp_chains_probe.cc -o /tmp/dp_chains_probe
//   /tmp/dp_chains_probe [--iters N]
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Iterations of a chain of 8 dependent one-cycle adds per loop trip: about 8 cycles per trip.
__attribute__((noinline)) double clock_ghz(long trips) {
  long x = 0;
  const Clock::time_point t0 = Clock::now();
  for (long i = 0; i < trips; ++i) {
    asm volatile(
        "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
        "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
        : "+r"(x));
  }
  return 8.0 * static_cast<double>(trips) / seconds_since(t0) / 1e9;
}

// Seconds per product of N chains of vdpbf16ps on ymm.
template <int N>
__attribute__((target("avx512f,avx512bf16,avx512vl"), noinline)) double dp_ymm(long iters) {
  __m256 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256bh a = (__m256bh)_mm256_set1_epi32(0x3f803f80);
  const __m256bh b = a;
  const Clock::time_point t0 = Clock::now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = _mm256_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a));  // keeps the operand live, so no product is hoisted
  }
  const double sec = seconds_since(t0);
  float sink = 0.0f;
  for (int i = 0; i < N; ++i) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[i]);
    sink += lanes[0];
  }
  if (sink == 1.25f) std::puts("");
  return sec / (static_cast<double>(iters) * N);
}

// As dp_ymm on zmm.
template <int N>
__attribute__((target("avx512f,avx512bf16"), noinline)) double dp_zmm(long iters) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh b = a;
  const Clock::time_point t0 = Clock::now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  const double sec = seconds_since(t0);
  float sink = 0.0f;
  for (int i = 0; i < N; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  if (sink == 1.25f) std::puts("");
  return sec / (static_cast<double>(iters) * N);
}

// As dp_zmm with vfmadd on fp32.
template <int N>
__attribute__((target("avx512f"), noinline)) double fma_zmm(long iters) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_set1_ps(1.0001f);
  const __m512 b = a;
  const Clock::time_point t0 = Clock::now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+v"(a));
  }
  const double sec = seconds_since(t0);
  float sink = 0.0f;
  for (int i = 0; i < N; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  if (sink == 1.25f) std::puts("");
  return sec / (static_cast<double>(iters) * N);
}

void report(const char* name, int chains, double sec, double ghz) {
  std::printf("| %s | %d | %.3f | %.2f | %.2f |\n", name, chains, sec * 1e9, 1.0 / (sec * 1e9),
              sec * 1e9 * ghz);
}

}  // namespace

int main(int argc, char** argv) {
  long iters = 20000000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atol(argv[i + 1]);
  }
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("this CPU has no AVX512_BF16");
    return 1;
  }
  const double ghz = clock_ghz(iters * 8);
  std::printf("# clock estimate %.2f GHz (dependent integer adds), %ld iterations per case\n\n",
              ghz, iters);
  std::puts("| product | chains | ns per product | products per ns | cycles per product |");
  std::puts("|---|---|---|---|---|");
  report("vdpbf16ps ymm", 1, dp_ymm<1>(iters), ghz);
  report("vdpbf16ps ymm", 8, dp_ymm<8>(iters), ghz);
  report("vdpbf16ps ymm", 12, dp_ymm<12>(iters), ghz);
  report("vdpbf16ps ymm", 16, dp_ymm<16>(iters), ghz);
  report("vdpbf16ps zmm", 1, dp_zmm<1>(iters), ghz);
  report("vdpbf16ps zmm", 8, dp_zmm<8>(iters), ghz);
  report("vdpbf16ps zmm", 16, dp_zmm<16>(iters), ghz);
  report("vfmadd zmm", 1, fma_zmm<1>(iters), ghz);
  report("vfmadd zmm", 8, fma_zmm<8>(iters), ghz);
  report("vfmadd zmm", 16, fma_zmm<16>(iters), ghz);
  return 0;
}
