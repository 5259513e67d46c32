import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """For files of tiny matmuls: they gain nothing from threads, and on a busy shared CPU spinning
    OpenMP threads made such files several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
