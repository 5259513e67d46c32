"""What produced a result, read while it runs: the commit and whether the tree differs from it, the
command, the machine and the library versions. Nothing here comes from a variable a person sets.

A lent machine may run a copy of the tree without `.git`. The source digest covers that case: a hash
of every source file's git blob id, computed from the files on disk, so that

    python bench/provenance.py --match DIGEST

names the commit whose tree gives the same digest (no match: the run's tree was not a commit).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# What the digest and the dirty flag cover: the code and the build, not results or generated stubs.
SOURCE_PATHS = ("service", "cache_manager", "bench", "protos", "tests", "pyproject.toml", "Makefile")
_EXCLUDED = ("bench/results/", "service/proto/")
_SUFFIXES = (".py", ".proto", ".sh", ".toml", ".cfg", ".txt")
PACKAGES = ("torch", "transformers", "grpcio", "protobuf", "triton", "numpy", "prometheus-client", "structlog")


def _git(args: list[str], root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True).stdout


def _covered(path: str) -> bool:
    if path.startswith(_EXCLUDED) or "__pycache__" in path:
        return False
    return path in SOURCE_PATHS or path.endswith(_SUFFIXES)


def blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(entries: dict[str, str]) -> str:
    text = "".join(f"{path}\0{blob}\n" for path, blob in sorted(entries.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_digest(root: Path = REPO_ROOT) -> str:
    """Digest of the source files on disk (paths and blob ids), as `digest_at` computes it for a commit."""
    entries = {}
    for top in SOURCE_PATHS:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for path in files:
            rel = path.relative_to(root).as_posix()
            if _covered(rel):
                entries[rel] = blob_id(path.read_bytes())
    return _digest(entries)


def digest_at(commit: str, root: Path = REPO_ROOT) -> str:
    """The source digest of a commit's tree, from git's own blob ids (no file is read)."""
    entries = {}
    for line in _git(["ls-tree", "-r", "-z", commit, "--", *SOURCE_PATHS], root).split("\0"):
        if line:
            meta, path = line.split("\t", 1)
            if meta.split()[1] == "blob" and _covered(path):
                entries[path] = meta.split()[2]
    return _digest(entries)


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """HEAD and whether the source files differ from it (tracked changes, or untracked files git does
    not ignore); None for both where git or `.git` is missing, with the reason."""
    try:
        head = _git(["rev-parse", "HEAD"], root).strip()
        status = _git(["status", "--porcelain", "--untracked-files=all", "--", *SOURCE_PATHS,
                       *(f":(exclude){p}" for p in _EXCLUDED)], root)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"git_commit": None, "git_dirty": None, "git_error": f"{type(exc).__name__}: {exc}"[:300]}
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"git_commit": head, "git_dirty": bool(changed), "git_dirty_paths": changed[:20]}


def packages() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return out.strip().splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def machine() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver_version": _nvidia_smi("driver_version") if cuda else None,
        "cuda_runtime": torch.version.cuda,
    }


def command_line() -> str:
    return "python " + shlex.join(sys.argv)


def provenance() -> dict[str, Any]:
    """The fields every result file starts with."""
    return {"command": command_line(), **git_state(), "source_digest": source_digest(),
            "machine": machine(), "packages": packages()}


def match(digest: str, last: int, root: Path = REPO_ROOT) -> str | None:
    """The newest of the last `last` commits (all branches) whose source digest is `digest`."""
    for commit in _git(["rev-list", "--all", "-n", str(last)], root).split():
        if digest_at(commit, root) == digest:
            return commit
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", metavar="DIGEST", help="name the commit whose source digest this is")
    p.add_argument("--last", type=int, default=300, help="how many commits to search")
    args = p.parse_args(argv)
    if args.match is None:
        print(f"source digest of this tree: {source_digest()}  ({git_state()})")
        return 0
    commit = match(args.match, args.last)
    print(commit or f"no commit among the last {args.last} has source digest {args.match}")
    return 0 if commit else 1


if __name__ == "__main__":
    sys.exit(main())
