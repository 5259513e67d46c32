import pytest

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
