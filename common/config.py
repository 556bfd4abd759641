"""One declaration per setting.

A setting is a dataclass field of its process's configuration (`scheduler_svc/config.py`, `worker_svc/config.py`,
`api_svc/config.py`, and `llmserve serve`'s own in `llmserve/serve.py`): its default, help, validation and
device-dependent default live in the field. The command line (`add_arguments`), `llmserve serve`'s forwarding
(`to_argv`), compose.yaml's variables (`env_name`) and docs/configuration.md (`llmserve/config_docs.py`) are
derived from the fields. A setting that two processes share is declared once here and used by both classes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from common.validation import ConfigError, power_of_two

ENV_PREFIX = "LLMSERVE_"
# Every gRPC server and channel (the public API and the scheduler->worker link): a resumed 8k-token batch of many
# requests stays far below it.
MAX_MESSAGE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a field says beyond its default."""

    help: str
    choices: tuple | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    # When the field is None: the value for the device ("cpu" or "cuda") the worker runs on.
    device_default: dict[str, Any] | None = None
    check: Callable[[Any], str | None] | None = None  # what is wrong with a value, or None
    from_env: bool = False  # the default comes from $LLMSERVE_<NAME> (a secret kept out of `ps`)
    parse: Callable[[str], Any] | None = None  # argparse's `type` instead of the annotation's
    nargs: str | None = None  # "+": one or more words (vLLM's list flags); the value is then a list of str


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field that is a setting (see `Meta` for the keywords)."""
    return dataclasses.field(default=default, metadata={"setting": Meta(help, **meta)})


# ---- validation -------------------------------------------------------------------------------------------------


# Cached: a shared setting's two declarations then hold the very same rule (and compare equal).
@functools.cache
def at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or v >= low else f"must be >= {low:g}, got {v}"


@functools.cache
def between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or low < v <= high else f"must be in ({low:g}, {high:g}], got {v}"


def is_power_of_two(v: int | None) -> str | None:
    if v is None or power_of_two(v):
        return None
    return f"must be a power of two >= 1 (the paged-attention kernels index blocks by shifts), got {v}"


_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def human_readable_int(text: str) -> int:
    """vLLM's token counts: `2048`, `32k` (32,000), `32K` (32,768), `25.6k`; a fraction needs a decimal unit."""
    text = text.strip()
    unit = _MULTIPLIERS.get(text[-1:])
    number = text[:-1] if unit else text
    try:
        if unit is None:
            return int(number)
        if unit in (1 << 10, 1 << 20, 1 << 30):
            return int(number) * unit
        return int(float(number) * unit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 2048, 32k, 32K)") from None


# ---- settings shared by two processes: declared once ------------------------------------------------------------


def max_num_batched_tokens() -> Any:
    """The scheduler's token budget per step; the worker sizes its KV pool after a warm-up step this large."""
    return setting(None, "tokens per step (the scheduler's budget; the worker warms up with a step this large "
                   "before it sizes the KV pool on a GPU; 8k / 8K as vLLM reads them)",
                   device_default={"cpu": 512, "cuda": 8192}, check=at_least(1), parse=human_readable_int)


def max_num_seqs() -> Any:
    """The scheduler's cap on running requests; a hybrid model's worker sizes its state pool from it (one slot each)."""
    return setting(None, "running requests cap (a hybrid model's worker also gives each one a state slot when "
                   "--num-state-slots is auto)", device_default={"cpu": 64, "cuda": 256}, check=at_least(1))


def state_snapshot_share() -> Any:
    """The scheduler bounds prefix-cache snapshots by it; a hybrid model's worker sizes its state pool with room for
    them."""
    return setting(0.5, "hybrid models (recurrent layers beside attention): the largest share of the worker's state "
                   "slots that prefix-cache snapshots of the recurrent state may hold (least recently used evicted "
                   "first; a request needing a slot evicts one too); 0: no hybrid prefix caching",
                   check=_share)


def _share(v: float) -> str | None:
    return None if 0 <= v <= 1 else f"must be in [0, 1], got {v}"


def redis_url() -> Any:
    return setting(None, "Redis (redis://[:PASSWORD@]HOST:PORT/DB; rediss://...?ssl_ca_certs=PATH for TLS): the "
                   "scheduler's state; the HTTP API's stored responses (/v1/responses)")


def namespace() -> Any:
    return setting("llmserve", "prefix of every Redis key")


def enable_lora() -> Any:
    return setting(False, "serve LoRA adapters of the base model (vLLM's flag): requests pick one by the model name")


def lora_modules_problem(words: list[str] | None) -> str | None:
    from common.lora import parse_lora_modules

    try:
        parse_lora_modules(words)
    except ValueError as e:
        return str(e).removeprefix("--lora-modules ")
    return None


def lora_modules() -> Any:
    """The scheduler registers them (in Redis); the worker reads and checks each at start-up."""
    return setting(None, "LoRA adapters to serve (PEFT directories), vLLM's forms: NAME=PATH words, or JSON objects "
                   '\'{"name": "a", "path": "/p", "base_model_name": "m"}\' (needs --enable-lora)',
                   metavar="NAME=PATH|JSON", nargs="+", check=lora_modules_problem)


def max_loras() -> Any:
    """The worker's device pool holds this many adapters; the scheduler admits no request whose adapter would be one
    more in the running batch."""
    return setting(1, "distinct LoRA adapters in one batch (the worker's device pool of adapters)",
                   check=at_least(1))


def reattach_timeout() -> Any:
    return setting(60.0, "seconds an accepted request outlives an unavailable scheduler (a fail-over, a lost lease): "
                   "the HTTP API re-attaches its stream for this long, the scheduler holds a vLLM engine protocol "
                   "stream (smg) open for this long while it stands by", check=at_least(0))


def tokenizer() -> Any:
    return setting(None, "GGUF file or HF directory for the tokenizer (default: the model)")


def worker_token() -> Any:
    return setting(None, "shared secret every scheduler->worker call carries and the worker checks "
                   "(unset = no check)", from_env=True)


def otlp_traces_endpoint() -> Any:
    return setting(None, "send traces over OTLP/gRPC to this collector (e.g. http://localhost:4317); the standard "
                   "OTEL_* variables also configure tracing (OTEL_TRACES_EXPORTER=console prints spans); off when "
                   "neither is set")


def tls_cert() -> Any:
    return setting(None, "serve gRPC over TLS with this certificate chain (PEM); needs --tls-key "
                   "(default: plaintext)")


def tls_key() -> Any:
    return setting(None, "private key (PEM) of --tls-cert")


def tls_client_ca() -> Any:
    return setting(None, "require client certificates signed by this CA bundle (PEM): mutual TLS; needs --tls-cert")


def api_key() -> Any:
    return setting(None, "clients must send `authorization: Bearer KEY`")


def served_model_name() -> Any:
    return setting(None, "the model name(s) HTTP clients use (vLLM's form: one or more words; replies and "
                   "/v1/models carry the first; default: the model's file or directory name)", nargs="+")


# ---- derived views ----------------------------------------------------------------------------------------------


def settings(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "setting" in f.metadata]


def meta(f: dataclasses.Field) -> Meta:
    return f.metadata["setting"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable (compose.yaml, .env) that stands for the setting `name`."""
    return ENV_PREFIX + name.upper()


def default(f: dataclasses.Field) -> Any:
    if meta(f).from_env:
        return os.environ.get(env_name(f.name)) or f.default
    return f.default


def value_type(cls: type, name: str) -> type:
    """int, float, str or bool: the field's annotation without `| None` (of a list: its element's)."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0]
    return hint


def add_arguments(parser, *classes: type, exclude: Iterable[str] = ()) -> None:
    """One option per setting of `classes` (a setting two of them share is added once)."""
    seen = set(exclude)
    for cls in classes:
        for f in settings(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            m, kind = meta(f), value_type(cls, f.name)
            kw: dict[str, Any] = {"dest": f.name, "default": default(f), "help": help_text(f)}
            if kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw.update(type=m.parse or kind, choices=m.choices, metavar=m.metavar, nargs=m.nargs)
            parser.add_argument(flag(f.name), *m.aliases, **kw)


def help_text(f: dataclasses.Field) -> str:
    m = meta(f)
    extra = []
    if m.device_default:
        extra.append("default " + ", ".join(f"{v} on {k.upper()}" for k, v in m.device_default.items()))
    if m.from_env:
        extra.append(f"default: ${env_name(f.name)}")
    return m.help + (f" ({'; '.join(extra)})" if extra else "")


def check(cfg: Any) -> None:
    """Each field's own validation; ConfigError naming the flag."""
    for f in settings(type(cfg)):
        rule = meta(f).check
        problem = rule(getattr(cfg, f.name)) if rule is not None else None
        if problem:
            raise ConfigError(f"{flag(f.name)} {problem}")


def from_namespace(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from the parsed command line (the fields it has), checked."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    cfg = cls(**{**values, **overrides})
    check(cfg)
    return cfg


def parse(cls: type, argv: Iterable = ()) -> Any:
    """`cls` from a command line of its own settings only (tests, benchmarks)."""
    p = argparse.ArgumentParser(prog=cls.__name__)
    add_arguments(p, cls)
    return from_namespace(cls, p.parse_args([str(a) for a in argv]))


def to_argv(cfg: Any, exclude: Iterable[str] = ()) -> list[str]:
    """The command line that reproduces `cfg`: every setting whose value differs from its default."""
    out: list[str] = []
    skip = set(exclude)
    for f in settings(type(cfg)):
        value = getattr(cfg, f.name)
        if f.name in skip or value == default(f):
            continue
        if isinstance(value, bool):
            out.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        elif isinstance(value, (list, tuple)):
            out += [flag(f.name), *map(str, value)]
        elif value is not None:
            out += [flag(f.name), str(value)]
    return out


def device_default(cls: type, name: str, device: str) -> Any:
    """The default of `cls`'s setting `name` on `device` ("cpu" or "cuda..."), or its plain default."""
    f = next(f for f in settings(cls) if f.name == name)
    table = meta(f).device_default
    return table["cuda" if device.startswith("cuda") else "cpu"] if table else f.default


def for_device(cfg: Any, device: str) -> Any:
    """`cfg` with its unset device-dependent settings filled in for `device`."""
    return dataclasses.replace(cfg, **{f.name: device_default(type(cfg), f.name, device)
                                       for f in settings(type(cfg))
                                       if meta(f).device_default and getattr(cfg, f.name) is None})

