import pytest

from tests.support.process import ServerProcess
from tests.support.server import ServerThread


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
