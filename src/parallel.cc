#include "specdecode/parallel.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace sd {
namespace {

int default_num_threads() {
  if (const char* env = std::getenv("SPECDECODE_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// One job at a time; workers sleep on `wake` between jobs. Invariant: `busy` is held by exactly
// the thread that published the current job, from publishing it until all chunks are done.
class Pool {
 public:
  static Pool& instance() {
    // Leaked on purpose: joining threads from a static destructor at interpreter exit can hang.
    static Pool* pool = new Pool();
    return *pool;
  }

  int threads() const { return threads_.load(); }

  void set_threads(int n) { threads_.store(n > 0 ? n : default_num_threads()); }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t chunks = (n + grain - 1) / grain;
    const int want = static_cast<int>(std::min<int64_t>(threads_.load(), chunks));
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (want <= 1 || !busy.owns_lock()) {
      fn(0, n);
      return;
    }
    ensure_workers(want - 1);

    Job job(&fn, n, grain, chunks);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      helpers_wanted_ = want - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(job);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return job.finished_chunks.load() == chunks && job.active == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  struct Job {
    Job(const std::function<void(int64_t, int64_t)>* f, int64_t total, int64_t chunk, int64_t count)
        : fn(f), n(total), grain(chunk), chunks(count) {}
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, grain, chunks;
    std::atomic<int64_t> next_chunk{0};
    std::atomic<int64_t> finished_chunks{0};
    int active = 0;  // helpers inside work(); guarded by mu_
    std::exception_ptr error;
    std::mutex error_mu;
  };

  Pool() : threads_(default_num_threads()) {}

  void ensure_workers(int count) {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this, index = static_cast<int>(workers_.size())] { loop(index); });
      workers_.back().detach();
    }
  }

  static void work(Job& job) {
    for (;;) {
      const int64_t c = job.next_chunk.fetch_add(1);
      if (c >= job.chunks) return;
      const int64_t begin = c * job.grain;
      const int64_t end = std::min(job.n, begin + job.grain);
      try {
        (*job.fn)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(job.error_mu);
        if (!job.error) job.error = std::current_exception();
      }
      job.finished_chunks.fetch_add(1);
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (job_ == nullptr || index >= helpers_wanted_) continue;
      Job* job = job_;
      ++job->active;
      lock.unlock();
      work(*job);
      lock.lock();
      --job->active;
      done_.notify_all();
    }
  }

  std::atomic<int> threads_;
  std::mutex busy_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  Job* job_ = nullptr;
  int helpers_wanted_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace

int num_threads() { return Pool::instance().threads(); }

void set_num_threads(int n) { Pool::instance().set_threads(n); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  Pool::instance().run(n, grain, fn);
}

}  // namespace sd
