#include "specdecode/parallel.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#if defined(__linux__)
#include <link.h>  // dl_iterate_phdr: the loaded objects, to find an OpenMP runtime
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace sd {
namespace {

int cpu_count() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

int env_num_threads() {
  if (const char* env = std::getenv("SPECDECODE_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return 0;
}

Threading env_threading() {
  const char* env = std::getenv("SPECDECODE_THREADING");
  return env != nullptr && std::strcmp(env, "pool") == 0 ? Threading::kPool : Threading::kAuto;
}

// One parallel_for. Chunks are claimed through an atomic counter by whichever threads take part,
// so a thread that joins late takes fewer chunks and the split never waits for it.
struct Job {
  Job(const std::function<void(int64_t, int64_t)>* f, int64_t total, int64_t chunk, int64_t count)
      : fn(f), n(total), grain(chunk), chunks(count) {}
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t n, grain, chunks;
  std::atomic<int64_t> next_chunk{0};
  std::atomic<int64_t> finished_chunks{0};
  int active = 0;  // pool helpers inside work(); guarded by the pool's mutex
  std::exception_ptr error;
  std::mutex error_mu;
};

void work(Job& job) {
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

// ---- An OpenMP runtime already in the process -----------------------------------------------
// Why: torch's OpenMP threads spin for a while after each of torch's parallel regions. Our kernels
// run right after one (the projection before attention, the LM head before verify), and a pool of
// our own then shares the cores with spinning threads: B=1 S=4096 decoding attention measured 1.8x
// slower after a torch matmul than after a single-threaded copy (bench/RESULTS.md, threading).
// On the runtime's own team the spinning threads are the ones that take our chunks.
// GNU libgomp, LLVM libomp and Intel libiomp5 all export GOMP_parallel (GCC's ABI for
// `#pragma omp parallel`), so one entry point serves the three; it is looked up in the copy that is
// already loaded (RTLD_NOLOAD), never loaded by us.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpGetInt = int (*)();

struct OpenMpRuntime {
  GompParallel parallel;
  OmpGetInt max_threads;  // may be null
  std::string path;
};

#if defined(__linux__)
bool names_openmp_runtime(const char* path) {
  const char* base = std::strrchr(path, '/');
  base = base != nullptr ? base + 1 : path;
  for (const char* prefix : {"libgomp", "libiomp5", "libomp"}) {
    const size_t len = std::strlen(prefix);
    // libgomp.so.1, and the renamed copies wheels bundle (libgomp-a34b3233.so.1).
    if (std::strncmp(base, prefix, len) == 0 && (base[len] == '.' || base[len] == '-')) return true;
  }
  return false;
}

// The count of objects ever loaded into the process (glibc's dlpi_adds), or 0 where the loader
// does not report it. A rescan is needed only when it has grown.
unsigned long long loaded_object_adds() {
  unsigned long long adds = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t size, void* data) -> int {
        if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds))
          *static_cast<unsigned long long*>(data) = info->dlpi_adds;
        return 1;  // the counter is the same in every entry: stop at the first
      },
      &adds);
  return adds;
}

// The loaded OpenMP runtime to borrow, preferring torch's copy when several are loaded.
const OpenMpRuntime* find_loaded_openmp() {
  std::vector<std::string> paths;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0' &&
            names_openmp_runtime(info->dlpi_name))
          static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
        return 0;
      },
      &paths);
  std::stable_partition(paths.begin(), paths.end(), [](const std::string& p) {
    return p.find("/torch/") != std::string::npos;
  });
  for (const std::string& path : paths) {
    // The handle is kept for the life of the process; the runtime is loaded by its owner anyway.
    void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    auto parallel = reinterpret_cast<GompParallel>(dlsym(handle, "GOMP_parallel"));
    auto max_threads = reinterpret_cast<OmpGetInt>(dlsym(handle, "omp_get_max_threads"));
    if (parallel == nullptr) {
      dlclose(handle);
      continue;
    }
    return new OpenMpRuntime{parallel, max_threads, path};  // leaked with the handle, on purpose
  }
  return nullptr;
}
#else
// Without dl_iterate_phdr (macOS) the loaded objects are not enumerated: no runtime is found and
// every job runs on the pool of our own (as SPECDECODE_THREADING=pool does on Linux).
unsigned long long loaded_object_adds() { return 0; }
const OpenMpRuntime* find_loaded_openmp() { return nullptr; }
#endif

void run_team_member(void* job) { work(*static_cast<Job*>(job)); }

// ---- Our own pool ---------------------------------------------------------------------------
// One job at a time; workers sleep on `wake` between jobs. Invariant: `busy` is held by exactly
// the thread that published the current job, from publishing it until all chunks are done.
class Pool {
 public:
  static Pool& instance() {
    Pool* pool = current().load(std::memory_order_acquire);
    if (pool != nullptr) return *pool;
    std::lock_guard<std::mutex> lock(create_mu());
    pool = current().load(std::memory_order_acquire);
    if (pool == nullptr) {
      pool = new Pool();
      current().store(pool, std::memory_order_release);
    }
    return *pool;
  }

  // In the child of a fork: the parent's helpers do not exist here, and its mutexes may have
  // been held at the fork by threads that are gone, so the child starts a pool of its own. The
  // old one is abandoned, not destroyed (its state is not safe to touch).
  static void forget_after_fork() { current().store(new Pool(), std::memory_order_release); }

  void run(int64_t n, int64_t grain, int64_t chunks, int want,
           const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
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
  void ensure_workers(int count) {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this, index = static_cast<int>(workers_.size())] { loop(index); });
      workers_.back().detach();
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

  // Pools are leaked on purpose: joining threads from a static destructor at interpreter exit
  // can hang.
  static std::atomic<Pool*>& current() {
    static std::atomic<Pool*> pool{nullptr};
    return pool;
  }
  static std::mutex& create_mu() {
    static std::mutex* mu = new std::mutex();
    return *mu;
  }

  std::mutex busy_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  Job* job_ = nullptr;
  int helpers_wanted_ = 0;
  uint64_t generation_ = 0;
};

// ---- fork ------------------------------------------------------------------------------------
// An OpenMP team does not survive fork: in the child, GNU libgomp waits at the first parallel
// region for the parent's threads, which do not exist there (torch's own ops hang the same way).
// A forked child therefore runs every parallel_for on a fresh pool of ours. The handler is
// registered when the library loads, so it also covers a fork after torch alone used the team.
std::atomic<bool> g_forked_child{false};

void on_fork_child() {
  g_forked_child.store(true);
  Pool::forget_after_fork();
}

[[maybe_unused]] const int g_atfork_registered = pthread_atfork(nullptr, nullptr, &on_fork_child);

// Whether parallel_for may run on the team of `rt` (null: no runtime found, or our pool chosen).
bool team_usable(const OpenMpRuntime* rt) {
  return rt != nullptr && !g_forked_child.load(std::memory_order_relaxed);
}

// ---- The choice between them ----------------------------------------------------------------
class Threads {
 public:
  static Threads& instance() {
    static Threads* threads = new Threads();
    return *threads;
  }

  // Threads for a parallel_for on `rt` (null: our pool).
  int count(const OpenMpRuntime* rt) const {
    const int n = explicit_threads_.load();
    if (n > 0) return n;
    if (rt != nullptr && rt->max_threads != nullptr) return std::max(1, rt->max_threads());
    return cpu_count_;
  }

  void set_count(int n) { explicit_threads_.store(n > 0 ? n : env_num_threads()); }

  Threading mode() const { return mode_.load(); }

  void set_mode(Threading mode) {
    if (mode == Threading::kOpenMp && lookup(/*force=*/true) == nullptr)
      throw std::runtime_error(
          "threading 'openmp': no OpenMP runtime is loaded in this process (import torch first, "
          "or use 'auto')");
    mode_.store(mode);
  }

  // The runtime parallel_for runs on now, or null for our pool.
  const OpenMpRuntime* openmp() {
    return mode_.load() == Threading::kPool ? nullptr : lookup(/*force=*/false);
  }

 private:
  Threads()
      : explicit_threads_(env_num_threads()), cpu_count_(cpu_count()), mode_(env_threading()) {}

  // Once found, a runtime stays: it cannot be unloaded while its owner (torch) is loaded.
  const OpenMpRuntime* lookup(bool force) {
    if (const OpenMpRuntime* rt = runtime_.load(std::memory_order_acquire)) return rt;
    const unsigned long long adds = loaded_object_adds();
    if (!force && adds == scanned_adds_.load(std::memory_order_relaxed)) return nullptr;
    std::lock_guard<std::mutex> lock(scan_mu_);
    if (const OpenMpRuntime* rt = runtime_.load(std::memory_order_acquire)) return rt;
    const OpenMpRuntime* found = find_loaded_openmp();
    scanned_adds_.store(adds, std::memory_order_relaxed);
    if (found != nullptr) runtime_.store(found, std::memory_order_release);
    return found;
  }

  std::atomic<int> explicit_threads_;
  const int cpu_count_;
  std::atomic<Threading> mode_;
  std::atomic<const OpenMpRuntime*> runtime_{nullptr};
  std::atomic<unsigned long long> scanned_adds_{~0ull};  // never a real count: the first call scans
  std::mutex scan_mu_;
};

}  // namespace

int num_threads() {
  Threads& threads = Threads::instance();
  return threads.count(threads.openmp());
}

void set_num_threads(int n) { Threads::instance().set_count(n); }

void set_threading(Threading mode) { Threads::instance().set_mode(mode); }

Threading threading() { return Threads::instance().mode(); }

ThreadingBackend threading_backend() {
  const OpenMpRuntime* rt = Threads::instance().openmp();
  if (team_usable(rt)) return {"openmp", rt->path};
  return {"pool", ""};
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  Threads& threads = Threads::instance();
  const OpenMpRuntime* rt = threads.openmp();
  const int want = static_cast<int>(std::min<int64_t>(threads.count(rt), chunks));
  if (want <= 1) {
    fn(0, n);
    return;
  }
  // In a forked child the count above still follows the runtime's (torch's); only its team is
  // unusable there.
  if (!team_usable(rt)) {
    Pool::instance().run(n, grain, chunks, want, fn);
    return;
  }
  Job job(&fn, n, grain, chunks);
  rt->parallel(&run_team_member, &job, static_cast<unsigned>(want), 0);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace sd
