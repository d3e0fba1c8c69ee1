#include <algorithm>
#include <functional>
#include <vector>

#include "specdecode/parallel.h"
#include "specdecode/verify.h"
#include "specdecode/verify_ops.h"

namespace sd {
namespace cpu {

namespace {

using verify::ScanResult;

// The executor of the shared walk on one CPU thread: plain loops in index order.
class CpuExec {
 public:
  explicit CpuExec(int64_t vocab)
      : sums0_(verify::num_chunks(vocab)), sums1_(verify::num_chunks(vocab)) {}

  bool leader() const { return true; }
  float* sums(int which) { return which ? sums1_.data() : sums0_.data(); }

  // Max over 8 lanes (exact, so the lane order does not matter) keeps the loop vectorised; the
  // argmax is then the first index holding the max, as the GPU's tie rule gives.
  template <class Load, class Bad>
  ScanResult scan(int64_t n, const Load& load, const Bad& bad) {
    float lane[8];
    int flag[8];
    for (int j = 0; j < 8; ++j) {
      lane[j] = -verify::kInf;
      flag[j] = 0;
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) {
        const float v = load(i + j);
        flag[j] |= bad(v) ? 1 : 0;
        lane[j] = v > lane[j] ? v : lane[j];
      }
    }
    for (int j = 0; i + j < n; ++j) {
      const float v = load(i + j);
      flag[j] |= bad(v) ? 1 : 0;
      lane[j] = v > lane[j] ? v : lane[j];
    }
    ScanResult r{-verify::kInf, 0, false};
    for (int j = 0; j < 8; ++j) {
      r.max = lane[j] > r.max ? lane[j] : r.max;
      r.bad = r.bad || flag[j] != 0;
    }
    for (int64_t k = 0; k < n; ++k) {
      if (load(k) == r.max) {
        r.argmax = k;
        break;
      }
    }
    return r;
  }

  // The weights are first written to a buffer in one plain loop (which the compiler vectorises;
  // the canonical lane order of chunk_sum would not), then summed in the canonical order. The
  // values and the order of additions are exactly those of chunk_sum(f, ...).
  template <class F>
  float chunk_sums(int64_t n, const F& f, int which) {
    weights_.resize(static_cast<size_t>(n));
    float* w = weights_.data();
    for (int64_t i = 0; i < n; ++i) w[i] = f(i);
    const auto read = [w](int64_t i) { return w[i]; };
    float* out = sums(which);
    const int chunks = verify::num_chunks(n);
    for (int c = 0; c < chunks; ++c) {
      const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
      out[c] = verify::chunk_sum(read, begin, std::min<int64_t>(begin + verify::kChunk, n));
    }
    return verify::sequential_total(out, chunks);
  }

  template <class Pred>
  int64_t count_if(int64_t n, const Pred& pred) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += pred(i) ? 1 : 0;
    return count;
  }

  // The k-th largest value is unique, so any exact selection gives what the GPU's radix select
  // gives.
  template <class Load>
  float kth_largest(int64_t n, const Load& load, int64_t k) {
    scratch_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) scratch_[i] = load(i);
    std::nth_element(scratch_.begin(), scratch_.begin() + (k - 1), scratch_.end(),
                     std::greater<float>());
    return scratch_[k - 1];
  }

 private:
  std::vector<float> sums0_, sums1_, scratch_, weights_;
};

template <class T, class Q>
void run(const verify::VerifyArgs& args) {
  // A row costs a few passes over V; small vocabularies (statistical tests) batch many rows.
  const int64_t per_row = std::max<int64_t>(1, args.vocab * args.n);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_row);
  parallel_for(args.batch, grain, [&](int64_t begin, int64_t end) {
    CpuExec ex(args.vocab);
    for (int64_t b = begin; b < end; ++b) verify::verify_sequence<CpuExec, T, Q>(ex, args, b);
  });
}

template <class T>
void run_target(const verify::VerifyArgs& args, VerifyDType draft) {
  switch (draft) {
    case VerifyDType::kFloat16:
      return run<T, verify::Half>(args);
    case VerifyDType::kBFloat16:
      return run<T, verify::BFloat16>(args);
    default:
      return run<T, float>(args);  // float32 draft, or none (null pointer, never read)
  }
}

}  // namespace

void verify(const verify::VerifyArgs& args, VerifyDType target, VerifyDType draft) {
  switch (target) {
    case VerifyDType::kFloat16:
      return run_target<verify::Half>(args, draft);
    case VerifyDType::kBFloat16:
      return run_target<verify::BFloat16>(args, draft);
    default:
      return run_target<float>(args, draft);
  }
}

}  // namespace cpu
}  // namespace sd
