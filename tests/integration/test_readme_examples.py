"""The README's Python examples run as printed (built-in model, CPU)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


@pytest.mark.parametrize("section", ["Python API", "Chat"])
def test_readme_python_examples_run(section, model_cache_dir, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(model_cache_dir.parent))  # the built-in model is generated once
    blocks = python_blocks(section)
    assert blocks, f"no python example under '## {section}'"
    for code in blocks:
        exec(compile(code, f"README.md ({section})", "exec"), {})  # noqa: S102
    out = capsys.readouterr().out
    assert out.strip(), "the examples print what they show"
