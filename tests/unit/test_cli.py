"""The command line a vLLM user types works: vLLM's flag names where the meaning is the same, a
positional model, --version, and a --help where every flag says what it does and its default once."""

from __future__ import annotations

import argparse

import pytest

from service.cli import main
from service.client import build_parser as generate_parser
from service.config import ConfigError, build_parser, load_config, version


def flag_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help text in the parser's --help, as printed."""
    entries = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of its actions
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):  # noqa: SLF001
            continue
        help_text = parser._get_formatter()._expand_help(action)  # noqa: SLF001 - the help as printed
        entries[", ".join(action.option_strings) or action.metavar] = help_text
    return entries


@pytest.mark.parametrize("parser, least", [(build_parser, 60), (generate_parser, 12)], ids=["serve", "generate"])
def test_every_flag_has_help_and_shows_its_default_once(parser, least: int) -> None:  # noqa: ANN001
    entries = flag_helps(parser())
    assert len(entries) >= least
    for flag, text in entries.items():
        assert text.strip(), f"{flag} has no help text"
        assert text.count("default") <= 1, f"{flag} names its default twice: {text}"


def test_vllm_flag_names_and_a_positional_model() -> None:
    config = load_config(["builtin:tiny", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
                          "--no-enable-prefix-caching", "-tp", "1", "--max-num-batched-tokens", "256"], {})
    assert (config.model, config.max_seq_len, config.max_running_seqs) == ("builtin:tiny", 1024, 4)
    assert config.cudagraph_mode == "none" and config.prefix_caching is False
    assert load_config(["--device", "cpu", "/models/x", "--port", "1"], {}).model == "/models/x"  # anywhere in the line
    assert load_config(["/models/y"], {"GRAPHSERVE_MODEL": "/models/x"}).model == "/models/y"  # the command line wins
    environment = load_config([], {"GRAPHSERVE_ENFORCE_EAGER": "true", "GRAPHSERVE_ENABLE_PREFIX_CACHING": "false",
                                   "GRAPHSERVE_MAX_MODEL_LEN": "512"})
    assert (environment.cudagraph_mode, environment.prefix_caching, environment.max_seq_len) == ("none", False, 512)
    with pytest.raises(ConfigError, match="given twice"):
        load_config(["/models/x", "--model", "/models/y"], {})


def test_a_vllm_flag_without_an_equal_is_refused_saying_what_to_use(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(["--gpu-memory-utilization", "0.9"], {})
    assert info.value.code == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_version_and_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
        assert capsys.readouterr().out.strip() == f"graphserve {version()}"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and all(command in out for command in ("serve", "generate", "gateway"))
    assert "--max-seq-len" not in out, "the top-level help lists the commands, not serve's flags"
    assert main([]) == 2
