import logging

import pytest
import structlog

from tests.support.process import ServerProcess
from tests.support.server import ServerThread


def _logging_restored():  # noqa: ANN202
    """Leaves structlog and the root logger as they were: an LLM or an in-process server configures
    logging (level, stream) for its process, and what runs after it captures logs
    (structlog.testing.capture_logs keeps the configured level) or prints under its own."""
    configured, saved, root = structlog.is_configured(), structlog.get_config(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    if configured:
        structlog.configure(**saved)
    else:  # unconfigured, as LLM checks (it configures logging only where nothing did)
        structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


# Per module (its module-scoped servers and LLMs configure logging) and per test.
_logging_as_before_the_module = pytest.fixture(autouse=True, scope="module")(_logging_restored)
_logging_as_before_the_test = pytest.fixture(autouse=True)(_logging_restored)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def server(model_cache_dir) -> ServerThread:  # noqa: ANN001
    """One real server with the built-in model for the integration tests that only read from it."""
    srv = ServerThread(["--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "16",
                        "--max-seq-len", "512", "--default-max-tokens", "32"]).start()
    yield srv
    srv.stop()


@pytest.fixture
def process_factory(tmp_path, model_cache_dir):  # noqa: ANN001, ANN201
    """Starts real `graphserve serve` processes (logs under tmp_path); kills what is left at the end."""
    started: list[ServerProcess] = []

    def start(*argv: str, env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(["--model-cache-dir", str(model_cache_dir), *argv], env=env,
                             log_path=tmp_path / f"server-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()
