"""Triton paged-attention kernels on one NVIDIA GPU (written for an H200): correctness grid + four figures.

Needs only torch (CUDA build), triton and this repository; installs nothing, downloads nothing. Run from the
repository root:

    python -m experiments.kernels_gpu                      # grid (bf16, fp16, fp32) + figures (a)-(d): table + JSON
    python -m experiments.kernels_gpu --sweep              # also time a few tile configs per figure, report the best
    python -m experiments.kernels_gpu --json results.json  # where the JSON goes (also printed on stdout)
    python -m experiments.kernels_gpu --smoke              # no GPU: tiny grid under TRITON_INTERPRET=1 (~1 min on CPU)
    python -m experiments.kernels_gpu --compile-only       # no GPU: compile the kernels for sm_90a, registers/spills

Figures (bf16, Hq/Hkv = 32/8, head dim 128, block size 16, shuffled block tables):

  (a) decode, 64 sequences x 4096 context: achieved HBM bandwidth (K/V + Q + out bytes / time) as a fraction
      of --hbm-tbps (4.8 TB/s, H200). Target >= 0.70.
  (b) decode, 1 sequence x 32768 context, split-KV: same measure. Target >= 0.50. Timed in a CUDA graph (one
      sequence is ~30 us of traffic: Python launch overhead would otherwise be the figure).
  (c) one 4096-token prefill chunk over 8192 cached tokens: TFLOP/s (useful causal FLOPs, 4 * D * Hq per
      visible query-key pair) against torch's flash-attention op (SDPA's flash backend; causal, which for
      seq_q != seq_k is aligned bottom-right) on the same dense tensors, GQA expanded. Target >= 0.7x.
  (d) mixed batch (the 64 decodes of (a) + one 2048-token chunk over 6144 cached) in one launch against the
      decode and the prefill launched separately. Target: mixed <= 1.2x their sum.

Every figure's inputs are first checked against the torch reference (kernels/reference.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# Figure sizes (a dry run on CPU may shrink them): (a) decodes x context, (b) context, (c) chunk, cached,
# (d) decodes x context + chunk over cached.
SIZES = {"a": (64, 4096), "b": 32768, "c": (4096, 8192), "d": (64, 4096, 2048, 6144)}
TOL = {"float32": (1e-3, 1e-3), "float16": (1.5e-2, 1e-2), "bfloat16": (1.5e-2, 1e-2)}


# ------------------------------------------------------------------------------------------- inputs


def make_batch(shapes, hq, hkv, dim, block_size, dtype, device, seed=0, nan_fill=True):
    """Paged K/V for sequences [(query_len, seq_len)] in shuffled blocks; unused slots NaN (when nan_fill).

    Returns dict(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, shapes).
    Block-table entries past a sequence's last block are -1 (never to be read).
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-s // block_size) for _, s in shapes]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    fill = float("nan") if nan_fill else 0.0
    key_cache = torch.full((num_blocks, block_size, hkv, dim), fill, dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, fill)
    tables = torch.full((len(shapes), max(need) + 1), -1, dtype=torch.int32)
    flat_k, flat_v = key_cache.view(-1, hkv, dim), value_cache.view(-1, hkv, dim)
    for i, (n, (_, s)) in enumerate(zip(need, shapes, strict=True)):
        table, ids = ids[:n], ids[n:]
        tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(s)
        slots = (torch.tensor(table)[pos // block_size] * block_size + pos % block_size).to(device)
        flat_k[slots] = torch.randn(s, hkv, dim, generator=gen).to(device, dtype)
        flat_v[slots] = torch.randn(s, hkv, dim, generator=gen).to(device, dtype)
    total_q = sum(q for q, _ in shapes)
    cu = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([q for q, _ in shapes]), 0)
    return {
        "query": torch.randn(total_q, hq, dim, generator=gen).to(device, dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables.to(device),
        "cu_seqlens_q": cu.to(device),
        "seq_lens": torch.tensor([s for _, s in shapes], dtype=torch.int32, device=device),
        "shapes": shapes,
    }


def run_triton(b, **kw):
    from kernels import triton_attention as tri

    return tri.paged_attention(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["cu_seqlens_q"],
                               b["seq_lens"], _scale(b), **kw)


def run_reference(b):
    from kernels import reference as ref

    return ref.paged_attention(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["cu_seqlens_q"],
                               b["seq_lens"], _scale(b))


def _scale(b) -> float:
    return b["query"].shape[-1] ** -0.5


def verify(b) -> dict:
    """The kernel's output for batch b against the torch reference."""
    out, expected = run_triton(b), run_reference(b)
    dtype_name = str(out.dtype).removeprefix("torch.")
    return {"max_err_vs_reference": max_err(out, expected), "within_tolerance": within_tol(out, expected, dtype_name)}


def max_err(out, expected) -> float:
    return (out.float() - expected.float()).abs().max().item() if out.numel() else 0.0


def within_tol(out, expected, dtype_name) -> bool:
    import torch

    atol, rtol = TOL[dtype_name]
    if out.isnan().any():
        return False
    return bool(torch.isclose(out.float(), expected.float(), atol=atol, rtol=rtol).all())


# -------------------------------------------------------------------------------------- correctness


def grid_cases(size: str):
    """[(dtype, (Hq, Hkv), head_dim, mix name, shapes, block_size, kwargs)] for size smoke / default / full.

    Every distinct tile shape is a Triton compile (seconds each), so the default GPU grid covers the axes
    rather than their product: bf16 (the production dtype) on every head layout x head dim, every mix on
    the production layout (32/8, d128) with KV tiles equal to / different from the block and 1/4/16
    splits, and a few float16 / float32 cases. `full` is the product (slow to compile).
    """
    mixes = {
        "decode": [(1, 37), (1, 16), (1, 32), (1, 1), (1, 70)],
        "mixed": [(1, 150), (5, 18), (33, 97)],
        "mid_block": [(20, 45), (1, 9), (7, 39)],
        "prefill": [(40, 40), (16, 16), (32, 32), (3, 3)],
        "long": [(1, 4096), (1, 1000), (300, 2000), (128, 128)],
    }
    if size == "smoke":
        return [
            ("float32", (8, 2), 64, "mixed", mixes["mixed"], 16, {"tile_n": 32}),
            ("bfloat16", (6, 2), 80, "decode", mixes["decode"], 32, {"num_splits": 4, "tile_n": 16}),
            ("float16", (4, 4), 64, "mid_block", mixes["mid_block"], 16, {}),
        ]
    heads_list = [(4, 4), (8, 2), (6, 2), (16, 1), (32, 8)]
    dims = (64, 128, 80)
    names = list(mixes)
    cases = []
    if size == "full":
        for i, heads in enumerate(heads_list):
            for j, dim in enumerate(dims):
                for k, name in enumerate(names):
                    for dtype in ("bfloat16", "float16", "float32"):
                        block_size = (16, 32)[(i + j + k) % 2]
                        kw = {"tile_n": (block_size, 16, 32, 64)[(i + k) % 4]}
                        if name in ("decode", "long"):
                            kw["num_splits"] = (1, 4, 16)[(i + j) % 3]
                        cases.append((dtype, heads, dim, name, mixes[name], block_size, kw))
        return cases
    for i, heads in enumerate(heads_list):
        for j, dim in enumerate(dims):
            name = names[(i + j) % len(names)]
            cases.append(("bfloat16", heads, dim, name, mixes[name], (16, 32)[(i + j) % 2], {}))
    for name in names:
        for kw in ({"tile_n": 16}, {"tile_n": 32, "num_splits": 4}, {"tile_n": 64, "num_splits": 16}):
            cases.append(("bfloat16", (32, 8), 128, name, mixes[name], 16, kw))
    for dtype in ("float16", "float32"):
        cases.append((dtype, (8, 2), 128, "mixed", mixes["mixed"], 16, {}))
        cases.append((dtype, (32, 8), 128, "decode", mixes["decode"], 16, {"num_splits": 4}))
    return cases


def check_grid(device: str, size: str = "default", verbose: bool = False) -> dict:
    """Run the grid on `device` against the torch reference; returns a summary (and every failure)."""
    import torch

    failures, worst = [], {}
    t0 = time.perf_counter()
    cases = grid_cases(size)
    for n, (dtype_name, heads, dim, mix, shapes, block_size, kw) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        b = make_batch(shapes, heads[0], heads[1], dim, block_size, dtype, device, seed=n)
        out = run_triton(b, **kw)
        expected = run_reference(b)
        err = max_err(out, expected)
        worst[dtype_name] = max(worst.get(dtype_name, 0.0), err)
        ok = within_tol(out, expected, dtype_name)
        if not ok:
            failures.append({"dtype": dtype_name, "heads": heads, "head_dim": dim, "mix": mix,
                             "block_size": block_size, "kwargs": kw, "max_err": err})
        if verbose:
            print(f"  {'ok ' if ok else 'BAD'} {dtype_name:8s} {heads} d{dim} {mix:9s} b{block_size} {kw} "
                  f"err {err:.2e}", flush=True)
    return {"cases": len(cases), "failed": len(failures), "max_err_by_dtype": worst, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1)}


# -------------------------------------------------------------------------------------------- timing


def bench_ms(fn, graph: bool) -> float:
    """Median ms per call; in a CUDA graph when `graph` (no Python launch overhead)."""
    import torch
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def sweep(b, candidates, graph):
    """Time every candidate kwargs set; returns [(ms, kwargs)] sorted, failures skipped (and reported)."""
    results = []
    for kw in candidates:
        try:
            results.append((bench_ms(lambda kw=kw: run_triton(b, **kw), graph), kw))
        except Exception as e:  # an out-of-resources config, say: report and keep going
            print(f"  config {kw} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return sorted(results, key=lambda r: r[0])


def kv_bytes(b) -> int:
    """Bytes the kernel must move: K and V of every position attended, Q in, out."""
    kv = b["key_cache"]
    per_token = 2 * kv.shape[2] * kv.shape[3] * kv.element_size()
    seq_total = sum(s for _, s in b["shapes"])
    q = b["query"]
    return seq_total * per_token + 2 * q.numel() * q.element_size()


def causal_flops(shapes, hq, dim) -> float:
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in shapes)
    return 4.0 * dim * hq * pairs


def figure_a(device, dtype, hbm, do_sweep):
    num, ctx = SIZES["a"]
    b = make_batch([(1, ctx)] * num, HQ, HKV, HEAD_DIM, BLOCK_SIZE, dtype, device, seed=1, nan_fill=False)
    err = verify(b)
    ms = bench_ms(lambda: run_triton(b), graph=True)
    ms_eager = bench_ms(lambda: run_triton(b), graph=False)
    res = {"what": f"decode {num} x {ctx}, {HQ}/{HKV} heads, d{HEAD_DIM}", **err, "ms": ms,
           "ms_eager": ms_eager, "bytes": kv_bytes(b), "tbps": kv_bytes(b) / ms / 1e9,
           "fraction_of_hbm": kv_bytes(b) / ms / 1e9 / hbm, "target": ">= 0.70"}
    if do_sweep:
        cands = [{"tile_n": n, "num_warps": w, "num_stages": s, "num_splits": sp}
                 for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4) for sp in (1, 2)]
        best = sweep(b, cands, graph=True)
        if best:
            res["sweep_best"] = {"ms": best[0][0], "kwargs": best[0][1],
                                 "fraction_of_hbm": kv_bytes(b) / best[0][0] / 1e9 / hbm}
    return res


def figure_b(device, dtype, hbm, do_sweep):
    from kernels import triton_attention as tri

    b = make_batch([(1, SIZES["b"])], HQ, HKV, HEAD_DIM, BLOCK_SIZE, dtype, device, seed=2, nan_fill=False)
    splits = tri.choose_num_splits(1, 1, HKV, b["query"].device)
    err = verify(b)
    ms = bench_ms(lambda: run_triton(b), graph=True)
    ms_nosplit = bench_ms(lambda: run_triton(b, num_splits=1), graph=True)
    res = {"what": f"decode 1 x {SIZES['b']}, split-KV, {HQ}/{HKV} heads, d{HEAD_DIM}",
           "num_splits": splits, **err,
           "ms": ms, "ms_without_split": ms_nosplit, "ms_eager": bench_ms(lambda: run_triton(b), graph=False),
           "bytes": kv_bytes(b), "tbps": kv_bytes(b) / ms / 1e9, "fraction_of_hbm": kv_bytes(b) / ms / 1e9 / hbm,
           "target": ">= 0.50"}
    if do_sweep:
        cands = [{"num_splits": sp, "tile_n": n, "num_warps": w}
                 for sp in (16, 32, 48, 64, 128) for n in (64, 128) for w in (4, 8)]
        best = sweep(b, cands, graph=True)
        if best:
            res["sweep_best"] = {"ms": best[0][0], "kwargs": best[0][1],
                                 "fraction_of_hbm": kv_bytes(b) / best[0][0] / 1e9 / hbm}
    return res


def flash_attention(q, k, v, scale):
    """torch's flash-attention op itself (what SDPA's flash backend runs), causal: with seq_q != seq_k its mask
    is aligned bottom-right, as ours (figure (c) reports its error against the reference to show it)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]


def figure_c(device, dtype, do_sweep):
    q_len, ctx = SIZES["c"]
    shapes = [(q_len, ctx + q_len)]
    b = make_batch(shapes, HQ, HKV, HEAD_DIM, BLOCK_SIZE, dtype, device, seed=3, nan_fill=False)
    err = verify(b)
    flops = causal_flops(shapes, HQ, HEAD_DIM)
    ms = bench_ms(lambda: run_triton(b), graph=False)

    # The same K/V as dense tensors, GQA expanded (flash does the same FLOPs either way).
    s = ctx + q_len
    table = b["block_tables"][0, : -(-s // BLOCK_SIZE)].long()
    k = b["key_cache"][table].reshape(-1, HKV, HEAD_DIM)[:s]
    v = b["value_cache"][table].reshape(-1, HKV, HEAD_DIM)[:s]
    group = HQ // HKV
    qd = b["query"].transpose(0, 1).unsqueeze(0).contiguous()                          # [1, Hq, q, D]
    kd = k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()       # [1, Hq, s, D]
    vd = v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()
    scale = HEAD_DIM ** -0.5

    def sdpa():
        return flash_attention(qd, kd, vd, scale)

    sdpa_err = max_err(sdpa()[0].transpose(0, 1), run_reference(b))
    ms_sdpa = bench_ms(sdpa, graph=False)
    tflops, tflops_sdpa = flops / ms / 1e9, flops / ms_sdpa / 1e9
    res = {"what": f"prefill chunk {q_len} over {ctx} cached, {HQ}/{HKV} heads, d{HEAD_DIM}",
           **err, "sdpa_max_err_vs_reference": sdpa_err, "ms": ms, "tflops": tflops, "sdpa_flash_ms": ms_sdpa,
           "sdpa_flash_tflops": tflops_sdpa, "ratio_vs_sdpa": tflops / tflops_sdpa, "target": ">= 0.7"}
    if do_sweep:
        cands = [{"tile_q": tq, "tile_n": n, "num_warps": w, "num_stages": st}
                 for tq in (16, 32) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        best = sweep(b, cands, graph=False)
        if best:
            res["sweep_best"] = {"ms": best[0][0], "kwargs": best[0][1],
                                 "ratio_vs_sdpa": flops / best[0][0] / 1e9 / tflops_sdpa}
    return res


def figure_d(device, dtype, do_sweep):
    import torch

    num, ctx, chunk_len, cached = SIZES["d"]
    decodes = [(1, ctx)] * num
    chunk = [(chunk_len, cached + chunk_len)]
    mixed = make_batch(decodes + chunk, HQ, HKV, HEAD_DIM, BLOCK_SIZE, dtype, device, seed=4, nan_fill=False)
    # The same tensors, split: views of the mixed batch's query and tables, same cache.
    n_dec = len(decodes)
    dec = dict(mixed, query=mixed["query"][:n_dec], block_tables=mixed["block_tables"][:n_dec],
               cu_seqlens_q=mixed["cu_seqlens_q"][: n_dec + 1], seq_lens=mixed["seq_lens"][:n_dec], shapes=decodes)
    pre = dict(mixed, query=mixed["query"][n_dec:], block_tables=mixed["block_tables"][n_dec:],
               cu_seqlens_q=torch.tensor([0, chunk[0][0]], dtype=torch.int32, device=device),
               seq_lens=mixed["seq_lens"][n_dec:], shapes=chunk)
    err = verify(mixed)
    ms_mixed = bench_ms(lambda: run_triton(mixed), graph=True)
    ms_dec = bench_ms(lambda: run_triton(dec), graph=True)
    ms_pre = bench_ms(lambda: run_triton(pre), graph=True)
    res = {"what": f"{num} decodes x {ctx} + one {chunk_len} chunk over {cached}, one launch vs two",
           **err,
           "ms_mixed": ms_mixed, "ms_decode_alone": ms_dec, "ms_prefill_alone": ms_pre,
           "ratio_vs_sum": ms_mixed / (ms_dec + ms_pre), "target": "<= 1.2"}
    if do_sweep:
        cands = [{"tile_q": tq, "tile_n": n, "num_warps": w} for tq in (4, 8, 16, 32) for n in (32, 64, 128)
                 for w in (4, 8)]
        best = sweep(mixed, cands, graph=True)
        if best:
            res["sweep_best"] = {"ms": best[0][0], "kwargs": best[0][1],
                                 "ratio_vs_sum": best[0][0] / (ms_dec + ms_pre)}
    return res


# ------------------------------------------------------------------------------ compile-only (no GPU)


def compile_only(arch: int = 90) -> list[dict]:
    """Compile the kernels for sm_<arch> with the bundled toolchain (no GPU needed); registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_attention as tri

    target = GPUTarget("cuda", arch, 32)
    floats = {"scale", "qk_scale", "softcap"}

    def build(fn, ptrs, constexprs, num_warps, num_stages=3):
        sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "fp32" if n in floats else "i32")
               for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in ptrs or n.startswith("stride_")}
        return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target,
                              options={"num_warps": num_warps, "num_stages": num_stages})

    results = []
    configs = [  # (what, dtype, num_tokens, num_seqs, G, D, extra constexprs)
        ("decode bf16 32/8 d128", "bf16", 64, 64, 4, 128, {}),
        ("decode split bf16 32/8 d128", "bf16", 1, 1, 4, 128, {"SPLIT": True}),
        ("mixed bf16 32/8 d128", "bf16", 2112, 65, 4, 128, {}),
        ("prefill bf16 32/8 d128", "bf16", 4096, 1, 4, 128, {}),
        ("prefill fp16 6/2 d80 window softcap", "fp16", 4096, 1, 3, 80, {"USE_WINDOW": True, "USE_SOFTCAP": True}),
        ("decode fp32 16/1 d256", "fp32", 8, 8, 16, 256, {}),
        ("window sinks: decode bf16 8/1 d64", "bf16", 64, 64, 8, 64, {"USE_WINDOW": True, "USE_SINKS": True}),
    ]
    for what, dt, num_tokens, num_seqs, group, dim, extra in configs:
        cfg = tri.kernel_config(num_tokens, num_seqs, group, 1, dim)
        cx = dict(G=group, G_PAD=triton.next_power_of_2(group), BLOCK_Q=cfg["tile_q"], BLOCK_N=cfg["tile_n"],
                  BLOCK_SIZE=16, HEAD_DIM=dim, D_PAD=max(16, triton.next_power_of_2(dim)), SPLIT=False,
                  USE_WINDOW=False, USE_SOFTCAP=False, USE_SINKS=False, FP32=dt == "fp32",
                  PRECISION="ieee" if dt == "fp32" else "tf32", RTNE_BF16=False)
        cx.update(extra)
        ptrs = {n: f"*{dt}" for n in ("Q", "K", "V", "Out")}
        ptrs.update({"P_OUT": "*fp32", "P_LSE": "*fp32", "Sinks": "*fp32", "block_tables": "*i32",
                     "cu_seqlens_q": "*i32", "seq_lens": "*i32"})
        t0 = time.perf_counter()
        k = build(tri._paged_attention_kernel, ptrs, cx, cfg["num_warps"], cfg["num_stages"])
        results.append({"kernel": "paged_attention", "what": what, **cfg, "shared_bytes": k.metadata.shared,
                        "uses_wgmma": "wgmma" in k.asm["ptx"], "pipelined_cp_async": "cp.async" in k.asm["ptx"],
                        **_ptxas_usage(k.asm["ptx"], arch), "compile_s": round(time.perf_counter() - t0, 1)})
    k = build(tri._merge_kernel, {"Out": "*bf16", "P_OUT": "*fp32", "P_LSE": "*fp32", "Sinks": "*fp32"},
              dict(BLOCK_H=1, S_PAD=64, HEAD_DIM=128, D_PAD=128, USE_SINKS=True, RTNE_BF16=False), 4)
    results.append({"kernel": "merge", "what": "64 splits d128", **_ptxas_usage(k.asm["ptx"], arch)})
    k = build(tri._write_kv_kernel, {"key": "*bf16", "value": "*bf16", "key_cache": "*bf16",
                                     "value_cache": "*bf16", "slot_mapping": "*i64"},
              dict(BLOCK_SIZE=16, HEAD_DIM=128, H_PAD=8, D_PAD=128, CONVERT=False, RTNE_BF16=False), 4)
    results.append({"kernel": "write_kv_cache", "what": "8 x 128 bf16", **_ptxas_usage(k.asm["ptx"], arch)})
    return results


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from `ptxas -v` (whichever bundled ptxas accepts the PTX); {} if none does."""
    import re

    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            exe = os.path.join(bindir, name)
            if not os.path.exists(exe):
                continue
            r = subprocess.run([exe, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spill = re.search(r"(\d+) bytes spill stores", r.stderr)
                return {"registers": int(regs.group(1)) if regs else None,
                        "spill_store_bytes": int(spill.group(1)) if spill else None}
    return {}


# ----------------------------------------------------------------------------------------------- main


def print_table(report: dict) -> None:
    rows = []
    f = report.get("figures", {})
    if "a" in f:
        rows.append(("(a) decode", f"{f['a']['fraction_of_hbm']:.2f} of HBM ({f['a']['tbps']:.2f} TB/s, "
                     f"{f['a']['ms'] * 1e3:.0f} us)", ">= 0.70", f["a"]["fraction_of_hbm"] >= 0.70))
    if "b" in f:
        rows.append(("(b) long decode, split-KV", f"{f['b']['fraction_of_hbm']:.2f} of HBM ({f['b']['num_splits']} "
                     f"splits, {f['b']['ms'] * 1e3:.0f} us)", ">= 0.50", f["b"]["fraction_of_hbm"] >= 0.50))
    if "c" in f:
        rows.append(("(c) prefill chunk", f"{f['c']['ratio_vs_sdpa']:.2f}x SDPA flash ({f['c']['tflops']:.0f} "
                     f"vs {f['c']['sdpa_flash_tflops']:.0f} TFLOP/s)", ">= 0.7", f["c"]["ratio_vs_sdpa"] >= 0.7))
    if "d" in f:
        rows.append(("(d) mixed vs separate", f"{f['d']['ratio_vs_sum']:.2f}x sum ({f['d']['ms_mixed'] * 1e3:.0f} "
                     f"vs {f['d']['ms_decode_alone'] * 1e3:.0f} + {f['d']['ms_prefill_alone'] * 1e3:.0f} us)",
                     "<= 1.2", f["d"]["ratio_vs_sum"] <= 1.2))
    if "grid" in report:
        g = report["grid"]
        rows.append(("correctness grid", f"{g['cases'] - g['failed']}/{g['cases']} within tolerance",
                     "all", g["failed"] == 0))
    width = max((len(r[1]) for r in rows), default=10)
    print(f"\n{'figure':26s} {'measured':{width}s} {'target':8s} met")
    for name, value, target, ok in rows:
        print(f"{name:26s} {value:{width}s} {target:8s} {'yes' if ok else 'NO'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny correctness grid; on CPU under TRITON_INTERPRET=1")
    p.add_argument("--compile-only", action="store_true", help="compile the kernels for sm_90a; needs no GPU")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs per figure")
    p.add_argument("--skip-grid", action="store_true", help="skip the correctness grid")
    p.add_argument("--full-grid", action="store_true", help="the full product grid (many compiles: minutes)")
    p.add_argument("--figures", default="abcd", help="which figures to run (default abcd)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth for (a)/(b) (H200: 4.8)")
    p.add_argument("--json", default=None, help="also write the JSON report here")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        report = {"command": " ".join(sys.argv), "compile_only": compile_only()}
        print(json.dumps(report, indent=2))
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if args.smoke and not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels.triton_attention is imported
    elif not cuda:
        print("no CUDA device: run with --smoke (CPU interpreter) or --compile-only", file=sys.stderr)
        return 2
    import triton

    device = "cuda" if cuda else "cpu"
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "device": device,
              "torch": torch.__version__, "triton": triton.__version__}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = {"name": props.name, "sms": props.multi_processor_count,
                         "memory_gib": round(props.total_memory / 2**30, 1)}
    if not args.skip_grid:
        size = "smoke" if args.smoke else "full" if args.full_grid else "default"
        report["grid"] = check_grid(device, size=size, verbose=args.verbose)
        print(f"grid: {report['grid']['cases'] - report['grid']['failed']}/{report['grid']['cases']} ok in "
              f"{report['grid']['seconds']} s", flush=True)
    if cuda and not args.smoke:
        dtype = torch.bfloat16
        figures = {}
        runners = {"a": lambda: figure_a(device, dtype, args.hbm_tbps, args.sweep),
                   "b": lambda: figure_b(device, dtype, args.hbm_tbps, args.sweep),
                   "c": lambda: figure_c(device, dtype, args.sweep),
                   "d": lambda: figure_d(device, dtype, args.sweep)}
        for name in args.figures:
            t0 = time.perf_counter()
            figures[name] = runners[name]()
            figures[name]["bench_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"figure ({name}) done in {figures[name]['bench_seconds']} s", flush=True)
            torch.cuda.empty_cache()
        report["figures"] = figures
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print_table(report)
    grid_ok = report.get("grid", {"failed": 0})["failed"] == 0
    figures_ok = all(f.get("within_tolerance", True) for f in report.get("figures", {}).values())
    return 0 if grid_ok and figures_ok else 1


if __name__ == "__main__":
    sys.exit(main())
