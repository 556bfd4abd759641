"""Every repository path a Markdown file names exists: a path in backticks or a Markdown link target whose first
part is a top-level file or folder of the repository (`tests/unit/test_policy.py`, `compose.yaml`,
`llmserve/bench/{cli,fleet}.py`, `protos/*_pb2.py`). Docs that name moved or deleted files mislead the next reader."""

from __future__ import annotations

import glob
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTENSIONS = (".py", ".md", ".proto", ".sh", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".ini", ".pyi")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TOKEN = re.compile(r"[A-Za-z0-9_.{},*/\-]+")


def repo_files() -> list[str]:
    """Tracked files plus new ones git does not ignore; without git, a walk that skips hidden and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return [p for p in out.splitlines() if os.path.exists(os.path.join(ROOT, p))]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for base, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            found += [os.path.relpath(os.path.join(base, f), ROOT) for f in files]
        return found


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand_braces(path[:m.start()] + alt + path[m.end():])]


def candidates(text: str) -> list[tuple[str, bool]]:
    """(path, is_link) pairs: tokens of inline code spans and link targets that could name a file."""
    found = []
    for fence_free in re.split(r"^```.*?^```", text, flags=re.S | re.M):
        for span in CODE_SPAN.finditer(fence_free):
            found += [(tok, False) for tok in TOKEN.findall(span.group(2))]
        found += [(m.group(1), True) for m in LINK.finditer(fence_free)]
    return found


def normalize(token: str) -> str:
    token = token.split("#", 1)[0].split("::", 1)[0]
    token = re.sub(r":\d+(-\d+)?$", "", token)
    return token.rstrip(".,;:")


def missing_paths(md_path: str, known: set[str], top_level: set[str]) -> list[str]:
    with open(os.path.join(ROOT, md_path), encoding="utf-8") as f:
        text = f.read()
    md_dir = os.path.dirname(md_path)
    missing = []
    for raw, is_link in candidates(text):
        if is_link and re.match(r"^[a-z]+:|^#|^/", raw):
            continue  # a URL, an anchor or an absolute path
        token = normalize(raw)
        if not token:
            continue
        if is_link:
            rel = os.path.normpath(os.path.join(md_dir, token))
        else:
            if token.startswith(("/", "./", "../")) or ("/" not in token and not token.endswith(EXTENSIONS)):
                continue
            rel = os.path.normpath(token)
        if rel.split(os.sep, 1)[0] not in top_level:
            continue  # not a repository path (a module name, a flag value, a file the user creates)
        for path in expand_braces(rel):
            if "*" in path:
                hit = any(os.path.relpath(p, ROOT) in known for p in glob.glob(os.path.join(ROOT, path)))
            else:
                hit = path.rstrip("/") in known
            if not hit:
                missing.append(f"{md_path}: {raw}")
    return missing


def test_markdown_files_name_only_existing_repository_paths():
    files = repo_files()
    known = set(files)
    for f in files:  # every folder that holds a file counts as existing
        parts = f.split("/")
        known.update("/".join(parts[:i]) for i in range(1, len(parts)))
    top_level = {f.split("/", 1)[0] for f in files}
    markdown = sorted(f for f in files if f.endswith(".md"))
    assert "README.md" in markdown
    missing = [m for md in markdown for m in missing_paths(md, known, top_level)]
    assert not missing, "Markdown names repository paths that do not exist:\n" + "\n".join(missing)
