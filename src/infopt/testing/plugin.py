"""The ``infopt`` pytest plugin: golden-file fixtures, device parametrization and markers for CI.

Registered through the ``pytest11`` entry point, so it is active wherever infopt is installed
(disable with ``-p no:infopt``). See docs/testing.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from .golden import GoldenStore, environment_record, sanitize_test_id, seed_everything

__all__ = ["pytest_addoption", "pytest_configure", "pytest_generate_tests", "pytest_collection_modifyitems",
           "infopt_device", "infopt_golden", "infopt_deterministic", "MARKERS", "GPU_SKIP_REASON"]

MARKERS = (
    "gpu: needs a CUDA device (skipped without one)",
    "slow: takes more than a few seconds",
    "real_model: uses the embedded default model (SmolLM2-135M-Instruct)",
)
GPU_SKIP_REASON = "needs a CUDA device; none is visible"


def pytest_addoption(parser):
    group = parser.getgroup("infopt", "infopt regression testing (infopt.testing)")
    group.addoption("--infopt-update-golden", action="store_true", default=False,
                    help="record (overwrite) golden files instead of comparing against them")
    group.addoption("--infopt-golden-dir", default=None, metavar="DIR",
                    help="golden directory (default: tests/golden under the rootdir); relative to the rootdir")
    group.addoption("--infopt-strict-env", action="store_true", default=False,
                    help="fail when a golden was recorded with other versions / device / dtype / threads (else warn)")
    group.addoption("--infopt-device", default=None, metavar="DEVICE",
                    help="run infopt_device tests on this device only (cpu, cuda, cuda:1)")
    group.addoption("--infopt-bench", action="store_true", default=False,
                    help="enable assert_no_regression benchmark checks (skipped otherwise)")
    group.addoption("--infopt-threads", type=int, default=1, metavar="N",
                    help="torch CPU threads set by infopt_deterministic (default 1; recorded in goldens)")


def pytest_configure(config):
    for line in MARKERS:  # the same lines as infopt's own pyproject; duplicates are harmless
        config.addinivalue_line("markers", line)
    # cuBLAS needs this before its first use to be deterministic (use_deterministic_algorithms)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _devices(config) -> list[str]:
    chosen = config.getoption("infopt_device")
    if chosen:
        return [str(torch.device(chosen))]
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def pytest_generate_tests(metafunc):
    if "infopt_device" not in metafunc.fixturenames:
        return
    params = [pytest.param(d, id=d.replace(":", ""), marks=[pytest.mark.gpu] if d.startswith("cuda") else [])
              for d in _devices(metafunc.config)]
    metafunc.parametrize("infopt_device", params, indirect=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        # a conftest (infopt's own) may already add the same skip; add it once
        if "gpu" in item.keywords and not any(m.kwargs.get("reason") == GPU_SKIP_REASON
                                              for m in item.iter_markers("skip")):
            item.add_marker(skip)


@pytest.fixture
def infopt_device(request) -> str:
    """The device under test: ``"cpu"`` and each visible CUDA device (``--infopt-device`` picks one).

    CUDA parameters carry the ``gpu`` marker, so ``pytest -m gpu`` selects them and they skip on CPU-only
    machines.
    """
    device = getattr(request, "param", None) or _devices(request.config)[0]
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(GPU_SKIP_REASON)
    return device


@pytest.fixture
def infopt_deterministic(request):
    """Seed ``random``/NumPy/torch with 0, turn on deterministic algorithms (warn only) and fix the thread count.

    Restores the previous threads / deterministic setting afterwards.

    Returns:
        The environment record (:func:`infopt.testing.golden.environment_record`) goldens are written with:
        torch / transformers / infopt versions, device and its name, dtype, threads.
    """
    threads = torch.get_num_threads()
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(request.config.getoption("infopt_threads"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(0)
    device = request.getfixturevalue("infopt_device") if "infopt_device" in request.fixturenames else "cpu"
    try:
        yield environment_record(device)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)


@pytest.fixture
def infopt_golden(request, infopt_deterministic) -> GoldenStore:
    """The :class:`GoldenStore` of the current test: ``<golden-dir>/<sanitized node id>.safetensors/.json``.

    The golden directory is ``tests/golden`` under the rootdir unless ``--infopt-golden-dir`` says otherwise.
    Depends on :func:`infopt_deterministic`, whose environment record is written into each golden.
    """
    config = request.config
    root = Path(config.rootpath)
    directory = root / (config.getoption("infopt_golden_dir") or os.path.join("tests", "golden"))
    return GoldenStore(directory, sanitize_test_id(request.node.nodeid),
                       update=config.getoption("infopt_update_golden"),
                       strict_env=config.getoption("infopt_strict_env"),
                       env=infopt_deterministic, bench=config.getoption("infopt_bench"))
