"""Multi-LoRA on the worker: greedy output with each adapter equals Hugging Face with that adapter merged into the
weights (a random Llama and the bundled model); a step mixing the base model and three adapters equals each alone;
the device pool's LRU; refusals at load naming the file and the module."""

from __future__ import annotations

import json
import os
from functools import partial

import pytest
import torch
import transformers

from protos import worker_pb2 as pb
from tests.support.driver import DriverRequest, run_requests
from tests.support.lora_adapters import merged, write_adapter
from tests.support.random_weights import randomize
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.lora import LoraError, load_peft_adapter
from worker_svc.server import execute_step

NEW_TOKENS = 12


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Argmax each step with transformers' own KV cache, no EOS stop (the worker's requests ignore EOS)."""
    out = []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def drive(runner, reqs: list[DriverRequest], chunk: int = 5, seed: int = 0) -> list[list[int]]:
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, seed=seed, first_step_id=runner.batch.last_step_id + 1)
    return [r.output for r in reqs]


def greedy(n: int = NEW_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random Llama on disk, three adapters (all modules; attention only with rslora; MLP only at rank 16)."""
    d = tmp_path_factory.mktemp("lora-small")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    randomize(hf)
    hf.eval().save_pretrained(d / "model", safe_serialization=True)
    adapters = {
        "all": write_adapter(str(d / "all"), cfg, rank=8, alpha=16, seed=1, std_b=0.3),
        "attn": write_adapter(str(d / "attn"), cfg, rank=4, alpha=8, modules=("q_proj", "k_proj", "v_proj",
                                                                                "o_proj"), seed=2, rslora=True,
                              std_b=0.3),
        "mlp": write_adapter(str(d / "mlp"), cfg, rank=16, alpha=16, modules=("gate_proj", "up_proj", "down_proj"),
                             seed=3, std_b=0.3),
    }
    runner = ModelRunner(WorkerConfig(model=str(d / "model"), dtype="float32", device="cpu",
                                      num_gpu_blocks_override=128, enable_lora=True, max_loras=3, max_lora_rank=16,
                                      lora_modules=" ".join(f"{k}={v}" for k, v in adapters.items())))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 23, 40)]
    return hf, adapters, runner, prompts


def test_each_adapter_matches_hf_merged(small):
    hf, adapters, runner, prompts = small
    base = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert drive(runner, [DriverRequest(f"b{i}", p, greedy()) for i, p in enumerate(prompts)]) == base
    for name, path in adapters.items():
        want = [hf_greedy(merged(hf, path), p, NEW_TOKENS) for p in prompts]
        assert want != base, f"adapter {name} changes nothing: the test would prove nothing"
        reqs = [DriverRequest(f"{name}{i}", p, greedy(), lora_name=name, lora_path=path)
                for i, p in enumerate(prompts)]
        assert drive(runner, reqs, chunk=7) == want, name


def test_one_step_mixing_base_and_three_adapters_equals_each_alone(small):
    _, adapters, runner, prompts = small
    names = ["", *adapters]
    alone = {}
    for name in names:
        r = DriverRequest(f"alone-{name}", prompts[1], greedy(), lora_name=name, lora_path=adapters.get(name, ""))
        alone[name] = drive(runner, [r])[0]
    assert len({tuple(v) for v in alone.values()}) == 4
    mixed = [DriverRequest(f"mix-{name}-{i}", p, greedy(), lora_name=name, lora_path=adapters.get(name, ""))
             for name in names for i, p in enumerate(prompts[1:2] * 2)]
    outs = drive(runner, mixed, chunk=64, seed=3)
    for r, out in zip(mixed, outs, strict=True):
        assert out == alone[r.lora_name], r.request_id


def test_speculative_drafts_verify_under_each_adapter(small):
    """n-gram drafts are verified by the forward with the request's adapter: the same tokens as plain decoding."""
    _, adapters, runner, prompts = small
    prompt = prompts[0] * 3  # repetitive: the proposer finds drafts
    for name in ["", *adapters]:
        path = adapters.get(name, "")
        plain = drive(runner, [DriverRequest(f"plain-{name}", prompt, greedy(), lora_name=name, lora_path=path)])
        spec_results: list[pb.StepResult] = []
        req = DriverRequest(f"spec-{name}", prompt, greedy(), lora_name=name, lora_path=path)
        run_requests(partial(execute_step, runner), [req], chunk=64, num_blocks=runner.num_blocks,
                     block_size=runner.block_size, first_step_id=runner.batch.last_step_id + 1, num_draft_slots=3,
                     spec_results=spec_results)
        assert req.output == plain[0], name
        assert sum(sum(r.spec_num_draft_tokens) for r in spec_results) > 0, "no drafts were verified"


def test_device_pool_evicts_least_recently_used(small, tmp_path):
    hf, adapters, _, prompts = small
    runner = ModelRunner(WorkerConfig(model=os.path.dirname(adapters["all"]) + "/model", dtype="float32",
                                      device="cpu", num_gpu_blocks_override=64, enable_lora=True, max_loras=1,
                                      max_lora_rank=16))
    for name in ("all", "mlp", "all"):  # one slot: each adapter evicts the previous one
        out = drive(runner, [DriverRequest(f"lru-{name}", prompts[0], greedy(4), lora_name=name,
                                           lora_path=adapters[name])])[0]
        assert out == hf_greedy(merged(hf, adapters[name]), prompts[0], 4)
    assert list(runner.lora.slot_of) == [("all", adapters["all"])]
    # Two adapters in one batch with one slot: the plan is refused, naming the request.
    reqs = [DriverRequest(f"two-{n}", prompts[0], greedy(2), lora_name=n, lora_path=adapters[n]) for n in adapters]
    with pytest.raises(Exception, match="max-loras"):
        drive(runner, reqs[:2])


def test_bundled_model_adapter_matches_hf_merged(hf_model, hf_tokenizer, bundled_model_path, tmp_path):
    path = write_adapter(str(tmp_path / "bundled"), hf_model.config, rank=8, alpha=16, seed=5, std_b=0.3)
    runner = ModelRunner(WorkerConfig(model=bundled_model_path, dtype="float32", device="cpu",
                                      num_gpu_blocks_override=64, enable_lora=True,
                                      max_lora_rank=8, lora_modules=f"tuned={path}"))
    prompt = hf_tokenizer.encode("The capital of France is")
    want = hf_greedy(merged(hf_model, path), prompt, 16)
    assert want != hf_greedy(hf_model, prompt, 16)
    out = drive(runner, [DriverRequest("bundled", prompt, greedy(16), lora_name="tuned", lora_path=path)], chunk=64)
    assert out[0] == want


# ---------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def model_cfg(small):
    return small[2].config


def _edit(path: str, **changes) -> None:
    f = os.path.join(path, "adapter_config.json")
    with open(f) as fh:
        meta = json.load(fh)
    meta.update(changes)
    with open(f, "w") as fh:
        json.dump(meta, fh)


def test_refuses_rank_above_max(small, tmp_path, model_cfg):
    hf = small[0]
    path = write_adapter(str(tmp_path / "big"), hf.config, rank=32, alpha=32, modules=("q_proj",))
    with pytest.raises(LoraError, match=r"adapter_config.json: r=32 exceeds --max-lora-rank 16"):
        load_peft_adapter("big", path, model_cfg, 16)


def test_refuses_unknown_module(small, tmp_path, model_cfg):
    path = write_adapter(str(tmp_path / "unk"), small[0].config, rank=4, alpha=4, modules=("q_proj",))
    _edit(path, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(LoraError, match=r"adapter_config.json: target module 'embed_tokens' is not supported"):
        load_peft_adapter("unk", path, model_cfg, 16)


def test_refuses_shape_mismatch(small, tmp_path, model_cfg):
    other = transformers.LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    path = write_adapter(str(tmp_path / "wide"), other, rank=4, alpha=4, modules=("q_proj",))
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: .*q_proj.* \(q_proj, layer 0\) has shape "
                                        r"\[4, 96\]; the model needs \[4, 64\]"):
        load_peft_adapter("wide", path, model_cfg, 16)


def test_refuses_missing_files_and_bad_flags(small, tmp_path, model_cfg):
    with pytest.raises(LoraError, match="cannot read .*adapter_config.json"):
        load_peft_adapter("none", str(tmp_path / "nowhere"), model_cfg, 16)
    from common.validation import ConfigError

    d = os.path.dirname(small[1]["all"]) + "/model"
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        ModelRunner(WorkerConfig(model=d, dtype="float32", device="cpu", num_gpu_blocks_override=8,
                                 lora_modules=f"x={small[1]['all']}"))
    with pytest.raises(ConfigError, match="r=8 exceeds --max-lora-rank 4"):
        ModelRunner(WorkerConfig(model=d, dtype="float32", device="cpu", num_gpu_blocks_override=8,
                                 enable_lora=True, max_lora_rank=4, lora_modules=f"x={small[1]['all']}"))
