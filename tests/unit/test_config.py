"""Flags and GRAPHSERVE_* variables become one validated config; a bad value names its flag."""

from __future__ import annotations

import pytest

from service.config import ConfigError, load_config


def test_command_line_wins_over_environment_and_secrets_are_redacted() -> None:
    config = load_config(["--port", "6000"], {"GRAPHSERVE_PORT": "7000", "GRAPHSERVE_MODEL": "builtin:tiny",
                                              "GRAPHSERVE_WARM_START": "false", "GRAPHSERVE_ADMIN_TOKEN": "s3cret"})
    assert config.port == 6000 and config.warm_start is False and config.admin_token == "s3cret"
    assert "s3cret" not in str(config.redacted())


def test_admin_token_file_is_read_and_an_empty_one_refused(tmp_path) -> None:  # noqa: ANN001
    token = tmp_path / "token"
    token.write_text("abc\n")
    assert load_config(["--admin-token-file", str(token)], {}).admin_token == "abc"
    token.write_text("\n")
    with pytest.raises(ConfigError, match="--admin-token-file"):
        load_config(["--admin-token-file", str(token)], {})


@pytest.mark.parametrize("argv, flag", [
    (["--graph-memory-budget", "lots"], "--graph-memory-budget"),
    (["--capture-sizes", "0,abc"], "--capture-sizes"),
    (["--capture-sizes", "64", "--max-running-seqs", "8"], "--capture-sizes"),  # none for a decode batch
    (["--capture-sizes", "8,4096", "--max-running-seqs", "8"], "--capture-sizes"),  # above the token budget
    (["--log-level", "loud"], "--log-level"),
    (["--max-running-seqs", "0"], "--max-running-seqs"),
    (["--port", "70000"], "--port"),
    (["--tls-cert", "/nonexistent.pem"], "--tls-cert"),
    (["--default-max-tokens", "5000"], "--default-max-tokens"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", "16", "--max-running-seqs", "32"], "--max-num-batched-tokens"),
    (["--quantization", "fp8", "--device", "cpu"], "--quantization fp8 needs an NVIDIA GPU"),
    (["--quantization", "fp8", "--batch-invariant"], "--quantization fp8"),
    (["--quantization", "fp8", "--device", "cuda", "--capture-sizes", "8,16"], "lacks 1, which --quantization fp8"),
    (["--stream-message-rate", "-1"], "--stream-message-rate"),
    (["--stream-message-rate", "inf"], "--stream-message-rate"),
    (["--kv-host-cache-memory", "0.5"], "--kv-host-cache-memory"),  # a fraction of what? bytes only
    (["--kv-host-cache-memory", "lots"], "--kv-host-cache-memory"),
    (["--kv-host-cache-memory", "1GiB", "--no-prefix-caching"], "--kv-host-cache-memory"),
    (["--kv-host-cache-memory", "1GiB", "--tensor-parallel-size", "2"], "--kv-host-cache-memory"),
])
def test_bad_values_fail_at_start_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        load_config(argv, {})


def test_pending_constraints_default_to_half_the_waiting_requests() -> None:
    """A request whose constraint compiles counts as waiting: by default compiles may hold half the queue."""
    assert load_config([], {}).max_pending_constraints == 128
    assert load_config(["--max-waiting-requests", "9"], {}).constraint_limits.max_pending_constraints == 4
    assert load_config(["--max-waiting-requests", "1"], {}).max_pending_constraints == 1
    assert load_config(["--max-pending-constraints", "7"], {"GRAPHSERVE_MAX_WAITING_REQUESTS": "100"}
                       ).max_pending_constraints == 7
    with pytest.raises(ConfigError, match="--max-pending-constraints"):
        load_config(["--max-pending-constraints", "0"], {})


def test_step_token_budget_default_and_its_deprecated_name() -> None:
    assert load_config([], {}).max_num_batched_tokens == 2048
    assert load_config(["--max-num-batched-tokens", "512"], {}).max_num_batched_tokens == 512
    old = load_config(["--max-prefill-tokens", "300"], {})
    assert old.max_num_batched_tokens == old.max_prefill_tokens == 300
    assert load_config([], {"GRAPHSERVE_MAX_PREFILL_TOKENS": "400"}).max_num_batched_tokens == 400
    assert load_config([], {"GRAPHSERVE_MAX_NUM_BATCHED_TOKENS": "64"}).max_num_batched_tokens == 64
