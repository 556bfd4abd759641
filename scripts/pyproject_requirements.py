"""Print the requirements of this project's core (no argument) or of the extras named as arguments, one a line, for
`pip install -r`. The Dockerfile installs them in a layer of their own before the sources are copied, so an edit of
the code rebuilds only the image's last layer, not its dependencies."""

import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    if not extras:
        return list(project["dependencies"])
    known = project["optional-dependencies"]
    unknown = [e for e in extras if e not in known]
    if unknown:
        raise SystemExit(f"extras: no {', '.join(unknown)} in {PYPROJECT.name} (it has {', '.join(known)})")
    return [r for e in extras for r in known[e]]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
