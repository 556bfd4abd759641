"""$LLMSERVE_GGUF_CACHE_DIR: what a worker and a scheduler read back from the cache equals what they parse from the
bundled GGUF (weights bit for bit, whole and as the tensor-parallel shards the GGUF loader cuts; the tokenizer
token for token), starts at once parse once, a changed file gets a new entry, and a cache that cannot be written is
skipped."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common import gguf_cache
from common.tokenizer import Tokenizer
from worker_svc.model.loader import load_gguf
from worker_svc.parallel.sharding import Shard

TEXT = "<|im_start|>user\nHello, wörld! 12345 naïve café\tdone<|im_end|>"


def entries(cache_dir: str) -> list[str]:
    """The cache's files less the lock files `gguf_cache.building` leaves (temporary files count)."""
    return [f for f in os.listdir(cache_dir) if not f.endswith(".lock")]


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> str:
    d = str(tmp_path / "cache")
    monkeypatch.setenv(gguf_cache.ENV, d)
    return d


def test_cached_weights_equal_the_parsed_ones(bundled_model_path, cache_dir, monkeypatch):
    want_config, want = load_gguf(bundled_model_path)  # a miss: parsed, then stored
    assert len(entries(cache_dir)) == 1, os.listdir(cache_dir)  # one entry, no temporary file left
    config, weights = load_gguf(bundled_model_path)  # a hit
    assert config == want_config
    assert weights.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(weights[name], w), name
    # A rank's slices from the cache equal the ones the GGUF loader dequantizes for it (rows only, for q/k/v, ...).
    shard = Shard(1, 3)
    cached_shard = load_gguf(bundled_model_path, shard)[1]
    monkeypatch.delenv(gguf_cache.ENV)
    for name, w in load_gguf(bundled_model_path, shard)[1].items():
        assert torch.equal(cached_shard[name], w), name
    monkeypatch.setenv(gguf_cache.ENV, cache_dir)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not divide the model's 9 attention heads"):
        load_gguf(bundled_model_path, Shard(0, 2))


def test_cached_tokenizer_equals_the_parsed_one(bundled_model_path, cache_dir, tmp_path):
    copy = str(tmp_path / "model.gguf")  # a file of its own: no other test's entry
    shutil.copy(bundled_model_path, copy)
    want = Tokenizer.from_gguf(copy)  # a miss: parsed, then stored
    assert len(entries(cache_dir)) == 1
    tok = Tokenizer.from_gguf(copy)  # a hit
    assert tok.backend is not want.backend
    assert tok.encode(TEXT) == want.encode(TEXT)
    assert tok.decode(want.encode(TEXT)) == want.decode(want.encode(TEXT))
    assert (tok.bos_token_id, tok.eos_token_id, tok.chat_template, tok.vocab_size) == \
        (want.bos_token_id, want.eos_token_id, want.chat_template, want.vocab_size)


def test_starts_at_once_parse_the_gguf_once(bundled_model_path, cache_dir, tmp_path, monkeypatch):
    """Three loads of one GGUF at once (as a tensor-parallel group's ranks start): one parses, the others wait on the
    entry's lock and read what it stored."""
    copy = str(tmp_path / "model.gguf")
    shutil.copy(bundled_model_path, copy)
    parses = []
    parse = Tokenizer._read_gguf.__func__

    def counted(cls, path):
        parses.append(path)
        return parse(cls, path)

    monkeypatch.setattr(Tokenizer, "_read_gguf", classmethod(counted))
    with ThreadPoolExecutor(3) as pool:
        toks = list(pool.map(lambda _: Tokenizer.from_gguf(copy), range(3)))
    assert parses == [copy]
    assert len({tuple(t.encode(TEXT)) for t in toks}) == 1
    assert len(entries(cache_dir)) == 1


def test_a_changed_file_is_a_new_entry(tmp_path, cache_dir):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    first = gguf_cache.entry(str(path), "tokenizer.json")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert gguf_cache.entry(str(path), "tokenizer.json") != first
    path.write_bytes(b"GGUF2")
    assert gguf_cache.entry(str(path), "tokenizer.json") != first
    assert gguf_cache.entry(str(path), "tokenizer.json").startswith(cache_dir)


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    gguf_cache.store(str(blocker / "entry"), lambda tmp: open(tmp, "w").close())  # no directory there: logged
    assert blocker.read_text() == ""
