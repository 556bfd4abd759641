"""The bundled GGUF kept quantized (--quantization gguf) against the same weights dequantized: decode-step time
at several batch sizes (float32, bfloat16, quantized with bfloat16 and, where the project's CPU kernels are built,
float32, int16 and int8 activations; interleaved in one run, with a torch sum over 256 MB timed between the steps:
at batch 1 each step against the time its weights take to stream at that rate), weight bytes, and each quantized
variant's greedy agreement with the dequantized model in its dtype over N prompts x T tokens, with the logit error
after the prompt.

    python -m experiments.quantized_forward [--batch-sizes 1,16,64] [--prompts 16] [--tokens 64]

With `--hf-fp8 DIR` (an FP8 checkpoint, e.g. one `experiments.load_memory --quantization fp8 --checkpoint DIR`
wrote) the models are that checkpoint kept FP8 (the project's CPU kernel, bfloat16 and float32 activations) against
its weights dequantized into bfloat16 dense, decode steps only (no greedy agreement: the tests check it).

    python -m experiments.quantized_forward --hf-fp8 /tmp/fp8-1b --batch-sizes 1,16,64 --prompts 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kernels
from worker_svc.model import quant
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import default_model_path, load_model_weights

BLOCK = 16
TOPICS = ["the ocean", "a robot", "Paris", "prime numbers", "a dragon", "coffee", "the moon", "a violin",
          "rainforests", "chess", "volcanoes", "a lighthouse", "bread", "trains", "honeybees", "glaciers"]


class Decoder:
    """Sequences over a private paged KV pool, each with its own contiguous run of blocks."""

    def __init__(self, model: LlamaModel, max_len: int, seqs: int):
        self.model, self.max_len = model, max_len
        self.blocks_per_seq = -(-max_len // BLOCK)
        self.kv = torch.zeros(model.kv_cache_shape(self.blocks_per_seq * seqs, BLOCK), dtype=model.dtype)
        self.lens = [0] * seqs

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        ids, pos, qlens, slens, tables = [], [], [], [], []
        for s, toks in chunks.items():
            start = self.lens[s]
            self.lens[s] += len(toks)
            ids += toks
            pos += range(start, self.lens[s])
            qlens.append(len(toks))
            slens.append(self.lens[s])
            tables.append(list(range(s * self.blocks_per_seq, (s + 1) * self.blocks_per_seq)))
        meta = kernels.build_attention_metadata(qlens, slens, tables, BLOCK, "cpu")
        rows = torch.tensor(qlens).cumsum(0) - 1
        return self.model.forward(torch.tensor(ids), torch.tensor(pos), self.kv, meta, rows)


STREAM_BYTES = 256 << 20  # a torch sum over this many bytes, timed between the steps: the memory's streaming rate


def step_times(models: dict[str, LlamaModel], batch: int, context: int, repeats: int) -> dict[str, float]:
    """Median ms of one decode step per model, the models interleaved, and (key "stream_gbps") the rate of a torch
    sum over STREAM_BYTES timed in the same rounds."""
    decoders = {}
    for name, m in models.items():
        d = Decoder(m, context + repeats + 8, batch)
        d.step({s: [1 + s] * context for s in range(batch)})
        decoders[name] = d
    times: dict[str, list[float]] = {n: [] for n in models}
    # random values: a tensor of ones summed at 55.6 GB/s where random data read at 32.7 (identical pages may be
    # merged by the host), which would make the bound look twice as tight as the memory is
    stream, sums = torch.rand(STREAM_BYTES // 4), []
    for _ in range(repeats):  # interleaved: the shared machine's load falls on every variant alike
        for name, d in decoders.items():
            t = time.perf_counter()
            d.step({s: [7] for s in range(batch)})
            times[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        stream.sum()
        sums.append(time.perf_counter() - t)
    result = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    result["stream_gbps"] = STREAM_BYTES / statistics.median(sums) / 1e9
    return result


def weight_bytes(by_dtype: dict[str, int], model: str) -> int:
    """The bytes of weights a step of `model` reads: its dtype's dense weights, or the quantized ones."""
    return by_dtype["quantized" if model.startswith(("quantized", "fp8")) else model]


def fp8_models(path: str) -> tuple[dict, dict]:
    """An HF FP8 checkpoint kept FP8 and dequantized: (weight bytes, models by name)."""
    config, kept = load_model_weights(path)
    if not any(isinstance(w, quant.QuantizedWeight) for w in kept.values()):
        raise SystemExit(f"{path}: no FP8 weight stays FP8 here (no quantization_config, or the CPU kernel is absent)")
    dense = {k: w.dequantize(torch.bfloat16) if isinstance(w, quant.QuantizedWeight) else w.to(torch.bfloat16)
             for k, w in kept.items()}
    sizes = {"quantized": sum(w.nbytes for w in kept.values()), "bfloat16": sum(w.nbytes for w in dense.values())}
    models = {"bfloat16": LlamaModel(config, dense, torch.bfloat16, "cpu"),
              "fp8": LlamaModel(config, kept, torch.bfloat16, "cpu"),
              "fp8-float32": LlamaModel(config, kept, torch.float32, "cpu")}  # (a dense float32 one: 2x the memory)
    return sizes, models


def greedy_agreement(quantized: LlamaModel, dense: LlamaModel, prompts: list[list[int]], tokens: int) -> dict:
    """Greedy paths of both models from each prompt, and how far the quantized model's logits after the prompt
    are from the dense model's (largest absolute difference, and that over the dense logits' spread)."""
    same_tokens, identical, diffs, spreads = 0, 0, [], []
    for ids in prompts:
        paths, first = [], []
        for m in (quantized, dense):
            d = Decoder(m, len(ids) + tokens + 1, 1)
            logits, out = d.step({0: ids}), []
            first.append(logits[0].float())
            for _ in range(tokens):
                out.append(int(logits[0].argmax()))
                logits = d.step({0: [out[-1]]})
            paths.append(out)
        diffs.append(float((first[0] - first[1]).abs().max()))
        spreads.append(float(first[1].max() - first[1].min()))
        prefix = next((i for i, (a, b) in enumerate(zip(*paths, strict=True)) if a != b), tokens)
        same_tokens += prefix
        identical += prefix == tokens
    return {"prompts": len(prompts), "tokens": tokens, "identical_paths": identical,
            "mean_agreeing_prefix": same_tokens / len(prompts), "max_abs_logit_diff": max(diffs),
            "max_logit_diff_over_spread": max(d / s for d, s in zip(diffs, spreads, strict=True))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--prompts", type=int, default=16, help="prompts for the greedy agreement (0: skip)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--hf-fp8", default=None, metavar="DIR", help="an HF FP8 checkpoint instead of the GGUF")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    if args.hf_fp8:
        sizes, models = fp8_models(args.hf_fp8)
        result: dict = {"weight_bytes": sizes}
        args.prompts = 0
    else:
        config, qweights = load_model_weights(path, quantization="gguf")
        _, dense = load_model_weights(path)
        result = {"weight_bytes": {"quantized": sum(w.nbytes for w in qweights.values()),
                                   "float32": sum(w.nbytes for w in dense.values())}}
        result["weight_bytes"]["bfloat16"] = result["weight_bytes"]["float32"] // 2
        models = {"float32": LlamaModel(config, dense, torch.float32, "cpu"),
                  "bfloat16": LlamaModel(config, dense, torch.bfloat16, "cpu"),
                  "quantized": LlamaModel(config, qweights, torch.bfloat16, "cpu")}
    if not args.hf_fp8 and torch.float32 in quant.activation_dtypes(torch.device("cpu")):  # the CPU kernels
        models["quantized-float32"] = LlamaModel(config, qweights, torch.float32, "cpu")
        for bits in (16, 8):
            models[f"quantized-int{bits}-activations"] = LlamaModel(
                config, quant.with_integer_activations(qweights, bits, torch.device("cpu")), torch.float32, "cpu")
    result["step_ms"] = {}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        times = step_times(models, b, args.context, args.repeats)
        gbps = times.pop("stream_gbps")
        result["step_ms"][b], result.setdefault("stream_gbps", {})[b] = times, gbps
        print(f"batch {b}: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in times.items()), flush=True)
        if b == 1:  # each model's step against the time its weights take to stream at the rate just measured
            bound = {n: weight_bytes(result["weight_bytes"], n) / gbps / 1e6 for n in times}
            result["batch1_over_bound"] = {n: times[n] / bound[n] for n in times}
            print(f"  a torch sum streams {gbps:.1f} GB/s; step / weight-bandwidth bound: "
                  + ", ".join(f"{n} {times[n] / bound[n]:.2f}x ({bound[n]:.1f} ms)" for n in times), flush=True)
    if args.prompts:
        import os

        from transformers import AutoTokenizer

        d, f = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        prompts = [tok(f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}.")["input_ids"]
                   for i in range(args.prompts)]
        pairs = {"quantized_vs_dequantized_bf16": ("quantized", "bfloat16"),
                 "quantized_float32_vs_dequantized_float32": ("quantized-float32", "float32"),
                 "int16_activations_vs_dequantized_float32": ("quantized-int16-activations", "float32"),
                 "int8_activations_vs_dequantized_float32": ("quantized-int8-activations", "float32")}
        result["greedy"] = {}
        for key, (q, dense_name) in pairs.items():
            if q in models:
                result["greedy"][key] = greedy_agreement(models[q], models[dense_name], prompts, args.tokens)
                print(f"greedy, {key}:", result["greedy"][key], flush=True)
    print(json.dumps(result["weight_bytes"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
