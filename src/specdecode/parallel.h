// A small thread pool of our own, so the library never loads a second OpenMP runtime beside
// torch's. Results of every op are per-row deterministic, so they never depend on the number of
// threads.
#pragma once

#include <cstdint>
#include <functional>

namespace sd {

// Number of threads parallel_for may use (>= 1). Defaults to SPECDECODE_NUM_THREADS if set,
// else the CPUs this process may run on.
int num_threads();

// n <= 0 restores the default. Takes effect for the next parallel_for.
void set_num_threads(int n);

// Calls fn(begin, end) over disjoint chunks covering [0, n), each at least `grain` long except
// the last. The calling thread takes part. A call made while the pool is busy (a nested call, or
// a second caller thread) runs serially in its own thread, so concurrent callers never deadlock.
// An exception thrown by fn is rethrown in the caller after all chunks have finished.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace sd
