"""Tensor parallel 2 equals 1 on quantized checkpoints: FP8 (block, per-tensor and compressed-tensors per-channel),
AWQ, GPTQ (with act-order), compressed-tensors int4 and int8. Each rank holds its rows / columns of the quantized
codes with their scales and zeros (quant_sharding.py); a cut through an FP8 block is refused naming the limit.
Random-weight checkpoints quantized the formats' way; two gloo ranks on this CPU."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_tensor_parallel import _steps
from tests.support.rank_pair import run_on_ranks
from worker_svc.model import families as models
from worker_svc.model import quant
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import Shard, local_config

SIZE = 2
# FP8 blocks are 128 columns wide: o_proj's and down_proj's shards of this shape are whole blocks (128 and 256).
FP8_BLOCK_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _write(name: str, path) -> None:
    from tests.service.test_awq_model import write_awq_checkpoint
    from tests.service.test_compressed_int_model import write_checkpoint
    from tests.service.test_fp8_model import write_fp8_checkpoint
    from tests.service.test_gptq_model import write_gptq_checkpoint

    {"fp8_block": lambda: write_fp8_checkpoint(path, "fp8_block", FP8_BLOCK_SHAPE),
     "fp8_tensor": lambda: write_fp8_checkpoint(path, "fp8_tensor"),
     "compressed_fp8_channel": lambda: write_fp8_checkpoint(path, "compressed_channel"),
     "awq_group128": lambda: write_awq_checkpoint(path, 128),
     "gptq_group64": lambda: write_gptq_checkpoint(path, 64, False, False, False),
     "gptq_actorder": lambda: write_gptq_checkpoint(path, 128, True, False, True),
     "compressed_int4": lambda: write_checkpoint(path, 64, False),
     "compressed_int8": lambda: write_checkpoint(path, None, True, int8="channel")}[name]()


FORMATS = ("fp8_block", "fp8_tensor", "compressed_fp8_channel", "awq_group128", "gptq_group64", "gptq_actorder",
           "compressed_int4", "compressed_int8")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    paths = []
    for name in FORMATS:
        path = tmp_path_factory.mktemp(name)
        _write(name, path)
        paths.append(str(path))
    return paths


def _load(path: str, shard: Shard, group=None):
    """The rank's model, and whether its down_proj weights were loaded quantized (the loader's output: an FP8 one
    is cut as stored and kept FP8 for the CPU's kernel) with their input columns."""
    config, weights = load_hf_dir(path, shard)
    down = [w for name, w in weights.items() if name.endswith("mlp.down_proj.weight")]
    kinds = sorted({(isinstance(w, quant.QuantizedWeight), w.shape[1]) for w in down})
    model = models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                                tp=group)
    return model, kinds


def _rank_steps(path: str, shard: Shard, group) -> tuple[list[torch.Tensor | None], list[tuple[bool, int]]]:
    model, kinds = _load(path, shard, group)
    return _steps(model), kinds


def test_tp2_logits_and_greedy_tokens_equal_one_rank(checkpoints, tmp_path):
    whole = [_load(path, Shard(0, 1)) for path in checkpoints]
    expected = [_steps(model) for model, _ in whole]
    ranks = run_on_ranks(_rank_steps, checkpoints, str(tmp_path), SIZE)
    for i, want in enumerate(expected):
        got, kinds = ranks[i]
        # The int4 / int8 formats but GPTQ act-order (dequantized at load where a 32-column run mixes groups) stay
        # quantized, FP8 too (the CPU's FP8 kernel); each rank with half of down_proj's input columns.
        ((quantized, columns),) = whole[i][1]
        assert quantized == (FORMATS[i] != "gptq_actorder"), FORMATS[i]
        assert kinds == [(quantized, columns // SIZE)], FORMATS[i]
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            diff = (g - w).abs().max().item()
            assert diff < 1e-4 * max(1.0, w.abs().max().item()), f"{FORMATS[i]}: max abs logit diff {diff}"
            assert torch.equal(g.argmax(-1), w.argmax(-1)), FORMATS[i]


def test_a_shard_cutting_an_fp8_block_is_refused(tmp_path):
    from tests.service.test_fp8_model import write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path, "fp8_block")  # intermediate_size 320: down_proj's shards are 160 columns
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: .*down_proj\.weight gives each rank 160 of "
                                         r"its 320 input columns.*weight_block_size's 128 columns"):
        load_hf_dir(str(tmp_path), Shard(0, SIZE))
