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


@pytest.fixture(scope="module", params=["gqa-untied", "bias-tied"])
def random_llama(request: pytest.FixtureRequest):  # noqa: ANN201
    """A small random float32 model: GQA with an untied head, or q/k/v/o biases with a tied head."""
    from tests.unit.test_kernels import random_model, spec

    over = {} if request.param == "gqa-untied" else {"attention_bias": True, "tie_word_embeddings": True}
    return random_model(spec(**over))
