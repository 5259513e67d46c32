"""Start-up checks: a port in use or given twice, a model directory that cannot be one, each one line
naming the flag, found before anything starts."""

from __future__ import annotations

import json
import socket

from service.config import load_config
from service.preflight import check_serve, model_file_problem, port_problems


def test_ports_in_use_or_given_twice() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        problems = port_problems([("--port", "127.0.0.1", port), ("--metrics-port", "127.0.0.1", 0),
                                  ("--admin-port", "127.0.0.1", port)])
    assert problems == [f"--port: 127.0.0.1:{port} is in use (another graphserve?); pick another port with --port",
                        f"--admin-port {port} is also --port: give each a port of its own"]
    assert port_problems([("--port", "127.0.0.1", port)]) == []  # free again once closed


def test_model_directories_that_cannot_be_one(tmp_path) -> None:  # noqa: ANN001
    assert "no such directory" in model_file_problem(str(tmp_path / "absent"))
    assert "no config.json" in model_file_problem(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    assert "not JSON" in model_file_problem(str(tmp_path))
    assert model_file_problem("builtin:tiny") is None


def test_an_unsupported_architecture_and_an_unknown_builtin_name(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    [problem] = check_serve(load_config(["--model", str(tmp_path), "--port", "0", "--metrics-port", "0"], {}))
    assert problem.startswith(f"--model {tmp_path}: unsupported architecture 'GPT2LMHeadModel'")
    [problem] = check_serve(load_config(["--model", "builtin:huge", "--port", "0", "--metrics-port", "0"], {}))
    assert "unknown builtin model 'huge'" in problem
