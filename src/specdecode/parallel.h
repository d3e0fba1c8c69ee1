// Threads of the CPU kernels. The library never loads an OpenMP runtime of its own: when one is
// already in the process (torch's), parallel_for runs on that runtime's team, so our kernels and
// torch's share one set of threads; otherwise it runs on a small pool of our own. Results of every
// op are per-row deterministic, so they never depend on the number of threads or on the backend.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace sd {

// Number of threads parallel_for may use (>= 1): the count set by set_num_threads or
// SPECDECODE_NUM_THREADS if any; else, on an OpenMP team, the runtime's omp_get_max_threads()
// (which torch.set_num_threads sets); else the CPUs this process may run on.
int num_threads();

// n <= 0 restores the default. Takes effect for the next parallel_for.
void set_num_threads(int n);

// Where parallel_for runs its chunks. kAuto (the default, or SPECDECODE_THREADING=auto) takes an
// OpenMP runtime as soon as one is loaded and our pool until then; kPool (SPECDECODE_THREADING=
// pool) always takes our pool; kOpenMp requires a loaded runtime.
enum class Threading { kAuto, kPool, kOpenMp };

// Throws std::runtime_error for kOpenMp when no OpenMP runtime is loaded in this process.
void set_threading(Threading mode);
Threading threading();

// What the next parallel_for would run on: "openmp" or "pool", and the path of the OpenMP runtime
// ("" for the pool). In the child of a fork it is always our pool: an OpenMP team does not
// survive fork.
struct ThreadingBackend {
  std::string name;
  std::string runtime;
};
ThreadingBackend threading_backend();

// Calls fn(begin, end) over disjoint chunks covering [0, n), each at least `grain` long except
// the last. The calling thread takes part. A call made while the pool is busy (a nested call, or
// a second caller thread) runs serially in its own thread, so concurrent callers never deadlock;
// on an OpenMP team a nested call runs as the runtime runs nested regions (serially by default).
// An exception thrown by fn is rethrown in the caller after all chunks have finished.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace sd
