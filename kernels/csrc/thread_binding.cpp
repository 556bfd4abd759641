// Pins the threads of torch's OpenMP pool to cores, one each (the worker's --cpu-omp-threads-bind).
#include <torch/types.h>  // not torch/extension.h: no Python here, and half the parse

#include <omp.h>
#include <sched.h>

#include <cstdint>
#include <vector>

// Thread i of a team of cpus.size() threads (the calling thread is thread 0) runs on cpus[i] only from now on. libgomp
// keeps its pool's threads between regions, so later regions of up to that many threads run where they were pinned.
// Returns the cores that refused (not in this process's allowed set), empty when all took.
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<int64_t> refused;
  if (n == 0) return refused;
  std::vector<int> failed(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    failed[i] = sched_setaffinity(0, sizeof(set), &set) != 0;  // 0: the calling thread
  }
  for (int i = 0; i < n; ++i)
    if (failed[i]) refused.push_back(cpus[i]);
  return refused;
}
