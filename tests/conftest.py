"""Shared fixtures: tiny random models (unit tier), the embedded default model (real_model tier) and the device a
test body runs on (``device``: cpu, and cuda marked ``gpu``; see tests/devices.py)."""

from __future__ import annotations

import pytest
import torch

from infopt.models import tiny_model
from infopt.testing.plugin import GPU_SKIP_REASON
from tests import devices

UNIT_ARCHS = ("llama", "qwen2", "gemma", "gpt2")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the rule sees every collected test
def pytest_collection_modifyitems(config, items):
    # every gpu test is the cuda parameter of a body CPU CI also runs, or sits on devices.CUDA_ONLY with a reason
    devices.check_gpu_tests(items, devices.CUDA_ONLY, args=config.args)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=devices.device_params())
def device(request) -> str:
    """The device a test body runs on: ``"cpu"``, and ``"cuda"`` (marked ``gpu``: skipped without CUDA). What the
    body expects to differ between them is ``devices.DEVICES[device]``."""
    return request.param


@pytest.fixture(params=UNIT_ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def prompt():
    return torch.tensor([[1, 17, 400, 23, 9, 1200, 5]])


@pytest.fixture(scope="session")
def default_tokenizer():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def default_model():
    from infopt.models import load_default

    return load_default()


def state_snapshot(model):
    """A deep copy of the state dict, for 'unchanged' checks."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_equal(model, snap):
    now = model.state_dict()
    assert set(now) == set(snap)
    for k, v in snap.items():
        assert torch.equal(now[k], v), k


@pytest.fixture(autouse=True)
def _fresh_calibration_cache():
    """Each test calibrates for itself: the process-wide calibration cache starts empty."""
    from infopt.quantize.calibration.cache import CACHE

    CACHE.clear()
    yield
    CACHE.clear()
