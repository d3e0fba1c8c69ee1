// A standalone probe of how many independent accumulator chains vdpbf16ps needs to reach its
// issue rate (src/attention.cc, lane_dots_bf16: the bf16 lane path's scores kept one accumulator
// per key of a group of 8 before session 47, two on ymm since). Each case runs N independent chains
// acc[i] = dpbf16(acc[i], a, b) for ymm and zmm, and fused multiply-adds on zmm for comparison, and
// prints nanoseconds per product and products per nanosecond. One chain gives the latency, many the
// throughput; the chain count at which the rate stops rising is what a loop must keep in flight. A
// dependent chain of one-cycle integer adds estimates the clock, to turn both into cycles. One
// thread.
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

#define SD_PROBE_TARGET __attribute__((target("avx512f,avx512bf16,avx512vl")))

// The three products, each as acc = product(acc, a): a vector type V, the operand, a chain's
// start and a lane of the result (to keep the chains live).
struct DpYmm {
  using V = __m256;
  using A = __m256bh;
  SD_PROBE_TARGET static A operand() { return (A)_mm256_set1_epi32(0x3f803f80); }
  SD_PROBE_TARGET static V start(int i) { return _mm256_set1_ps(static_cast<float>(i)); }
  SD_PROBE_TARGET static V step(V acc, A a) { return _mm256_dpbf16_ps(acc, a, a); }
  SD_PROBE_TARGET static float lane(V x) { return _mm256_cvtss_f32(x); }
};
struct DpZmm {
  using V = __m512;
  using A = __m512bh;
  SD_PROBE_TARGET static A operand() { return (A)_mm512_set1_epi32(0x3f803f80); }
  SD_PROBE_TARGET static V start(int i) { return _mm512_set1_ps(static_cast<float>(i)); }
  SD_PROBE_TARGET static V step(V acc, A a) { return _mm512_dpbf16_ps(acc, a, a); }
  SD_PROBE_TARGET static float lane(V x) { return _mm512_cvtss_f32(x); }
};
struct FmaZmm {
  using V = __m512;
  using A = __m512;
  SD_PROBE_TARGET static A operand() { return _mm512_set1_ps(1.0001f); }
  SD_PROBE_TARGET static V start(int i) { return _mm512_set1_ps(static_cast<float>(i)); }
  SD_PROBE_TARGET static V step(V acc, A a) { return _mm512_fmadd_ps(a, a, acc); }
  SD_PROBE_TARGET static float lane(V x) { return _mm512_cvtss_f32(x); }
};

// Seconds per product of N independent chains of Op's product.
template <class Op, int N>
SD_PROBE_TARGET __attribute__((noinline)) double chains(long iters) {
  typename Op::V acc[N];
  for (int i = 0; i < N; ++i) acc[i] = Op::start(i);
  typename Op::A a = Op::operand();
  const Clock::time_point t0 = Clock::now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = Op::step(acc[i], a);
    asm volatile("" : "+v"(a));  // keeps the operand live, so no product is hoisted
  }
  const double sec = seconds_since(t0);
  float sink = 0.0f;
  for (int i = 0; i < N; ++i) sink += Op::lane(acc[i]);
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
  report("vdpbf16ps ymm", 1, chains<DpYmm, 1>(iters), ghz);
  report("vdpbf16ps ymm", 8, chains<DpYmm, 8>(iters), ghz);
  report("vdpbf16ps ymm", 12, chains<DpYmm, 12>(iters), ghz);
  report("vdpbf16ps ymm", 16, chains<DpYmm, 16>(iters), ghz);
  report("vdpbf16ps zmm", 1, chains<DpZmm, 1>(iters), ghz);
  report("vdpbf16ps zmm", 8, chains<DpZmm, 8>(iters), ghz);
  report("vdpbf16ps zmm", 16, chains<DpZmm, 16>(iters), ghz);
  report("vfmadd zmm", 1, chains<FmaZmm, 1>(iters), ghz);
  report("vfmadd zmm", 8, chains<FmaZmm, 8>(iters), ghz);
  report("vfmadd zmm", 16, chains<FmaZmm, 16>(iters), ghz);
  return 0;
}
