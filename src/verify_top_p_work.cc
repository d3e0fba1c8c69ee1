// The top-p search's work, counted: verify::top_p_settling_search run as one CUDA block runs it
// (cuda/verify.cu, BlockExec), on one thread. It gives bench/top_p_work.py and the tests the
// number of tries, histogram passes and chunk reads the kernel takes on a row, which no GPU is
// needed to count.

#include <cstdint>
#include <vector>

#include "specdecode/verify.h"
#include "specdecode/verify_ops.h"

namespace sd {
namespace cpu {
namespace {

using Row = verify::Prob<float>;

// BlockExec's search steps, serial: the same per-chunk functions, each try's total added in
// chunk order as the block's leader adds it, and the histogram's buckets added in chunk order
// (the block's atomics add them in any order, which only moves the tries they propose; the
// threshold is the same either way).
class CountingExec {
 public:
  explicit CountingExec(bool histograms) : histograms_(histograms) {}

  const TopPWork& work() const { return work_; }

  void top_p_unsettle(int64_t n, const verify::RowWeight<Row>& f) {
    const int chunks = verify::num_chunks(n);
    settled_.assign(static_cast<size_t>(chunks), 0);
    settled_sum_.assign(static_cast<size_t>(chunks), 0.f);
    trials_.resize(static_cast<size_t>(chunks));
    for (int c = 0; c < chunks; ++c) settled_[c] = verify::top_p_chunk_empty(f, c) ? 1 : 0;
  }

  bool top_p_candidate(uint32_t, uint32_t, uint32_t*) { return false; }

  float top_p_trial(int64_t n, const verify::RowWeight<Row>& f, uint32_t lo, uint32_t mid,
                    uint32_t hi) {
    ++work_.tries;
    float total = 0.f;
    for (int c = 0; c < verify::num_chunks(n); ++c) {
      if (!settled_[c]) {
        const int64_t cb = static_cast<int64_t>(c) * verify::kChunk;
        trials_[c] = verify::top_p_chunk_trial(f, cb, chunk_end(c, n), lo, mid, hi);
        ++work_.chunk_reads;
      }
      total = verify::fadd(total, settled_[c] ? settled_sum_[c] : trials_[c].sum);
    }
    return total;
  }

  const float* top_p_histogram(int64_t n, const verify::RowWeight<Row>& f,
                               const verify::TopPSpan& sp) {
    if (!histograms_) return nullptr;
    ++work_.histograms;
    cum_.assign(static_cast<size_t>(verify::kTopPBuckets) + 1, 0.f);
    float* h = cum_.data();
    const auto add = [h](int k, float w) { h[k] += w; };
    for (int c = 0; c < verify::num_chunks(n); ++c) {
      if (settled_[c]) continue;
      verify::top_p_chunk_histogram(f, static_cast<int64_t>(c) * verify::kChunk, chunk_end(c, n),
                                    sp, add);
      ++work_.chunk_reads;
    }
    for (int k = verify::kTopPBuckets - 1; k >= 0; --k) h[k] = verify::fadd(h[k], h[k + 1]);
    return h;
  }

  void top_p_settle(int64_t n, bool keep, uint32_t, uint32_t) {
    for (int c = 0; c < verify::num_chunks(n); ++c) {
      if (settled_[c] || !verify::top_p_settles(keep, trials_[c].below, trials_[c].above)) continue;
      settled_[c] = 1;
      settled_sum_[c] = trials_[c].sum;
    }
  }

 private:
  static int64_t chunk_end(int c, int64_t n) {
    const int64_t end = static_cast<int64_t>(c + 1) * verify::kChunk;
    return end < n ? end : n;
  }

  bool histograms_;
  TopPWork work_{};
  std::vector<uint8_t> settled_;
  std::vector<float> settled_sum_;
  std::vector<verify::TopPChunkTrial> trials_;
  std::vector<float> cum_;
};

}  // namespace

TopPWork top_p_search_work(const float* weights, int64_t n, float wanted, bool histograms) {
  const Row* row = reinterpret_cast<const Row*>(weights);
  uint32_t hi = 0u;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = float_to_bits(weights[i]);
    hi = bits > hi ? bits : hi;
  }
  const verify::RowWeight<Row> f{row, 1.f, -verify::kInf, 0.f, 0.f, nullptr, nullptr};
  CountingExec ex(histograms);
  const uint32_t threshold = verify::top_p_settling_search(ex, n, f, wanted, hi);
  TopPWork work = ex.work();
  work.threshold = threshold;
  return work;
}

}  // namespace cpu
}  // namespace sd
