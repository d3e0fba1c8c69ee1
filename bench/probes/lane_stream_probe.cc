// A standalone probe of the AVX2 lane path's memory behaviour (src/attention.cc, lane_range_of):
// 8 query rows of a KV head in the lanes of one vector, blocks of 16 keys, per KV head the lane
// scores (each key element broadcast into an FMA) and then the P V in tiles of 4 rows x 2
// vectors. The cache is [positions, 8 KV heads, 128] fp32, so a head's rows are 4 KiB apart, as
// in a model's [B, S, Hkv, D] cache. No softmax and no masking: the probe times where the data
// comes from, not the arithmetic's result. One thread.
//
// Build and run (bench/RESULTS.md, tree_attention, session 21):
//   g++ -O3 -mavx2 -mfma -std=c++17 bench/probes/lane_stream_probe.cc -o /tmp/lane_stream_probe
//   /tmp/lane_stream_probe [--compute-only] [--hints same|other|pages|none] [--page-lines L]
//                          [--heads-outer] [--pad N]
// --compute-only  every block reads the first block's keys and values (kept in L1 / L2)
// --hints         hint the next block of the same KV head (as lane_range_of), of the head four
//                 steps later, the first L lines (--page-lines, default 2) of the next block's
//                 positions, two positions per KV head step, or nothing
// --heads-outer   each KV head streams a 256-key item alone, instead of all heads per block
// --pad N         N floats between positions (rows no longer 4 KiB apart)
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int kDim = 128;       // head dim
constexpr int kHeads = 8;       // KV heads
constexpr int kRows = 8;        // query rows per KV head (T = 2 at GQA 4)
constexpr int kKeys = 16;       // keys per block
constexpr int kItemKeys = 256;  // keys per item with --heads-outer
constexpr size_t kPositions = 32768;

enum class Hints { kNone, kSame, kOther, kPages };

struct Options {
  bool compute_only = false, heads_outer = false;
  Hints hints = Hints::kSame;
  size_t pad = 0;
  int page_lines = 2;
};

// Page-aligned floats (a cache's rows start on cache-line boundaries, as torch's do).
struct AlignedFloats {
  float* data_ = nullptr;
  void assign(size_t n, float x) {
    std::free(data_);
    data_ = static_cast<float*>(std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096));
    if (data_ == nullptr) std::exit(3);
    for (size_t i = 0; i < n; ++i) data_[i] = x;
  }
  float* data() { return data_; }
};

struct Buffers {
  AlignedFloats k, v;
  size_t rs;  // floats between positions
  alignas(64) float qt[kDim * kRows];
  alignas(64) float p[kRows * kKeys];
  alignas(64) float o[kHeads][kRows * kDim];
};

void hint_rows(const float* first, size_t rs, int bytes_per_row) {
  for (int j = 0; j < kKeys; ++j) {
    const char* row = reinterpret_cast<const char*>(first + j * rs);
    for (int b = 0; b < bytes_per_row; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// Lane scores of 16 keys (rows rs floats apart) against the lane query: s[j] holds key j's score
// for every row.
void lane_scores(const float* qt, const float* k, size_t rs, __m256* s) {
  for (int g = 0; g < kKeys; g += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < kDim; ++i) {
      const __m256 q = _mm256_load_ps(qt + 8 * i);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(k + (g + j) * rs + i), acc[j]);
      }
    }
    for (int j = 0; j < 8; ++j) s[g + j] = acc[j];
  }
}

// P V of 16 keys into the rows' accumulators o [kRows][kDim], 4 rows x 2 vectors per tile.
void pv_tiles(const float* p, const float* v, size_t rs, float* o) {
  for (int r0 = 0; r0 < kRows; r0 += 4) {
    for (int c0 = 0; c0 < kDim; c0 += 16) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r) {
        for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_load_ps(o + (r0 + r) * kDim + c0 + 8 * c);
      }
      for (int j = 0; j < kKeys; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + j * rs + c0);
        const __m256 v1 = _mm256_loadu_ps(v + j * rs + c0 + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 w = _mm256_broadcast_ss(p + (r0 + r) * kKeys + j);
          acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        for (int c = 0; c < 2; ++c) _mm256_store_ps(o + (r0 + r) * kDim + c0 + 8 * c, acc[r][c]);
      }
    }
  }
}

// One block of one KV head: hints for a later block, then scores and P V.
void head_block(Buffers& buf, const Options& opt, size_t j0, int h) {
  const size_t jb = opt.compute_only ? 0 : j0;
  const float* k = buf.k.data() + jb * buf.rs + h * kDim;
  const float* v = buf.v.data() + jb * buf.rs + h * kDim;
  if (!opt.compute_only && opt.hints == Hints::kPages && j0 + 2 * kKeys <= kPositions) {
    // The first lines of the next block's positions, two positions per KV head step: the L2
    // stream prefetcher may then fetch the rest of each 4 KiB position.
    for (int j = 2 * h; j < 2 * h + 2; ++j) {
      const size_t at = (j0 + kKeys + j) * buf.rs;
      for (int l = 0; l < opt.page_lines; ++l) {
        __builtin_prefetch(reinterpret_cast<const char*>(buf.k.data() + at) + 64 * l, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(buf.v.data() + at) + 64 * l, 0, 2);
      }
    }
  } else if (!opt.compute_only && opt.hints != Hints::kNone && j0 + 2 * kKeys <= kPositions) {
    const int hh = opt.hints == Hints::kSame ? h : (h + 4) % kHeads;
    const size_t next = (j0 + kKeys) * buf.rs + hh * kDim;
    hint_rows(buf.k.data() + next, buf.rs, kDim * 4);
    hint_rows(buf.v.data() + next, buf.rs, kDim * 4);
  }
  __m256 s[kKeys];
  lane_scores(buf.qt, k, buf.rs, s);
  // The scores stay live through the weights: one of them scales the first weight.
  buf.p[0] = 1e-3f + 1e-12f * _mm256_cvtss_f32(s[kKeys - 1]);
  pv_tiles(buf.p, v, buf.rs, buf.o[h]);
}

double run_once(Buffers& buf, const Options& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.heads_outer) {
    for (size_t i0 = 0; i0 < kPositions; i0 += kItemKeys) {
      for (int h = 0; h < kHeads; ++h) {
        for (size_t j0 = i0; j0 < i0 + kItemKeys; j0 += kKeys) head_block(buf, opt, j0, h);
      }
    }
  } else {
    for (size_t j0 = 0; j0 < kPositions; j0 += kKeys) {
      for (int h = 0; h < kHeads; ++h) head_block(buf, opt, j0, h);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Options parse(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--compute-only") {
      opt.compute_only = true;
    } else if (a == "--heads-outer") {
      opt.heads_outer = true;
    } else if (a == "--hints" && i + 1 < argc) {
      const std::string h = argv[++i];
      opt.hints = h == "none"    ? Hints::kNone
                  : h == "other" ? Hints::kOther
                  : h == "pages" ? Hints::kPages
                                 : Hints::kSame;
    } else if (a == "--page-lines" && i + 1 < argc) {
      opt.page_lines = std::atoi(argv[++i]);
    } else if (a == "--pad" && i + 1 < argc) {
      opt.pad = std::strtoul(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  static Buffers buf;
  buf.rs = kHeads * kDim + opt.pad;
  buf.k.assign(kPositions * buf.rs, 1e-3f);
  buf.v.assign(kPositions * buf.rs, 1e-3f);
  for (float& x : buf.qt) x = 1e-3f;
  for (float& x : buf.p) x = 1e-3f;
  std::memset(buf.o, 0, sizeof(buf.o));
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) best = std::min(best, run_once(buf, opt));
  const double bytes = 2.0 * kPositions * kHeads * kDim * sizeof(float);
  const double flops = 4.0 * kPositions * kHeads * kDim * kRows;
  std::printf("%s hints=%s%s pad=%zu: %.2f ms, %.1f GB/s of K+V, %.1f GFLOP/s (%g)\n",
              opt.compute_only ? "compute-only" : "from memory",
              opt.hints == Hints::kNone    ? "none"
              : opt.hints == Hints::kSame  ? "same"
              : opt.hints == Hints::kPages ? "pages"
                                           : "other",
              opt.heads_outer ? " heads-outer" : "", opt.pad, best * 1e3, bytes / best / 1e9,
              flops / best / 1e9, buf.o[3][5]);
  return 0;
}
