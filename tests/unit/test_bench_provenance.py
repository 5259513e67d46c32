"""A result file's provenance is read from the tree it ran in: the commit, whether the source differs
from it, and a digest that names the commit when the tree came without `.git`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench.provenance import digest_at, git_state, match, source_digest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for path, text in {"service/a.py": "x = 1\n", "bench/b.py": "y = 2\n", "bench/results/r.json": "{}\n",
                       "README.md": "words\n", "Makefile": "all:\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_clean_tree_gives_its_commit_and_the_digest_of_that_commit(repo: Path) -> None:
    state = git_state(repo)
    assert state == {"git_commit": _git(repo, "rev-parse", "HEAD"), "git_dirty": False, "git_dirty_paths": []}
    assert source_digest(repo) == digest_at("HEAD", repo)
    assert match(source_digest(repo), 10, repo) == state["git_commit"]


def test_source_changes_make_the_tree_dirty_and_change_the_digest(repo: Path) -> None:
    clean = source_digest(repo)
    (repo / "bench/results/new.json").write_text("{}\n")  # results and prose are not source
    (repo / "README.md").write_text("other words\n")
    assert git_state(repo)["git_dirty"] is False and source_digest(repo) == clean
    (repo / "service/a.py").write_text("x = 2\n")
    (repo / "service/new.py").write_text("z = 3\n")
    state = git_state(repo)
    assert state["git_dirty"] is True and set(state["git_dirty_paths"]) == {"service/a.py", "service/new.py"}
    assert source_digest(repo) != clean and match(source_digest(repo), 10, repo) is None


def test_without_git_the_commit_is_unknown_and_the_digest_still_names_it(
        repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    copy = tmp_path_factory.mktemp("lent") / "tree"  # a lent machine's copy of the tree: files, no .git
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    state = git_state(copy)
    assert state["git_commit"] is None and state["git_dirty"] is None and state["git_error"]
    assert match(source_digest(copy), 10, repo) == _git(repo, "rev-parse", "HEAD")
