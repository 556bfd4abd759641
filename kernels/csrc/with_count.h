// A run-time count turned into a template argument, for kernels unrolled per row or head count.
#pragma once

#include <cstdint>
#include <type_traits>

namespace llmserve {

// f(std::integral_constant<int, C>) for a count C in [1, Max]: one instantiation of f's body per count.
template <int Max, class F>
void with_count(int64_t C, F&& f) {
  if constexpr (Max > 1) {
    if (C < Max) return with_count<Max - 1>(C, f);
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace llmserve
