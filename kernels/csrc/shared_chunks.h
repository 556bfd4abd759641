// A kernel's items split among at::parallel_for's threads as they go, not up front.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace llmserve {

// Runs work(state, begin, end) over the items [0, n) in chunks that the threads take from one counter, each chunk a
// share of what is left (what is left / (2 x threads), at least one item). A static split makes the whole
// region wait for its slowest thread: on a shared CPU that is the thread whose core went to the API, the scheduler or
// a neighbour for a while, or the one that drew the longer sequences. Here the others take its items instead; large
// chunks first keep the counter's traffic to a few exchanges per thread, small last ones even out the finish. Which
// thread computes an item never changes its result. Each thread calls make_state() once (its scratch buffers).
template <class MakeState, class Work>
void share_chunks(int64_t n, const MakeState& make_state, const Work& work) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t end = std::min(n, begin + std::max<int64_t>(1, (n - begin) / (2 * threads)));
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {  // else `begin` is reloaded
        work(state, begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// The same without per-thread state: work(begin, end).
template <class Work>
void share_chunks(int64_t n, const Work& work) {
  share_chunks(n, [] { return 0; }, [&](int, int64_t begin, int64_t end) { work(begin, end); });
}

// Rows of a matmul per item: up to `block` (a multiple of the tile's rows), but one block for up to 2 x `block` rows,
// so that a decode step's few rows read each weight panel from memory once. A block of rows and one of the `columns`
// column items (a panel or a pair of panels) make an item; items run block by block, so a block's rows stay in the
// core's L2 across its panels. Where that leaves fewer than 8 items a thread (a 64-row step of a 576-output matmul: 9
// pairs of panels), the rows split into smaller blocks: the threads' last items then even out (one item of 9 is 11%
// of the call), and a panel read again comes from the caches.
inline int64_t row_block(int64_t rows, int64_t block, int64_t tile, int64_t columns) {
  int64_t blocks = rows <= 2 * block ? 1 : rows / block;
  const int64_t want = 8 * static_cast<int64_t>(at::get_num_threads());
  if (blocks * columns < want) blocks = std::min((want + columns - 1) / columns, (rows + tile - 1) / tile);
  blocks = std::max<int64_t>(blocks, 1);  // no rows (a prefill chunk's head): no items
  return std::max<int64_t>(((rows + blocks - 1) / blocks + tile - 1) / tile * tile, 1);
}

}  // namespace llmserve
