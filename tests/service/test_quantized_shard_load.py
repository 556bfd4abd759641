"""A tensor-parallel rank's weights of an AWQ, GPTQ or compressed-tensors int checkpoint, each layer cut to the rank's
shard as it is converted, are bit-identical to the one-rank weights cut afterwards (what the loader did before:
convert the whole checkpoint, then cut each weight with quant_sharding.shard_quantized / sharding.shard_tensor).
Every tensor compared, quantized codes, scales and zeros included, on ranks 0 and 1 of 2; the hybrid families'
projections (dequantized at load) likewise; a rank's columns that split a 32-column group are refused as before."""

from __future__ import annotations

import pytest
import torch

from tests.service import test_hybrid_quantized as hybrid_quantized
from tests.service.test_awq_model import write_awq_checkpoint
from tests.service.test_compressed_int_model import write_checkpoint as write_compressed_checkpoint
from tests.service.test_gptq_model import write_gptq_checkpoint
from worker_svc.model.loader import load_hf_dir
from worker_svc.model.quant import QuantizedWeight
from worker_svc.model.safetensors_stream import Placement
from worker_svc.parallel.quant_sharding import shard_quantized
from worker_svc.parallel.sharding import FULL, Shard, shard_tensor

SIZE = 2
WRITERS = {
    "awq-group32": lambda path: write_awq_checkpoint(path, 32),
    "awq-group128": lambda path: write_awq_checkpoint(path, 128),
    "gptq-group32-sym": lambda path: write_gptq_checkpoint(path, 32, True, False, False),
    "gptq-group64-asym": lambda path: write_gptq_checkpoint(path, 64, False, False, False),
    "gptq-group128-v2": lambda path: write_gptq_checkpoint(path, 128, False, True, False),
    "gptq-group128-desc-act": lambda path: write_gptq_checkpoint(path, 128, True, False, True),
    "pack-quantized-group64-asym": lambda path: write_compressed_checkpoint(path, 64, False),
    "pack-quantized-channel-sym": lambda path: write_compressed_checkpoint(path, None, True),
    "int-quantized-channel": lambda path: write_compressed_checkpoint(path, None, True, int8="channel"),
    "int-quantized-tensor": lambda path: write_compressed_checkpoint(path, None, True, int8="tensor"),
}


def cut_afterwards(whole: dict, config, shard: Shard) -> dict:
    """The reference: the one-rank weights, each cut to `shard` after the whole checkpoint was converted."""
    return {name: shard_quantized(name, w, config, shard) if isinstance(w, QuantizedWeight)
            else shard_tensor(name, w, config, shard) for name, w in whole.items()}


def assert_bit_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert type(g) is type(w), name
        if isinstance(w, QuantizedWeight):
            assert (g.bits, g.source, g.group, g.activation_bits) == (w.bits, w.source, w.group, w.activation_bits)
            pairs = [("codes", g.codes, w.codes), ("scale", g.scale, w.scale)]
            assert (g.zero is None) == (w.zero is None), name
            if w.zero is not None:
                pairs.append(("zero", g.zero, w.zero))
        else:
            pairs = [("tensor", g, w)]
        for part, a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name}.{part}: {a.dtype}{tuple(a.shape)} vs " \
                                                              f"{b.dtype}{tuple(b.shape)}"
            assert torch.equal(a, b), f"{name}.{part} differs"


@pytest.fixture(scope="module", params=list(WRITERS))
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](path)
    return request.param, str(path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_rank_equals_the_whole_checkpoint_cut_afterwards(checkpoint, dtype):
    fmt, path = checkpoint
    placement = Placement(dtype)
    config, whole = load_hf_dir(path, FULL, placement=placement)
    # The formats stay quantized on a dense family, but GPTQ act-order (a 32-column run mixing groups: dense).
    quantized = {type(w) for name, w in whole.items() if name.endswith("mlp.down_proj.weight")}
    assert quantized == ({torch.Tensor} if fmt.endswith("desc-act") else {QuantizedWeight}), fmt
    for rank in range(SIZE):
        shard = Shard(rank, SIZE)
        _, got = load_hf_dir(path, shard, placement=placement)
        assert_bit_identical(got, cut_afterwards(whole, config, shard))


def test_a_rank_keeps_its_own_memory_not_a_view_of_the_whole(checkpoint):
    """A column-parallel weight's rows are a contiguous slice: held as a view, they would keep every rank's rows."""
    _, path = checkpoint
    _, got = load_hf_dir(path, Shard(0, SIZE))
    for name, w in got.items():
        for part in ((w.codes, w.scale, w.zero) if isinstance(w, QuantizedWeight) else (w,)):
            if part is not None:
                held, own = part.untyped_storage().nbytes(), part.numel() * part.element_size()
                assert held == own, f"{name}: {held} bytes held for {own} of its own"


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "granitemoehybrid"])
def test_hybrid_projections_dequantized_per_rank_equal_the_whole_cut_afterwards(tmp_path, family, method):
    hybrid_quantized._write(family, method, tmp_path)
    placement = Placement(torch.bfloat16)
    config, whole = load_hf_dir(str(tmp_path), FULL, placement=placement)
    assert not any(isinstance(w, QuantizedWeight) for w in whole.values())  # dense matmuls in the hybrid families
    for rank in range(SIZE):
        shard = Shard(rank, SIZE)
        _, got = load_hf_dir(str(tmp_path), shard, placement=placement)
        assert_bit_identical(got, cut_afterwards(whole, config, shard))


def test_a_rank_whose_columns_split_a_group_is_refused(tmp_path, monkeypatch):
    from tests.service import test_awq_model

    # 4 heads of 48: with 4 ranks each holds 48 of o_proj's 192 input columns, not whole 32-column groups.
    monkeypatch.setattr(test_awq_model, "SHAPE", dict(hidden_size=192, intermediate_size=384, num_attention_heads=4,
                                                      num_key_value_heads=2))
    write_awq_checkpoint(tmp_path, 32)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: .*o_proj\.weight gives each rank 48 of its 192 "
                                         r"input columns, which is not a whole number of the 32-column groups of "
                                         r"the int4 kernels"):
        load_hf_dir(str(tmp_path), Shard(1, 4))
