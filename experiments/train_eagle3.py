"""Train a small EAGLE-3 head for the bundled SmolLM2-135M on this CPU, by self-distillation.

1. Data: a few hundred varied chat prompts (topics x tasks, built below) and the bundled model's own greedy
   continuations of them (transformers, float32, batched). The same `generate` forward hands out the residual
   stream entering the head's three capture layers (`eagle_aux_hidden_state_layer_ids`, vLLM's default 2, N / 2,
   N - 3); the labels are the target's greedy next tokens (a draft is accepted exactly when it equals one).
   Cached as float16 after every batch (`--gen-minutes` caps the generation).
2. Training: the head (worker_svc/model/eagle3.py's layout: fc over the three states, one Llama layer whose
   attention reads [normed token embedding, normed hidden], final norm, a reduced draft vocabulary with `d2t`),
   AdamW, with the training-time test: step 0 is fed the target's states, step j > 0 its own previous output, as
   the worker chains it, attending to step 0's keys up to the chain's origin plus the chain's own keys.
   The embedding is the target's (frozen, not saved: the worker shares the target's).
3. Output: config.json + model.safetensors, what `--speculative-config '{"method": "eagle3", "model": DIR}'` loads.

Everything goes under experiments/out/eagle3/ (ignored); nothing of it is committed.

    nice -n 5 .venv/bin/python -m experiments.train_eagle3 --minutes 30
    nice -n 5 .venv/bin/python -m experiments.train_eagle3 --minutes 1 --prompts 16 --new-tokens 32   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.support.hf_reference import load_model, load_tokenizer
from worker_svc.model.loader import default_model_path

OUT = "experiments/out/eagle3"

TOPICS = ["volcanoes", "the French Revolution", "photosynthesis", "black holes", "the stock market", "honeybees",
          "the Roman Empire", "climate change", "machine learning", "the human heart", "coffee", "chess",
          "the Moon landing", "vaccines", "electric cars", "the internet", "rainforests", "jazz music",
          "the Great Wall of China", "earthquakes", "sleep", "recycling", "the printing press", "whales",
          "solar panels", "ancient Egypt", "gravity", "bread baking", "the Olympic Games", "DNA", "tea",
          "the water cycle", "airplanes", "dinosaurs", "democracy", "the immune system", "bicycles", "glaciers",
          "the piano", "renewable energy", "octopuses", "the Renaissance", "comets", "gardening", "money"]
TASKS = ["Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "Give me three facts about {t}.",
         "Why is {t} important?", "Write a short poem about {t}.", "What are the main problems with {t}?",
         "Summarize the history of {t} in a few sentences.", "Write a short story that involves {t}.",
         "What should a beginner know about {t}?", "Describe {t} in simple words.",
         "List five questions a student might ask about {t}.", "Compare {t} with something from everyday life."]
CODE = ["Write a Python function that reverses a string.", "Write a Python function that checks if a number is prime.",
        "Write a Python function that counts the words in a text.", "Write a Python class for a simple bank account.",
        "Write a Python function that returns the n-th Fibonacci number.", "Write a SQL query that finds the top "
        "five customers by total order value.", "Write a Python function that merges two sorted lists.",
        "Write a JavaScript function that removes duplicates from an array.", "Write a Python function that reads "
        "a CSV file and returns the rows as dictionaries.", "Write a bash script that counts the files in a folder.",
        "Write a Python function that computes the average of a list of numbers.", "Write a Python function that "
        "checks whether a string is a palindrome.", "Explain what a Python decorator is, with an example.",
        "Write a Python function that finds the largest element of a list.", "Explain recursion with a short "
        "Python example.", "Write a Python function that converts Celsius to Fahrenheit."]
MATH = ["What is {a} plus {b}? Explain the steps.", "A shop sells apples at {a} cents each. How much do {b} apples "
        "cost?", "If a train travels {a} km in {b} hours, what is its average speed?",
        "What is {a} times {b}? Show your work."]


def prompts(n: int, seed: int) -> list[str]:
    """n distinct prompts: topic x task, code tasks and small word problems, shuffled."""
    rng = random.Random(seed)
    pool = [task.format(t=t) for t in TOPICS for task in TASKS] + CODE
    pool += [m.format(a=rng.randint(2, 90), b=rng.randint(2, 20)) for m in MATH for _ in range(6)]
    rng.shuffle(pool)
    return pool[:n]


def distill(model, tok, texts: list[str], aux: tuple[int, ...], new_tokens: int, batch: int,
            path: str, minutes: float) -> list[dict]:
    """The model's greedy continuations of the chat-templated prompts (up to EOS), with the residual stream
    entering the capture layers read off the same forward (hidden_states[i] is layer i's input, as the worker
    captures it). Per sequence: ids and the states of every position but the last (float16, concatenated), and
    labels: the target's greedy next token at each continuation position (-1 over the prompt, whose next tokens
    are not the target's). Saved after every batch; no new batch starts after `minutes`."""
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out, t0 = [], time.time()
    for i in range(0, len(texts), batch):
        if time.time() - t0 > 60 * minutes:
            break
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts[i: i + batch]]
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                                 return_dict_in_generate=True, output_hidden_states=True)
        width = enc.input_ids.shape[1]
        # Per step: the capture layers' inputs [B, rows, 3 * hidden] (step 0: the padded prompt; then one row).
        steps = [torch.cat([hs[layer] for layer in aux], dim=-1) for hs in gen.hidden_states]
        for b, mask in enumerate(enc.attention_mask):
            left, prompt_len = int((mask == 0).sum()), int(mask.sum())
            tail = gen.sequences[b, width:].tolist()
            if tok.eos_token_id in tail:
                tail = tail[: tail.index(tok.eos_token_id) + 1]
            ids = gen.sequences[b, left: width].tolist() + tail
            states = torch.cat([steps[0][b, left:], *(s[b] for s in steps[1: len(tail)])])
            n = len(states)  # every position but the last was fed
            labels = torch.tensor([-1] * (prompt_len - 1) + ids[prompt_len: n + 1])
            out.append({"ids": torch.tensor(ids[:n]), "aux": states.to(torch.float16), "labels": labels})
        torch.save(out, path)
        print(f"distilled {len(out)}/{len(texts)} sequences, {sum(len(x['ids']) for x in out)} tokens, "
              f"{(time.time() - t0) / 60:.1f} min", flush=True)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Head(torch.nn.Module):
    """The EAGLE-3 head's tensors under the checkpoint's names (midlayer.*), and its forward in plain torch."""

    def __init__(self, cfg: dict, target_embed: torch.Tensor, target_norm: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        h, inter, self.heads, self.kv_heads, self.dim = (cfg["hidden_size"], cfg["intermediate_size"],
                                                         cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                                         cfg["head_dim"])
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        q, kv = self.heads * self.dim, self.kv_heads * self.dim

        def lin(o: int, i: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(o, i) * 0.02)

        self.w = torch.nn.ParameterDict({
            "fc": lin(h, 3 * h), "q_proj": lin(q, 2 * h), "k_proj": lin(kv, 2 * h), "v_proj": lin(kv, 2 * h),
            "o_proj": lin(h, q), "gate_proj": lin(inter, h), "up_proj": lin(inter, h), "down_proj": lin(h, inter),
            "input_layernorm": torch.nn.Parameter(torch.ones(h)), "hidden_norm": torch.nn.Parameter(torch.ones(h)),
            "post_attention_layernorm": torch.nn.Parameter(torch.ones(h)),
            # Started from the target's own output side: its final norm and its (tied) embedding rows.
            "norm": torch.nn.Parameter(target_norm.clone()),
            "lm_head": torch.nn.Parameter(target_embed[draft_ids].clone())})
        self.embed = target_embed  # frozen, the target's

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """HF Llama's rotate-half rope; x [B, heads, T, D], pos [T]."""
        inv = 1.0 / self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        w, (b, t) = self.w, tokens.shape
        x = torch.cat([rms_norm(self.embed[tokens], w["input_layernorm"], self.eps),
                       rms_norm(hidden, w["hidden_norm"], self.eps)], -1)
        q = (x @ w["q_proj"].T).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = (x @ w["k_proj"].T).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = (x @ w["v_proj"].T).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = (y.repeat_interleave(rep, dim=1) for y in (k, v))
        return self.rope(q, pos), self.rope(k, pos), v

    def finish(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o-proj + residual, then the MLP + residual: the layer's output before the final norm."""
        w = self.w
        b, _, t, _ = o.shape
        h = hidden + o.transpose(1, 2).reshape(b, t, -1) @ w["o_proj"].T
        x = rms_norm(h, w["post_attention_layernorm"], self.eps)
        return h + (F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w["norm"], self.eps) @ self.w["lm_head"].T

    def unroll(self, ids: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Logits of steps 0..depth-1. Step 0's row p reads the target's state at p and token p + 1 (position p);
        step j's row of chain origin p reads step j - 1's output and token p + j + 1 (position p + j), attending
        to step 0's keys at positions <= p and the chain's own keys of steps 1..j, as the worker's cache holds them."""
        t = ids.shape[1] - 1
        hidden = aux[:, :t].float() @ self.w["fc"].T
        pos = torch.arange(t)
        q, k0, v0 = self.qkv(ids[:, 1:], hidden, pos)
        o = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        h = self.finish(o, hidden)
        out, chain = [self.logits(h)], []
        for j in range(1, depth):
            n = t - j
            if n <= 0:
                break
            h_in = h[:, :n]
            q, k, v = self.qkv(ids[:, j + 1: j + 1 + n], h_in, pos[:n] + j)
            chain.append((k, v))
            scale = 1.0 / math.sqrt(self.dim)
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, n, t]: keys at positions <= origin p
            s0 = s0.masked_fill(pos[None, :] > pos[:n, None], float("-inf"))
            diag = [((q * kc[:, :, :n]).sum(-1, keepdim=True) * scale) for kc, _ in chain]
            w = torch.cat([s0, *diag], -1).softmax(-1)
            o = w[..., :t] @ v0 + sum(w[..., t + i: t + i + 1] * vc[:, :, :n] for i, (_, vc) in enumerate(chain))
            h = self.finish(o, h_in)
            out.append(self.logits(h))
        return out


def batch_of(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, states and labels, and the lengths (padding sits after every real key: causal is enough)."""
    n = max(len(it["ids"]) for it in items)
    ids = torch.zeros(len(items), n, dtype=torch.int64)
    aux = torch.zeros(len(items), n, items[0]["aux"].shape[1], dtype=torch.float16)
    labels = torch.full((len(items), n), -1, dtype=torch.int64)
    for i, it in enumerate(items):
        m = len(it["ids"])
        ids[i, :m], aux[i, :m], labels[i, :m] = it["ids"], it["aux"], it["labels"]
    return ids, aux, labels, torch.tensor([len(it["ids"]) for it in items])


def step_losses(head: Head, items: list[dict], t2d: torch.Tensor, depth: int) -> list[tuple[torch.Tensor, float]]:
    """Per unrolled step: the cross-entropy against the target's greedy token (mapped to the draft vocabulary;
    labels outside it are skipped) and the top-1 accuracy over all labels (a miss where outside)."""
    ids, aux, labels, _ = batch_of(items)
    res = []
    for j, logits in enumerate(head.unroll(ids, aux, depth)):
        n = logits.shape[1]
        want = labels[:, j + 1: j + 1 + n]  # step j's row of origin p predicts token p + j + 2: label at p + j + 1
        real = want >= 0
        draft = torch.where(real, t2d[want.clamp(min=0)], -1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), draft.reshape(-1), ignore_index=-1)
        hit = (draft == logits.argmax(-1)) & (draft >= 0)
        res.append((ce, float(hit.sum()) / max(1, int(real.sum()))))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--prompts", type=int, default=360)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=24)
    ap.add_argument("--gen-minutes", type=float, default=15.0, help="no new generation batch after this")
    ap.add_argument("--hf-cache", default="experiments/out/hf-reference", help="the float32 copy of the GGUF")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="the most frequent target tokens of the labels")
    ap.add_argument("--depth", type=int, default=3, help="training-time test steps (1: teacher forcing only)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=30.0, help="training wall-clock budget (the lr follows it)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    os.makedirs(a.out, exist_ok=True)
    gguf = default_model_path()
    target = load_model(gguf, a.hf_cache)
    tok = load_tokenizer(gguf, a.hf_cache)
    tc = target.config
    aux_layers = (2, tc.num_hidden_layers // 2, tc.num_hidden_layers - 3)

    data_path = f"{a.out}/data-{a.prompts}-{a.new_tokens}-{a.seed}.pt"
    if os.path.exists(data_path):
        items = torch.load(data_path)
    else:
        items = distill(target, tok, prompts(a.prompts, a.seed), aux_layers, a.new_tokens, a.gen_batch, data_path,
                        a.gen_minutes)
    held = max(1, len(items) // 10)
    evals, train = items[:held], items[held:]

    labels = torch.cat([it["labels"] for it in train])
    counts = torch.bincount(labels[labels >= 0], minlength=tc.vocab_size)
    draft_ids = counts.argsort(descending=True)[: a.draft_vocab].sort().values
    t2d = torch.full((tc.vocab_size,), -1, dtype=torch.int64)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    print(f"draft vocabulary {len(draft_ids)}: covers {counts[draft_ids].sum() / counts.sum():.1%} of the labels")

    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tc.hidden_size,
           "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
           "head_dim": tc.hidden_size // tc.num_attention_heads, "intermediate_size": tc.intermediate_size,
           "num_hidden_layers": 1, "vocab_size": tc.vocab_size, "draft_vocab_size": len(draft_ids),
           "target_hidden_size": tc.hidden_size, "rms_norm_eps": tc.rms_norm_eps,
           "rope_theta": float(tc.rope_parameters["rope_theta"] if getattr(tc, "rope_parameters", None)
                               else tc.rope_theta),
           "max_position_embeddings": tc.max_position_embeddings, "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}
    embed = target.get_input_embeddings().weight.detach()
    head = Head(cfg, embed, target.model.norm.weight.detach(), draft_ids)
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, weight_decay=0.0)
    del target

    def evaluate() -> list[float]:
        with torch.no_grad():
            accs = [step_losses(head, evals[i: i + 8], t2d, a.depth) for i in range(0, len(evals), 8)]
        return [sum(b[j][1] for b in accs) / len(accs) for j in range(a.depth)]

    log: list[dict] = []
    print(f"before training: held-out top-1 per step {[round(x, 3) for x in evaluate()]}", flush=True)
    budget, t0, step, epoch = 60 * a.minutes, time.time(), 0, 0
    rng = random.Random(a.seed)
    # Sequences of similar length share a batch (less padding); batches shuffled each epoch.
    order = sorted(range(len(train)), key=lambda i: len(train[i]["ids"]))
    batches = [order[i: i + a.batch] for i in range(0, len(order), a.batch)]
    while time.time() - t0 < budget:
        rng.shuffle(batches)
        for bi in batches:
            frac = (time.time() - t0) / budget
            if frac >= 1:
                break
            for g in opt.param_groups:  # warm-up over the first 3%, then cosine to 0 over the wall-clock budget
                g["lr"] = a.lr * min(1.0, frac / 0.03) * 0.5 * (1 + math.cos(math.pi * frac))
            res = step_losses(head, [train[i] for i in bi], t2d, a.depth)
            loss = sum(0.8 ** j * ce for j, (ce, _) in enumerate(res))  # later steps count less (EAGLE-3's decay)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 20 == 0:
                log.append({"step": step, "minute": round((time.time() - t0) / 60, 2), "loss": round(loss.item(), 4),
                            "train_top1": [round(acc, 3) for _, acc in res]})
                print(json.dumps(log[-1]), flush=True)
        epoch += 1
    acc = evaluate()
    # A chain's expected accepted drafts under k = depth: acceptance at step j needs steps 0..j right.
    print(f"after {step} steps ({epoch} epochs, {(time.time() - t0) / 60:.1f} min): held-out top-1 per step "
          f"{[round(x, 3) for x in acc]}", flush=True)

    head_dir = f"{a.out}/head"
    os.makedirs(head_dir, exist_ok=True)
    names = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}
    tensors = {}
    for k, p in head.w.items():
        sub = "mlp" if k.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
        name = names.get(k) or (f"midlayer.{k}.weight" if "norm" in k else f"midlayer.{sub}.{k}.weight")
        tensors[name] = p.detach().float().contiguous()
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))  # draft id i -> target id i + d2t[i]
    tensors["t2d"] = t2d >= 0
    save_file(tensors, f"{head_dir}/model.safetensors")
    with open(f"{head_dir}/config.json", "w") as f:
        json.dump(cfg, f, indent=1)
    with open(f"{a.out}/train-log.json", "w") as f:
        json.dump({"args": vars(a), "steps": step, "epochs": epoch, "held_out_top1": acc, "log": log,
                   "sequences": len(items), "tokens": sum(len(it["ids"]) for it in items)}, f, indent=1)
    print(f"head written to {head_dir}", flush=True)


if __name__ == "__main__":
    main()
