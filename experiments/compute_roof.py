"""The multiply-add rate this CPU reaches in a loop that does nothing else (AVX-512 FMA for float32, AVX512-BF16
`vdpbf16ps` for bfloat16), and the output tokens/s it allows the peer benchmark's workload on SmolLM2-135M: if every
matmul of every request ran at that rate and nothing else took the cores. No server can pass that line; the note of
wave 16 (docs/benchmarks.md) puts llmserve's and vLLM's figures against it.

The loop is C (built here with `gcc -O2 -march=native -fopenmp`): `--threads` threads, 12 independent accumulators
each, so that no multiply-add waits on another's latency. AVX2 + FMA where the CPU has no AVX-512; bfloat16 only where
it has AVX512-BF16.

    python -m experiments.compute_roof [--threads 2] [--seconds 1] [--input-len 128] [--output-len 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# SmolLM2-135M: hidden, intermediate, layers, query heads, KV heads, head size, vocabulary
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 30, 9, 3, 64, 49152

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define ZERO() _mm512_setzero_ps()
#define SET1(v) _mm512_set1_ps(v)
#define FMA(x, w, a) _mm512_fmadd_ps(x, w, a)
#define SUM(a) _mm512_reduce_add_ps(a)
#else  // AVX2 + FMA
typedef __m256 vec;
#define LANES 8
#define ZERO() _mm256_setzero_ps()
#define SET1(v) _mm256_set1_ps(v)
#define FMA(x, w, a) _mm256_fmadd_ps(x, w, a)
static float SUM(__m256 a) {
  float t[8];
  _mm256_storeu_ps(t, a);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

// multiply-adds per second: 12 independent sums per thread; bfloat16: 32 products per instruction, else LANES
static double run(int bf16, long iters, int threads) {
  double t0 = omp_get_wtime(), sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    if (bf16) {
#ifdef __AVX512BF16__
      __m512 a[12];
      for (int i = 0; i < 12; i++) a[i] = _mm512_setzero_ps();
      __m512i xb = _mm512_set1_epi32(0x3f803f80), wb = _mm512_set1_epi32(0x30803080);
      for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)xb, (__m512bh)wb);
        __asm__ volatile("" : "+v"(xb));
      }
      for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(a[i]);
#endif
    } else {
      vec a[12];
      for (int i = 0; i < 12; i++) a[i] = ZERO();
      vec x = SET1(1.0f), w = SET1(1e-9f);
      for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = FMA(x, w, a[j]);
        __asm__ volatile("" : "+v"(x));
      }
      for (int i = 0; i < 12; i++) sink += SUM(a[i]);
    }
  }
  double t = omp_get_wtime() - t0;
  if (sink == 12345.678) printf("-");  // keeps the sums alive
  return (double)threads * iters * 12 * (bf16 ? 32 : LANES) / t;
}

int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  double seconds = atof(argv[2]);
#ifdef __AVX512BF16__
  const int dtypes = 2;
#else
  const int dtypes = 1;
#endif
  for (int bf16 = 0; bf16 < dtypes; bf16++) {
    long iters = 1000;  // doubled until a run takes a tenth of the time asked (thread start-up is then noise)
    double t0 = omp_get_wtime();
    while (run(bf16, iters, threads) > 0 && omp_get_wtime() - t0 < seconds / 10) {
      iters *= 2;
      t0 = omp_get_wtime();
    }
    iters *= 10;
    double best = 0;
    for (int r = 0; r < 3; r++) {
      double rate = run(bf16, iters, threads);
      if (rate > best) best = rate;
    }
    printf("%s %.6e\n", bf16 ? "bfloat16" : "float32", best);
  }
  return 0;
}
"""


def request_macs(input_len: int, output_len: int) -> int:
    """Matmul multiply-adds of one request: every prompt token through the layers, the head for the last prompt
    token and for each later token (whose forward makes the next one)."""
    per_layer = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    layers, head = LAYERS * per_layer, VOCAB * HIDDEN
    return input_len * layers + head + (output_len - 1) * (layers + head)


def measure(threads: int, seconds: float) -> dict[str, float]:
    """Best of three runs of the loop, in multiply-adds per second, per dtype."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "roof.c", Path(tmp) / "roof"
        src.write_text(SOURCE)
        try:
            subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True,
                           capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"compute_roof: the loop did not build (it needs AVX2 and FMA): {e.stderr}") from None
        out = subprocess.run([str(exe), str(threads), str(seconds)], check=True, capture_output=True, text=True)
    return {name: float(value) for name, value in (line.split() for line in out.stdout.splitlines())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0, help="per run of the loop (three runs per dtype)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (the peer benchmark's)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    macs = request_macs(a.input_len, a.output_len)
    rates = measure(a.threads, a.seconds)
    rows = []
    for dtype, rate in rates.items():
        roof = rate / macs * a.output_len
        # unrounded: a loaded machine's roof for a tiny request (the smoke test's) is under one token/s
        rows.append({"dtype": dtype, "threads": a.threads, "gmac_per_s": rate / 1e9, "macs_per_request": macs,
                     "output_tokens_per_s_roof": roof})
        print(f"{dtype:9s} {rate / 1e9:7.1f} GMAC/s on {a.threads} threads; {macs / 1e9:.2f} GMAC per request of "
              f"{a.input_len} + {a.output_len} tokens: at most {roof:.0f} output tokens/s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
