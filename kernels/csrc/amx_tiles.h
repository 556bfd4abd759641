// What every AMX kernel needs around its tile instructions: the process's permission, a tile configuration, and
// borrowing the thread's tiles without disturbing oneDNN's.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace llmserve {

// Linux hands out the AMX register state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); asked once, the answer holds for every thread.
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The thread's tile configuration while a kernel borrows the tiles: oneDNN (torch's bfloat16 matmuls) may keep its
// own configured between calls and skip reloading it, so it is put back as it was (or released, if there was none).
struct BorrowedTiles {
  TileConfig saved;
  bool taken = false;
  void take() {
    if (!taken) _tile_storeconfig(&saved);
    taken = true;
  }
  ~BorrowedTiles() {
    if (!taken) return;
    if (saved.palette != 0)
      _tile_loadconfig(&saved);
    else
      _tile_release();
  }
};

}  // namespace llmserve
#endif
