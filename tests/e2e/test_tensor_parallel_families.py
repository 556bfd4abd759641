"""Tensor parallel 2 equals 1 for the families beyond Llama: Qwen3 (q/k norm, explicit head_dim, a sliding layer)
and Gemma 2 (four norms, soft-capping, interleaved windows; its norms come after the row-parallel all-reduce).
Random-weight checkpoints written by transformers; two gloo ranks on this CPU, each loading only its slices."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_tensor_parallel import _steps
from tests.support.rank_pair import run_on_ranks
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import Shard, local_config

FAMILIES = ("qwen3_sliding", "gemma2", "gemma3")
SIZE = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    from tests.service.test_model_families import make_checkpoint  # transformers: not in every spawned rank

    paths = []
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        make_checkpoint(name, path, max_position_embeddings=256)
        paths.append(str(path))
    return paths


def _load(path: str, shard: Shard, group=None):
    config, weights = load_hf_dir(path, shard)
    return models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                               tp=group)


def _rank_steps(path: str, shard: Shard, group) -> tuple[list[torch.Tensor | None], None]:
    return _steps(_load(path, shard, group)), None


def test_tp2_logits_equal_one_rank(checkpoints, tmp_path):
    expected = [_steps(_load(path, Shard(0, 1))) for path in checkpoints]
    got = run_on_ranks(_rank_steps, checkpoints, str(tmp_path), SIZE)
    for i, want in enumerate(expected):
        for g, w in zip(got[i][0], want, strict=True):
            assert g.shape == w.shape
            diff = (g - w).abs().max().item()
            assert diff < 1e-4 * max(1.0, w.abs().max().item()), f"{FAMILIES[i]} N=2: max abs logit diff {diff}"
