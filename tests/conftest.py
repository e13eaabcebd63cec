import os

import torch

if not torch.cuda.is_available():
    # CPU machines (CI): Triton kernels run in the interpreter on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("sparse_fx", deadline=None, max_examples=25, derandomize=False, print_blob=True)
settings.load_profile("sparse_fx")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the offline SmolLM2-135M-Instruct, loaded once for the whole test run."""
    from sparse_fx.offline.models import load_model

    return load_model()
