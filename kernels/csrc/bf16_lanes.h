// bfloat16 in AVX-512 lanes, rounded as torch rounds float32 to bfloat16 (to nearest even; NaN -> 0x7fc0).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace llmserve {

// float32 -> bfloat16 bits in the low half of each lane
inline __m512i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_srli_epi32(r, 16);
}

// the bfloat16 value nearest v, as float32
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16(v), 16)); }

}  // namespace llmserve
#endif
