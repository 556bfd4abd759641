"""One declaration per setting: the configuration dataclasses are the only source of the flags, their defaults,
`llmserve serve`'s forwarding, compose.yaml's variables and docs/configuration.md."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re

import pytest
import yaml

from api_svc.config import APIConfig
from common import config
from common.config import ConfigError
from llmserve import config_docs
from llmserve.cli import build_parser
from llmserve.serve import ServeConfig
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.driver.driver import DriverConfig
from worker_svc.config import WorkerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROCESSES = (SchedulerConfig, WorkerConfig, APIConfig, ServeConfig)
LISTEN = {"host", "port"}  # each process listens on its own address: a per-process setting by design
PRODUCT = ("common", "api_svc", "scheduler_svc", "worker_svc", "llmserve", "kernels")


def test_a_setting_two_processes_share_has_one_default():
    seen: dict[str, tuple[type, dataclasses.Field]] = {}
    shared = set()
    for cls in PROCESSES:
        for f in config.settings(cls):
            if f.name in LISTEN:
                continue
            if f.name in seen:
                other_cls, other = seen[f.name]
                shared.add(f.name)
                assert (f.default, config.meta(f)) == (other.default, config.meta(other)), \
                    f"{f.name}: {cls.__name__} and {other_cls.__name__} declare it differently"
                assert config.value_type(cls, f.name) is config.value_type(other_cls, f.name), f.name
            else:
                seen[f.name] = (cls, f)
    assert {"max_num_batched_tokens", "tokenizer", "worker_token", "api_key", "served_model_name",
            "otlp_traces_endpoint", "tls_cert"} <= shared


def test_the_internal_configs_take_their_defaults_from_the_settings():
    s = SchedulerConfig()
    policy = PolicyConfig(max_num_batched_tokens=1, max_num_seqs=1, block_size=1)
    for name in ("enable_chunked_prefill", "long_prefill_token_threshold", "scheduling_policy",
                 "enable_prefix_caching", "scheduling_mode"):
        assert getattr(policy, name) == getattr(s, name), name
    driver = DriverConfig(policy=policy, worker_address="x")
    for name in ("max_num_queued_requests", "queue_timeout", "lease_ttl_ms", "debug_invariants", "async_scheduling"):
        assert getattr(driver, name) == getattr(s, name), name
    assert PolicyConfig.unsized(s).enable_prefix_caching is True  # the flag's default, also in the core


def test_the_device_dependent_defaults():
    assert config.device_default(SchedulerConfig, "max_num_batched_tokens", "cuda:0") == 8192
    assert config.device_default(WorkerConfig, "max_num_batched_tokens", "cuda") == 8192
    assert config.device_default(SchedulerConfig, "max_num_batched_tokens", "cpu") == 512
    assert config.device_default(SchedulerConfig, "max_num_seqs", "cuda") == 256
    worker = config.for_device(WorkerConfig(), "cuda")
    assert worker.max_num_batched_tokens == 8192  # the warm-up step is as large as the scheduler's budget
    assert config.for_device(WorkerConfig(max_num_batched_tokens=100), "cuda").max_num_batched_tokens == 100


def test_grpc_message_size_is_declared_once():
    """Every gRPC server and channel of the product uses common.config.MAX_MESSAGE_BYTES."""
    wrong = []
    for package in PRODUCT:
        for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if not name.endswith(".py") or "_pb2" in name:
                    continue
                path = os.path.join(dirpath, name)
                text = open(path).read()
                for m in re.finditer(r"message_length\",\s*([^)\]]+)", text):
                    if m.group(1).strip() != "MAX_MESSAGE_BYTES":
                        wrong.append(f"{os.path.relpath(path, ROOT)}: {m.group(0)}")
                if re.search(r"^MAX_MESSAGE_BYTES\s*=", text, re.M) and package != "common":
                    wrong.append(f"{os.path.relpath(path, ROOT)} declares its own MAX_MESSAGE_BYTES")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("cls", PROCESSES, ids=lambda c: c.__name__)
def test_every_field_is_a_setting_with_help(cls):
    for f in dataclasses.fields(cls):
        assert "setting" in f.metadata, f"{cls.__name__}.{f.name} is not declared with common.config.setting"
        assert config.meta(f).help, f.name


@pytest.mark.parametrize(("command", "cls"), [("scheduler", SchedulerConfig), ("worker", WorkerConfig),
                                              ("api", APIConfig), ("serve", ServeConfig)])
def test_each_command_line_is_derived_from_its_dataclass(command, cls):
    args = build_parser().parse_args([command])
    for f in config.settings(cls):
        assert getattr(args, f.name) == config.default(f), f.name
    cfg = config.from_namespace(cls, args)
    assert config.to_argv(cfg) == []  # everything at its default


def test_argv_round_trips_through_the_config():
    cfg = WorkerConfig(block_size=32, allow_kv_pool_below_max_model_len=True, dtype="bfloat16", max_model_len=99)
    assert config.parse(WorkerConfig, config.to_argv(cfg)) == cfg
    sched = SchedulerConfig(enable_prefix_caching=False, queue_timeout=2.5)
    assert config.to_argv(sched) == ["--no-enable-prefix-caching", "--queue-timeout", "2.5"]
    assert config.parse(SchedulerConfig, config.to_argv(sched)) == sched


@pytest.mark.parametrize(("cls", "argv", "message"), [
    (WorkerConfig, ["--block-size", "12"], "--block-size must be a power of two"),
    (WorkerConfig, ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (SchedulerConfig, ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
    (SchedulerConfig, ["--max-num-seqs", "-1"], "--max-num-seqs must be >= 1, got -1"),
])
def test_validation_names_the_flag_and_the_limit(cls, argv, message):
    with pytest.raises(ConfigError) as e:
        config.parse(cls, argv)
    assert message in str(e.value)


def test_scheduler_combinations_fail_naming_both_flags():
    with pytest.raises(ConfigError, match="--speculative-config needs --scheduling-mode continuous"):
        SchedulerConfig(speculative_config='{"num_speculative_tokens": 2}', scheduling_mode="static").validate()
    with pytest.raises(ConfigError, match="--max-num-batched-tokens .* smaller than --block-size"):
        SchedulerConfig(max_num_batched_tokens=8).validate(block_size=16)


def test_no_flag_is_declared_outside_the_dataclasses():
    """The services' and serve's options come only from common.config.add_arguments."""
    wrong = []
    for rel in ("scheduler_svc/servers/process.py", "worker_svc/server.py", "api_svc/server.py", "llmserve/serve.py"):
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        wrong += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and n.attr in ("add_argument", "_actions")]
    assert not wrong, wrong


def test_compose_names_only_known_settings():
    """compose.yaml's LLMSERVE_<NAME> variables stand for the settings <name>; one passed on a command line follows
    that setting's flag."""
    known = {config.env_name(f.name) for cls in PROCESSES for f in config.settings(cls)}
    not_settings = {"LLMSERVE_MODEL_DIR"}  # the host directory mounted at /models
    text = open(os.path.join(ROOT, "compose.yaml")).read()
    used = set(re.findall(r"\$\{(LLMSERVE_\w+)", text))
    assert used and used - not_settings <= known, sorted(used - not_settings - known)
    for name, svc in yaml.safe_load(text)["services"].items():
        command = svc.get("command") or []
        words = [w for part in command for w in part.split()]
        for i, word in enumerate(words):
            var = re.match(r"\$\{(LLMSERVE_\w+)", word)  # the outer one: an inner one is its default's
            if var is not None and var.group(1) not in not_settings:
                flag = config.flag(var.group(1).removeprefix(config.ENV_PREFIX).lower())
                assert words[i - 1] == flag, f"{name}: {var.group(1)} must follow {flag}, follows {words[i - 1]}"


def test_configuration_docs_are_generated_from_the_dataclasses():
    with open(config_docs.PATH) as f:
        assert f.read() == config_docs.render(), "docs/configuration.md is stale: run `python -m llmserve.config_docs`"


def test_the_worker_token_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMSERVE_WORKER_TOKEN", "from-env")
    p = argparse.ArgumentParser()
    config.add_arguments(p, WorkerConfig)
    assert p.parse_args([]).worker_token == "from-env"
    assert config.to_argv(config.from_namespace(WorkerConfig, p.parse_args([]))) == []  # the child inherits it
