"""The one parser of JSON-valued flags: an object whose keys are known and of their types, and one error form (the
flag, then what is wrong with which key and what it takes) across every flag that uses it."""

from __future__ import annotations

import pytest

from common.json_flag import JsonFlagError, parse_json_object
from common.speculative_config import parse_speculative_config
from common.structured_outputs import StructuredOutputsConfig
from worker_svc.config import CompilationConfig
from worker_svc.sampling.pooler_config import PoolerConfig

KEYS = {"n": (int,), "ratio": (float,), "name": (str, type(None)), "on": (bool,), "sizes": (list,)}


def parse(text: str | None) -> dict | None:
    return parse_json_object("--x-config", text, KEYS, '{"n": 2}')


def test_an_object_of_known_keys_comes_back_as_it_is():
    assert parse('{"n": 2, "ratio": 1, "name": null, "on": false, "sizes": [1]}') == \
        {"n": 2, "ratio": 1, "name": None, "on": False, "sizes": [1]}
    assert parse(None) is None and parse("  ") is None


@pytest.mark.parametrize(("text", "message"), [
    ("{", "--x-config must be a JSON object, e.g. {\"n\": 2}; got '{' (not JSON: "),
    ("[1]", "--x-config must be a JSON object, e.g. {\"n\": 2}; got '[1]'"),
    ('{"m": 1}', "--x-config has an unknown key 'm'; known: n, name, on, ratio, sizes"),
    ('{"n": "2"}', "--x-config key 'n' must be an integer, got \"2\""),
    ('{"n": true}', "--x-config key 'n' must be an integer, got true"),  # JSON true is not the integer 1
    ('{"on": 1}', "--x-config key 'on' must be true or false, got 1"),
    ('{"name": 3}', "--x-config key 'name' must be a string or null, got 3"),
    ('{"ratio": "x"}', "--x-config key 'ratio' must be a number, got \"x\""),
])
def test_every_wrong_value_names_the_flag_the_key_and_what_it_takes(text, message):
    with pytest.raises(JsonFlagError) as e:
        parse(text)
    assert str(e.value).startswith(message)
    assert e.value.flag == "--x-config" and str(e.value) == f"--x-config {e.value.problem}"


@pytest.mark.parametrize(("parser", "flag"), [
    (parse_speculative_config, "--speculative-config"), (PoolerConfig.parse, "--pooler-config"),
    (StructuredOutputsConfig.parse, "--structured-outputs-config"),
    (CompilationConfig.parse, "--compilation-config"),
])
def test_the_flags_share_the_form(parser, flag):
    for text, problem in (("[1]", "must be a JSON object, e.g. "),
                          ('{"nope": 1}', "has an unknown key 'nope'; known: ")):
        with pytest.raises(JsonFlagError) as e:
            parser(text)
        assert e.value.flag == flag and e.value.problem.startswith(problem), str(e.value)
