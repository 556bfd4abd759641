"""Every command the Markdown files document for a bench script (`python -m bench.NAME ...`, `llmserve bench SUB
...`) runs, in its smoke size: the documented flags as written, the sizes from tests/support/bench_runs.py
(SMOKE_ARGS). A new documented command is picked up by itself; a script without a smoke size fails here."""

from __future__ import annotations

import pytest

from tests.support import cluster
from tests.support.bench_runs import PACKAGE, SMOKE_ARGS, documented_commands, run_command, scripts, smoke_argv


def _runs() -> list:
    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    for path, command, args in documented_commands():
        if command in SMOKE_ARGS:
            seen.setdefault((command, tuple(smoke_argv(command, args))), f"{command} {' '.join(args)} ({path})")
    return [pytest.param(command, list(argv), id=doc) for (command, argv), doc in seen.items()]


def test_every_documented_command_has_a_smoke_size():
    documented = {command for _, command, _ in documented_commands()}
    unknown = sorted(documented - set(SMOKE_ARGS))
    assert not unknown, f"documented commands without a smoke size in tests/support/bench_runs.py: {unknown}"
    missing = sorted(set(scripts()) - set(SMOKE_ARGS))
    assert not missing, f"{PACKAGE}/ scripts without a smoke size in tests/support/bench_runs.py: {missing}"


@pytest.fixture(scope="module")
def served():
    """A running `llmserve serve` for the commands that name one with --target."""
    metrics_port = cluster.free_port()
    proc = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 128, "--max-model-len", 512,
                                "--metrics-port", metrics_port])
    yield {"target": proc.address, "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}
    cluster.stop(proc)


@pytest.mark.slow  # each run starts what it measures (a stack, the runner, the kernels, Hugging Face)
@pytest.mark.parametrize("command,argv", _runs())
def test_documented_command_runs(command, argv, tmp_path, request):
    values = {"tmp": str(tmp_path)}
    if any("{target}" in a for a in argv):
        values.update(request.getfixturevalue("served"))
    run_command(command, [a.format(**values) for a in argv], timeout=600)
