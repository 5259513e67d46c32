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


@pytest.fixture(scope="module")
def loaded(model_cache_dir):  # noqa: ANN001, ANN201
    """The built-in tiny model and its tokenizer, as a CPU server loads them (float32)."""
    from service.model.builtin import ensure_builtin
    from service.model.loader import load_model

    ensure_builtin("tiny", model_cache_dir)
    return load_model("builtin:tiny", torch.device("cpu"), torch.float32, cache_dir=model_cache_dir)


@pytest.fixture(scope="module", params=["gqa-untied", "bias-tied"])
def random_llama(request: pytest.FixtureRequest):  # noqa: ANN201
    """A small random float32 model: GQA with an untied head, or q/k/v/o biases with a tied head."""
    from tests.unit.test_kernels import random_model, spec

    over = {} if request.param == "gqa-untied" else {"attention_bias": True, "tie_word_embeddings": True}
    return random_model(spec(**over))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):  # noqa: ANN001, ANN201
    """The built-in tiny model's tokenizer (768 ids, byte-level BPE), without its weights."""
    from transformers import AutoTokenizer

    from service.model.builtin import BUILTIN_SHAPES, write_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tokenizer(path, BUILTIN_SHAPES["tiny"])
    return AutoTokenizer.from_pretrained(str(path))
