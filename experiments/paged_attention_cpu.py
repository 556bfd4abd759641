"""CPU decode attention over the paged KV cache: where the time of `kernels/reference.py`'s `paged_attention` goes,
and what reading the blocks in place would save, on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size
64, blocks of 16) for one layer.

Variants, timed in one process, interleaved, process CPU time (the machine is shared), median of `--repeats`:

* `gather+sdpa`: the production path (one gather of every decode's blocks, SDPA over the copy), blocks scattered.
* `view sdpa`: the same SDPA over views of the cache, no copy (possible only where a sequence's blocks are
  consecutive; here they are made so): the most a copy-free SDPA path can save.
* `headmajor math`: the blocks gathered into a [kv head, sequence, position, dim] layout, scores and weighted sum
  as float32 matmuls (what a head-major cache would allow; here the gather reads the token-major cache).
* `contiguous math`: the same two matmuls in the cache's dtype over K/V already head-major and contiguous, no
  gather: what a head-major cache could reach (in bfloat16 the scores are rounded to bfloat16).

    .venv/bin/python -m experiments.paged_attention_cpu
    .venv/bin/python -m experiments.paged_attention_cpu --cases 1x16 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels.reference import build_reference_plan, paged_attention

HQ, HKV, D, BS = 9, 3, 64, 16


def _cpu_us(fn, repeats: int, inner: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(inner):
            fn()
        times.append((time.process_time() - t) / inner)
    return float(np.median(times)) * 1e6


def case(batch: int, context: int, dtype: torch.dtype, repeats: int) -> dict:
    per = -(-context // BS)
    kc = torch.randn(batch * per + 4, BS, HKV, D, dtype=dtype)
    vc = torch.randn_like(kc)
    scattered = np.random.default_rng(0).permutation(batch * per).reshape(batch, per)
    q = torch.randn(batch, HQ, D, dtype=dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    scale = D ** -0.5
    plans = {name: (torch.from_numpy(ids).int(), build_reference_plan(ids, [1] * batch, [context] * batch, BS))
             for name, ids in (("scattered", scattered), ("consecutive", np.arange(batch * per).reshape(batch, per)))}

    def gather_sdpa(layout: str = "scattered"):
        tables, plan = plans[layout]
        return paged_attention(q, kc, vc, tables, cu, lens, scale, plan=plan)

    def view_sdpa():  # sequence b's blocks are b * per .. (b + 1) * per - 1
        k = kc[:batch * per].view(batch, per * BS, HKV, D)[:, :context].transpose(1, 2)
        v = vc[:batch * per].view(batch, per * BS, HKV, D)[:, :context].transpose(1, 2)
        o = F.scaled_dot_product_attention(q.view(batch, HKV, HQ // HKV, D), k, v, scale=scale)
        return o.reshape(batch, HQ, D)

    blocks = torch.from_numpy(scattered.ravel())

    def headmajor_math():
        k = torch.index_select(kc.permute(2, 0, 1, 3), 1, blocks).view(HKV, batch, per * BS, D)[:, :, :context]
        v = torch.index_select(vc.permute(2, 0, 1, 3), 1, blocks).view(HKV, batch, per * BS, D)[:, :, :context]
        qq = q.view(batch, HKV, HQ // HKV, D).transpose(0, 1).float()
        p = torch.softmax(torch.matmul(qq, k.float().transpose(-1, -2)).mul_(scale), dim=-1)
        return torch.matmul(p, v.float()).transpose(0, 1).reshape(batch, HQ, D).to(dtype)

    kh = torch.index_select(kc.permute(2, 0, 1, 3), 1, blocks).reshape(HKV, batch, per * BS, D)[:, :, :context]
    vh = torch.index_select(vc.permute(2, 0, 1, 3), 1, blocks).reshape(HKV, batch, per * BS, D)[:, :, :context]
    kh, vh = kh.contiguous(), vh.contiguous()

    def contiguous_math():
        qq = q.view(batch, HKV, HQ // HKV, D).transpose(0, 1)
        p = torch.softmax(torch.matmul(qq, kh.transpose(-1, -2)).float().mul_(scale), dim=-1).to(dtype)
        return torch.matmul(p, vh).transpose(0, 1).reshape(batch, HQ, D)

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for fn, same in ((view_sdpa, lambda: gather_sdpa("consecutive")), (headmajor_math, gather_sdpa)):
        torch.testing.assert_close(fn().float(), same().float(), atol=tol, rtol=tol)
    row = {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch.")}
    torch.testing.assert_close(contiguous_math().float(), gather_sdpa().float(), atol=5e-2, rtol=5e-2)
    fns = {"gather+sdpa": gather_sdpa, "view sdpa": view_sdpa, "headmajor math": headmajor_math,
           "contiguous math": contiguous_math}
    for name, fn in fns.items():
        row[f"{name} us"] = _cpu_us(fn, repeats)
    # The copy alone: what the gather of K and V costs (the part a copy-free path removes).
    # (the blocks of every sequence: the plan's SDPA groups are empty where the C++ kernel takes the decodes)
    row["gather us"] = _cpu_us(lambda: (kc.index_select(0, blocks), vc.index_select(0, blocks)), repeats)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x256,1x2048,16x256,16x2048,64x256", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print("| dtype | batch | context | gather+sdpa (us) | of which the gather | view sdpa (no copy) | "
          "headmajor math | contiguous math |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for c in args.cases.split(","):
            b, ctx = (int(x) for x in c.split("x"))
            r = case(b, ctx, getattr(torch, dtype), args.repeats)
            rows.append(r)
            base = r["gather+sdpa us"]
            print(f"| {r['dtype']} | {b} | {ctx} | {base:.0f} | {r['gather us'] / base:.0%} | "
                  f"{r['view sdpa us'] / base:.2f}x | {r['headmajor math us'] / base:.2f}x | "
                  f"{r['contiguous math us'] / base:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
