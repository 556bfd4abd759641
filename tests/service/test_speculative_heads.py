"""EAGLE-3 speculation on the worker's runner (in process): a random-weight EAGLE-3 head, written in the layout vLLM
and SGLang load, beside a random-weight Llama target written by transformers. The head's drafts are verified as
extra query rows: greedy output equals Hugging Face's and plain decoding's with chunked prefill, seeded sampling
equals plain sampling token for token; the head's first draft equals a plain-torch EAGLE-3 forward over
transformers' hidden states. Acceptance is near zero with random weights: exactness is what is checked."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest
import torch

from common.config import ConfigError
from protos import worker_pb2 as pb
from tests.support.driver import DriverRequest, run_requests
from tests.support.plans import Cached, Wire
from tests.support.spec_heads import write_eagle3_head, write_llama_target
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.server import execute_step

K = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return write_llama_target(str(root / "target")), write_eagle3_head(str(root / "eagle3"))


def spec(head: str, k: int = K) -> str:
    return json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def runners(checkpoints):
    target, head = checkpoints
    opts = dict(model=target, dtype="float32", num_gpu_blocks_override=128)
    return ModelRunner(WorkerConfig(**opts)), ModelRunner(WorkerConfig(**opts, speculative_config=spec(head)))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (5, 17, 40, 9, 23)]


def drive(runner, reqs: list[DriverRequest], chunk: int, drafts: int) -> list[pb.StepResult]:
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, first_step_id=runner.batch.last_step_id + 1, num_draft_slots=drafts,
                 spec_results=results)
    assert not len(runner.batch.inputs)
    return results


def requests(tag: str, prompts, params) -> list[DriverRequest]:
    return [DriverRequest(f"{tag}-{i}", ids, params(i), arrival_step=i % 3) for i, ids in enumerate(prompts)]


def greedy(i: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def hf_greedy(path: str, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("chunk", [7, 64])
def test_greedy_with_eagle3_drafts_equals_plain_decoding_and_hf(runners, checkpoints, prompts, chunk):
    plain, eagle = runners
    ref = requests(f"plain{chunk}", prompts, greedy)
    drive(plain, ref, chunk, 0)
    got = requests(f"eagle{chunk}", prompts, greedy)
    results = drive(eagle, got, chunk, K)
    for a, b in zip(ref, got, strict=True):
        assert a.output == b.output, b.request_id
    if chunk == 7:
        assert ref[1].output == hf_greedy(checkpoints[0], prompts[1], 20)
    drafts = sum(sum(r.spec_num_draft_tokens) for r in results)
    assert drafts > len(prompts) * 10, "every decode step after the first should verify the head's drafts"
    assert sum(sum(r.spec_num_accepted_tokens) for r in results) <= drafts


def test_seeded_sampling_with_eagle3_drafts_equals_plain_sampling(runners, prompts):
    plain, eagle = runners

    def sampled(i: int) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=0.8, top_p=0.9, seed=70 + i, max_tokens=16, ignore_eos=True)

    ref, got = requests("ps", prompts, sampled), requests("es", prompts, sampled)
    drive(plain, ref, 16, 0)
    results = drive(eagle, got, 16, K)
    assert [r.output for r in ref] == [r.output for r in got]
    assert sum(sum(r.spec_num_draft_tokens) for r in results) > 0


def test_first_draft_equals_a_plain_torch_eagle3_forward(runners, checkpoints, prompts):
    """The head's draft after a prefill, recomputed from transformers' hidden states (the inputs of layers 0, 2
    and 4 = the final layer's output) with the checkpoint's tensors and plain torch."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, eagle = runners
    target, head = checkpoints
    ids = prompts[2]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    nxt = int(out.logits[0, -1].argmax())
    aux = torch.cat([out.hidden_states[i][0] for i in (0, 2, 4)], dim=-1)  # [T, 3H]; hidden_states[4] is normed
    aux[:, -64:] = _pre_norm_output(model, ids)
    w = load_file(f"{head}/model.safetensors")
    tokens = ids[1:] + [nxt]
    draft = _reference_draft(w, model, aux, tokens)
    assert eagle.heads is not None and eagle.heads.head.aux_layers == (0, 2, 4)
    assert draft == _runner_first_draft(eagle, ids, nxt)


def _pre_norm_output(model, ids: list[int]) -> torch.Tensor:
    """The last decoder layer's output before the final norm (transformers' last hidden state is normed)."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("h", o[0] if
                                                                                          isinstance(o, tuple) else o))
    with torch.no_grad():
        model(torch.tensor([ids]))
    hook.remove()
    return captured["h"][0]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_draft(w: dict, model, aux: torch.Tensor, tokens: list[int]) -> int:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = "midlayer."
    t = len(tokens)
    hidden = aux @ w["fc.weight"].T
    emb = model.model.embed_tokens.weight[torch.tensor(tokens)]
    x = torch.cat([_rms(emb, w[m + "input_layernorm.weight"]), _rms(hidden, w[m + "hidden_norm.weight"])], -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, 4, 16).transpose(0, 1)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, 2, 16).transpose(0, 1)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, 2, 16).transpose(0, 1)
    cos, sin = model.model.rotary_emb(x[None], torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = k[0].repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    o = torch.nn.functional.scaled_dot_product_attention(q[0], k, v, is_causal=True).transpose(0, 1).reshape(t, 64)
    h = hidden + o @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(h, w[m + "post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
             ) @ w[m + "mlp.down_proj.weight"].T
    d = int((_rms(h[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
    return d + int(w["d2t"][d])


def _runner_first_draft(runner, ids: list[int], nxt: int) -> int:
    """One prefill step through the runner's plan path, then the drafts the head left waiting for the next step
    (a second step ends the request)."""
    wire = Wire()
    rid = "first-draft"
    blocks = list(range(-(-(len(ids) + K + 2) // runner.block_size)))
    step = runner.batch.last_step_id + 1
    plan = wire.plan(step_id=step, new_requests=[pb.NewRequest(
        request_id=rid, prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0.0, max_tokens=2),
        block_ids=blocks, num_scheduled_tokens=len(ids))])
    assert list(execute_step(runner, plan).token_ids) == [nxt]
    count, drafts = runner.heads.waiting[rid]
    assert count == len(ids) + 1 and len(drafts) == K
    last = execute_step(runner, wire.plan(step_id=step + 1, cached_requests=[Cached(rid, 1, [])]))
    assert len(last.token_ids) == 1 and not len(runner.batch.inputs)
    return int(drafts[0])


def test_bad_eagle3_heads_are_refused_at_start(checkpoints, tmp_path):
    target, head = checkpoints
    with pytest.raises(ConfigError, match="model"):
        ModelRunner(WorkerConfig(model=target, speculative_config='{"method": "eagle3", "num_speculative_tokens": 2}'))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="architectures"):
        ModelRunner(WorkerConfig(model=target, dtype="float32", speculative_config=spec(str(tmp_path))))


# MTP: the checkpoint's own layer, on the hybrid families that ship one. Rejected drafts are rolled back out of the
# recurrent state (worker_svc/core/draft_rollback.py): without that the next tokens would drift from plain decoding.
MTP_KEYS = {"qwen3_5": "mtp_num_hidden_layers", "qwen3_next": "num_nextn_predict_layers"}


@pytest.fixture(scope="module", params=list(MTP_KEYS))
def mtp_runners(request, tmp_path_factory):
    from tests.service.test_hybrid_families import make_checkpoint
    from tests.support.spec_heads import add_mtp_layer

    path = str(tmp_path_factory.mktemp(request.param))
    make_checkpoint(request.param, path)
    add_mtp_layer(path, MTP_KEYS[request.param])
    opts = dict(model=path, dtype="float32", num_gpu_blocks_override=128, num_state_slots=8)
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    return ModelRunner(WorkerConfig(**opts)), ModelRunner(WorkerConfig(**opts, speculative_config=mtp))


@pytest.mark.parametrize("chunk", [7, 64])
def test_greedy_with_mtp_drafts_equals_plain_decoding(mtp_runners, chunk):
    plain, mtp = mtp_runners
    rng = random.Random(chunk)
    ids = [[rng.randrange(300) for _ in range(n)] for n in (5, 17, 40, 9)]
    ref, got = requests(f"mp{chunk}", ids, greedy), requests(f"mm{chunk}", ids, greedy)
    run_requests(partial(execute_step, plain), ref, chunk=chunk, num_blocks=plain.num_blocks,
                 block_size=plain.block_size, first_step_id=plain.batch.last_step_id + 1, state_slots=True)
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, mtp), got, chunk=chunk, num_blocks=mtp.num_blocks, block_size=mtp.block_size,
                 first_step_id=mtp.batch.last_step_id + 1, num_draft_slots=2, spec_results=results, state_slots=True)
    assert [r.output for r in ref] == [r.output for r in got]
    drafts = sum(sum(r.spec_num_draft_tokens) for r in results)
    assert drafts > 0 and sum(sum(r.spec_num_accepted_tokens) for r in results) < drafts, "rejections roll back"


def test_mtp_is_refused_for_a_checkpoint_without_mtp_layers(tmp_path):
    from tests.service.test_hybrid_families import make_checkpoint

    make_checkpoint("qwen3_5", str(tmp_path))
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        ModelRunner(WorkerConfig(model=str(tmp_path), dtype="float32", num_state_slots=4,
                                 speculative_config='{"method": "mtp", "num_speculative_tokens": 1}'))


def test_mtp_is_refused_for_a_family_without_mtp_layers(checkpoints):
    with pytest.raises(ConfigError, match="method mtp"):
        ModelRunner(WorkerConfig(model=checkpoints[0], dtype="float32",
                                 speculative_config='{"method": "mtp", "num_speculative_tokens": 1}'))


@pytest.mark.heavy  # a cold inductor compile: the default run, not --fast
def test_greedy_with_eagle3_drafts_on_the_compiled_forward_equals_plain_decoding(runners, checkpoints, prompts):
    """-O1: the compiled forward hands the head the same layer inputs (its real rows, not the padding)."""
    plain, _ = runners
    target, head = checkpoints
    compiled = ModelRunner(WorkerConfig(model=target, dtype="float32", num_gpu_blocks_override=128,
                                        optimization_level=1, speculative_config=spec(head),
                                        compilation_config='{"cudagraph_capture_sizes": [4, 16]}'))
    ref = requests("cplain", prompts, greedy)
    drive(plain, ref, 7, 0)
    got = requests("ceagle", prompts, greedy)
    results = drive(compiled, got, 7, K)
    assert [r.output for r in ref] == [r.output for r in got]
    assert sum(sum(r.spec_num_draft_tokens) for r in results) > len(prompts) * 10
    for i in (0, 3):  # prefills of 5 and 9 tokens run padded to 16 rows: the head's first draft is eager's
        assert _runner_first_draft(compiled, prompts[i], ref[i].output[0]) == \
            _runner_first_draft(runners[1], prompts[i], ref[i].output[0])
