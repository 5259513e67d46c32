"""The README's Python examples run as printed (built-in model, CPU)."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


@pytest.mark.parametrize("section", ["Python API", "Sampling fields: logprobs, penalties, n, structured outputs", "Chat"])
def test_readme_python_examples_run(section, model_cache_dir, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(model_cache_dir.parent))  # the built-in model is generated once
    blocks = python_blocks(section)
    assert blocks, f"no python example under '## {section}'"
    from service import LLM
    from service.telemetry.log import configure_logging

    # The first LLM configures logging to the stderr of its moment: here the capture's, which closes
    # with this test while a later test's engine thread still logs to it. Log to the real one.
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", sys.__stderr__)
        configure_logging("console", "warning")
    for code in blocks:
        namespace: dict[str, object] = {}
        exec(compile(code, f"README.md ({section})", "exec"), namespace)  # noqa: S102
        for value in namespace.values():  # a script that leaves its LLM open (vLLM's quick start)
            if isinstance(value, LLM):
                value.close()
    out = capsys.readouterr().out
    assert out.strip(), "the examples print what they show"
