"""Structured outputs without a model: the constraint checks, the flag, the grammar cache and the masks, on a tiny
raw vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.json_flag import JsonFlagError
from common.structured_outputs import (
    Constraint,
    ConstraintError,
    StructuredOutputsConfig,
    build_grammar,
    check_shape,
    choice_spec,
)
from worker_svc.sampling.grammar import GrammarCache, GrammarMasks

VOCAB = ["a", "b", "c", "1", "2", "{", "}", '"', ":", ",", "x", "<eos>"]
EOS = VOCAB.index("<eos>")


def cache(capacity: int = 4) -> GrammarCache:
    return GrammarCache("", len(VOCAB), [EOS], capacity=capacity, vocabulary=(VOCAB, "RAW"))


def ids(text: str) -> np.ndarray:
    return np.array([VOCAB.index(ch) for ch in text], dtype=np.int64)


def test_config_takes_vllm_keys_and_names_the_wrong_one():
    assert StructuredOutputsConfig.parse(None) == StructuredOutputsConfig()
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar", "disable_any_whitespace": true}') == \
        StructuredOutputsConfig("xgrammar", True)
    for text, words in (('{"backend": "guidance"}', "guidance"), ('{"cache": 3}', "cache"), ("[1]", "JSON object"),
                        ("{", "JSON object"), ('{"disable_any_whitespace": 1}', "disable_any_whitespace")):
        with pytest.raises(JsonFlagError, match=words) as e:
            StructuredOutputsConfig.parse(text)
        assert "--structured-outputs-config" in str(e.value)


@pytest.mark.parametrize("c, words", [
    (Constraint("json_schema", "{oops"), "not valid JSON"),
    (Constraint("json_schema", "[1]"), "must be a JSON object"),
    (Constraint("regex", ""), "empty"),
    (Constraint("choice", "[]"), "empty"),
    (Constraint("choice", "[1]"), "string"),
    (Constraint("lark", "x"), "unknown constraint kind"),
])
def test_shape_checks(c, words):
    with pytest.raises(ConstraintError, match=words):
        check_shape(c)


@pytest.mark.parametrize("c, words", [
    (Constraint("json_schema", '{"type": "objectx"}'), "objectx"),
    (Constraint("regex", "(a"), "parenthesis"),
    (Constraint("grammar", "root ::= nothing"), "nothing"),
])
def test_compile_errors_are_xgrammars_reason_without_its_source_location(c, words):
    with pytest.raises(ConstraintError, match=words) as e:
        build_grammar(c, StructuredOutputsConfig())
    assert ".cc:" not in str(e.value)


def test_choice_spec_refuses_an_empty_list():
    with pytest.raises(ConstraintError, match="empty"):
        choice_spec([])
    assert json.loads(choice_spec(['say "hi"', "b"])) == ['say "hi"', "b"]


def test_cache_compiles_once_and_evicts_the_least_recently_used():
    gc = cache(capacity=2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    assert gc.get(a)[2] is False and gc.get(a)[2] is True
    gc.get(b)
    gc.get(a)  # a is now the most recent
    gc.get(c)  # evicts b
    assert (gc.hits, gc.misses) == (2, 3)
    assert gc.get(a)[2] is True and gc.get(b)[2] is False


def test_a_bad_constraint_is_not_cached_and_fails_each_time():
    gc = cache()
    for _ in range(2):
        with pytest.raises(ConstraintError):
            gc.get(Constraint("regex", "(a"))


def test_matcher_replays_output_and_refuses_output_that_does_not_fit():
    gc = cache()
    choice = Constraint("choice", choice_spec(["abc", "ab1"]))
    m = gc.matcher(choice, ids("ab"))
    logits = torch.zeros(2, len(VOCAB))
    masks = GrammarMasks(len(VOCAB))
    masks.apply(logits, [None, m])
    allowed = [VOCAB[i] for i in torch.nonzero(logits[1] == 0).flatten().tolist()]
    assert sorted(allowed) == ["1", "c"] and bool((logits[0] == 0).all())  # row 0 is unconstrained
    ended = masks.advance([None, m], np.array([0, VOCAB.index("c")]))
    assert ended.tolist() == [False, False]  # complete, but it still takes the stop token
    assert masks.advance([None, m], np.array([0, EOS])).tolist() == [False, True]
    with pytest.raises(ConstraintError, match="does not fit"):
        gc.matcher(choice, ids("ax"))


def test_a_token_outside_the_mask_ends_the_request():
    m = cache().matcher(Constraint("regex", "a+"), ids(""))
    assert GrammarMasks.advance([m], np.array([VOCAB.index("b")])).tolist() == [True]


def test_disable_any_whitespace_per_constraint_or_for_the_server():
    """The constraint's own flag (forced tool calls, vLLM's per-request field) or the server's config: JSON without
    optional whitespace, so no token goes to newlines and indentation; without either, whitespace is free."""
    vocab = [*VOCAB, " ", "\n"]
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def fits(text: str, c: Constraint, cfg: StructuredOutputsConfig | None = None) -> bool:
        gc = GrammarCache("", len(vocab), [EOS], config=cfg, vocabulary=(vocab, "RAW"))
        try:
            gc.matcher(c, np.array([vocab.index(ch) for ch in text], dtype=np.int64))
        except ConstraintError:
            return False
        return True

    free, compact = Constraint("json_schema", schema), Constraint("json_schema", schema, disable_any_whitespace=True)
    assert free != compact  # separate entries of the grammar cache
    assert fits('{\n  "a": 1', free) and fits('{"a": 1}', free)
    assert fits('{"a": 1}', compact) and not fits('{\n', compact) and not fits('{"a":  1', compact)
    assert not fits('{\n', free, StructuredOutputsConfig(disable_any_whitespace=True))


def allowed(row: torch.Tensor) -> list[str]:
    return sorted(VOCAB[i] for i in torch.nonzero(row == 0).flatten().tolist())


def test_drafts_are_cut_before_the_first_token_the_grammar_rejects():
    """Speculation (worker_svc/core/grammar_drafts.py): of the drafts a proposer wrote, only the prefix the grammar
    accepts from its state is verified; a stop token is never a draft; the matcher is left where it was."""
    gc = cache()
    m = gc.matcher(Constraint("choice", choice_spec(["abc", "ab1"])), ids("a"))
    stop = frozenset({EOS})
    assert GrammarMasks.fitting_prefix(m, ids("bcx").tolist(), stop) == 2  # "x" does not fit after "abc"
    assert GrammarMasks.fitting_prefix(m, ids("b1").tolist() + [EOS], stop) == 2
    assert GrammarMasks.fitting_prefix(m, ids("cb").tolist(), stop) == 0
    logits = torch.zeros(1, len(VOCAB))
    GrammarMasks(len(VOCAB)).apply(logits, [m])
    assert allowed(logits[0]) == ["b"]  # still after "a"


def test_each_verified_position_is_masked_at_the_state_after_the_drafts_before_it():
    gc = cache()
    m = gc.matcher(Constraint("choice", choice_spec(["abc", "ab1"])), ids(""))
    # Two requests: an unconstrained one with one draft (2 positions), the constrained one with drafts "ab".
    logits = torch.zeros(5, len(VOCAB))
    masks = GrammarMasks(len(VOCAB))
    masks.apply_with_drafts(logits, [None, m], [ids("x"), ids("ab")])
    assert bool((logits[:2] == 0).all())
    assert [allowed(r) for r in logits[2:]] == [["a"], ["b"], ["1", "c"]]
    logits = torch.zeros(1, len(VOCAB))
    masks.apply(logits, [m])
    assert allowed(logits[0]) == ["a"]  # rolled back
    # Then the step emits "a", "b" (accepted drafts) and "c" (the bonus token), and next the stop token.
    assert masks.advance_runs([None, m], np.array([0, 1, 1, 1]), np.array([3, *ids("abc")])).tolist() == [False, False]
    assert masks.advance_runs([m], np.array([0]), np.array([EOS])).tolist() == [True]
