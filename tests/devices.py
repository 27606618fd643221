"""The devices the test suite runs on: one table of what differs between CPU and CUDA, the ``device`` fixture's
parameters, and the collection rule that keeps every GPU test paired with a CPU run of the same body.

A GPU test is the ``cuda`` parameter of a body that also runs on ``cpu``, so CPU CI runs every assertion the GPU
lane makes (a pinned private detail, a wrong reference, a stale count fails here first). What legitimately differs
between the two runs (a layout's name, the kernel that serves a call, a tolerance, the process-group backend) is a
field of :data:`DEVICES`, read by the body, never an ``if device == "cuda"`` inside it. A test with no CPU meaning
(CUDA graphs, NCCL, flash-attn, a Triton kernel with no CPU path) sits on :data:`CUDA_ONLY` with its reason.
See docs/testing.md ("The device fixture and the GPU rule").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

__all__ = ["Device", "DEVICES", "DEVICE_PARAM", "CUDA_ONLY", "INT4_KERNELS", "count_calls", "device_params",
           "unpaired_gpu_tests", "check_gpu_tests"]

DEVICE_PARAM = "device"
"""The parameter name that says which device a test body runs on (the fixture's, or a ``parametrize`` column)."""


@dataclass(frozen=True)
class Device:
    """What a test body expects on one device type, where CPU and CUDA legitimately differ.

    Attributes:
        name: ``"cpu"`` or ``"cuda"``: what ``tensor.device.type`` reads there.
        int4_layout: the layout an ``Int4Linear`` takes there on its own (``infopt.quantize.formats.int4.layout_for``).
        int4_op: the ``torch`` function that layout calls, counted by tests that want the kernel to have run.
        triton: the key of ``infopt.ops.triton_gemv.kernel_calls()`` and ``triton_int8.kernel_calls()`` that
            counts their ops there: ``"triton"`` (the kernel) on CUDA, ``"reference"`` (the pure-torch oracle) on CPU.
        int8_mm_layer_calls: ``triton_int8.int8_weight_mm`` calls per ``Int8Linear`` forward (per-channel scales,
            float activations): one on CUDA (the Triton op); none on CPU (fp32: the C++ int8 kernel; bf16: a
            dequantized ``F.linear``).
        fp8_kernel: ``FP8Linear.last_kernel`` with ``kernel="auto"`` and fp8 activations (``torch._scaled_mm`` needs
            CUDA with compute capability 8.9+; elsewhere the pure-torch reference).
        paged_kernel: the ``infopt.attention.paged.kernel_calls()`` key of the device's own paged-attention kernel:
            ``"flash_attn"`` or ``"cpu"`` (the C++ kernel); see :meth:`paged_kernel_for` for where it applies.
        dist_backend: the ``torch.distributed`` backend of one process on this device.
        decode_compile_mode: the ``Compile`` mode of the device's fast decode path (``reduce-overhead``: CUDA graphs,
            which CPU has not; CPU's fast path is inductor's default mode).
        min_copy_gbs: a floor under ``infopt.bench.measure_bandwidth`` there (HBM clears 200 GB/s; host memory is
            read at a few GB/s to tens, so the CPU floor only says the figure is a positive rate).
        w8a8_decode_rows: rows of a one-token ``torch._int_mm`` call (cuBLAS takes more than 16: CUDA pads to 17).
        fast_preset: the preset that decodes fastest there (``gpu-fast``: CUDA graphs; ``cpu-fast``: int4 weights and
            an inductor step).
        peak_memory: the peak-memory figure ``infopt bench`` reports for a side's run there (``peak_gpu_mb``:
            ``torch.cuda.max_memory_allocated``; ``peak_rss_mb``: the process's resident set).
        copy_label: how ``infopt.bench.format_table`` names the measured copy bandwidth there.
        engine_graphs: ``(Engine's cuda_graphs argument, the backend its metrics then name)`` for the batching
            engine's graph decode steps (``infopt.batching.graphs``): ``(True, "cuda")``; a CPU has no graphs, so
            ``("replay", "replay")``: the same buffers, padding and buckets, the forward called again.
    """

    name: str
    int4_layout: str
    int4_op: str
    triton: str
    int8_mm_layer_calls: int
    fp8_kernel: str
    paged_kernel: str
    dist_backend: str
    decode_compile_mode: str
    min_copy_gbs: float
    w8a8_decode_rows: int
    fast_preset: str
    peak_memory: str
    copy_label: str
    engine_graphs: tuple[bool | str, str]

    def gpu(self) -> tuple[str | None, str | None]:
        """``(GPU name, CUDA runtime)`` that ``infopt.bench.machine_info`` records for a run here: the current CUDA
        device's name and ``torch.version.cuda``; ``(None, None)`` on CPU."""
        import torch

        if self.name != "cuda":
            return None, None
        return torch.cuda.get_device_name(), torch.version.cuda

    def fp8_weights(self) -> bool:
        """Whether fp8 (e4m3) weights go through ``w8_gemv`` here: on CPU its reference always; on CUDA the Triton
        kernel from compute capability 8.9."""
        import torch

        if self.name != "cuda":
            return hasattr(torch, "float8_e4m3fn")
        return hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9)

    def fp8_matmul(self) -> tuple[bool, str]:
        """Whether a model's fp8 layers run their kernel of :attr:`fp8_kernel` here, and why not: on CPU always (the
        pure-torch reference); on CUDA where ``infopt.quantize.formats.fp8.fp8_supported`` allows ``torch._scaled_mm``."""
        from infopt.quantize.formats.fp8 import fp8_supported

        return (True, "") if self.fp8_kernel == "reference" else fp8_supported(self.name)

    def paged_kernel_for(self, block_size: int) -> str:
        """The ``infopt.attention.paged.kernel_calls()`` key a paged cache of ``block_size`` tokens per block runs
        here: :attr:`paged_kernel` where it applies (flash-attn installed and blocks a multiple of 256 tokens on CUDA;
        the C++ kernel built on CPU), else ``"reference"`` (the torch gather + SDPA)."""
        from infopt.attention.paged import FLASH_PAGE_MULTIPLE
        from infopt.core.availability import is_available
        from infopt.ops import cpp

        if self.paged_kernel == "flash_attn":
            ok = block_size % FLASH_PAGE_MULTIPLE == 0 and is_available("flash_attn")
        else:
            ok = cpp.load("paged_attention")
        return self.paged_kernel if ok else "reference"

    def w8a8_kernel(self) -> str:
        """``W8A8Linear.last_kernel`` with ``kernel="auto"``: ``"int_mm"`` where ``torch._int_mm`` serves (cuBLAS on
        CUDA; oneDNN on an AVX-512 CPU with torch >= 2.6), else ``"float"`` (the same integers in an fp32 matmul)."""
        import torch

        from infopt.quantize.formats.w8a8 import int_mm_supported

        return "int_mm" if int_mm_supported(torch.device(self.name), 32, 64, 64)[0] else "float"

    def w8a8_int_mm_calls(self) -> int:
        """``torch._int_mm`` calls from Python per fp32 ``W8A8Linear`` forward: one on CUDA; none on CPU where the
        float path or the C++ op (which quantizes and calls ``_int_mm`` inside) serves, else one."""
        from infopt.quantize.formats import a8

        if self.w8a8_kernel() != "int_mm":
            return 0
        return 0 if self.name == "cpu" and a8.available() else 1

    def int4_auto_layout(self) -> str:
        """The layout of an int4 layer whose config leaves ``activations="auto"`` (a ``SelfDraft(quantize="int4")``
        draft): ``a8`` (int8 activations, the C++ kernel) on a CPU whose kernels were built for AVX512-VNNI or AVX2,
        else :attr:`int4_layout`."""
        from infopt.quantize.formats import a8

        return "a8" if a8.resolve("auto", self.name) == "int8" else self.int4_layout


DEVICES: dict[str, Device] = {
    "cpu": Device(
        name="cpu", int4_layout="cpu_int4pack", int4_op="_weight_int4pack_mm_for_cpu", triton="reference",
        int8_mm_layer_calls=0, fp8_kernel="reference", paged_kernel="cpu", dist_backend="gloo",
        decode_compile_mode="default", min_copy_gbs=0.1, w8a8_decode_rows=1, fast_preset="cpu-fast",
        peak_memory="peak_rss_mb", copy_label="measured copy bandwidth", engine_graphs=("replay", "replay")),
    "cuda": Device(
        name="cuda", int4_layout="cuda_tinygemm", int4_op="_weight_int4pack_mm", triton="triton",
        int8_mm_layer_calls=1, fp8_kernel="scaled_mm", paged_kernel="flash_attn", dist_backend="nccl",
        decode_compile_mode="reduce-overhead", min_copy_gbs=200.0, w8a8_decode_rows=17, fast_preset="gpu-fast",
        peak_memory="peak_gpu_mb", copy_label="measured device-to-device copy bandwidth", engine_graphs=(True, "cuda")),
}


INT4_KERNELS: dict[str, tuple[str, str]] = {
    "cuda_tinygemm": ("torch", "_weight_int4pack_mm"),
    "cpu_int4pack": ("torch", "_weight_int4pack_mm_for_cpu"),
    "a8": ("infopt.quantize.formats.a8", "int4_a8_linear"),
}
"""An ``Int4Linear`` layout -> the ``(module, function)`` its decode rows call, for :func:`count_calls`."""


def count_calls(monkeypatch, module: str, name: str) -> list[tuple[int, ...]]:
    """Wrap ``module.name`` (e.g. ``("torch", "_int_mm")``) so each call records its first operand's shape.

    Args:
        monkeypatch: pytest's fixture (the wrapper is removed after the test).
        module: the importable module that owns the function, as the code under test looks it up.
        name: the function's name there.

    Returns:
        The list the calls are appended to.

    Example:
        >>> import pytest, torch
        >>> mp = pytest.MonkeyPatch()
        >>> calls = count_calls(mp, "torch", "mm")
        >>> _ = torch.mm(torch.ones(2, 3), torch.ones(3, 4)); mp.undo()
        >>> calls
        [(2, 3)]
    """
    import importlib

    owner = importlib.import_module(module)
    real = getattr(owner, name)

    def wrapper(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(owner, name, wrapper)
    return calls


def device_params() -> list:
    """The ``device`` fixture's parameters: ``"cpu"`` always, ``"cuda"`` carrying the ``gpu`` marker (so
    ``pytest -m gpu`` selects it, and it is skipped where no CUDA device is visible), as the infopt pytest plugin's
    ``infopt_device`` does for users.

    Returns:
        ``[pytest.param("cpu"), pytest.param("cuda", marks=gpu)]``.

    Example:
        >>> [p.id for p in device_params()]
        ['cpu', 'cuda']
    """
    return [pytest.param(name, id=name, marks=[pytest.mark.gpu] if name == "cuda" else []) for name in DEVICES]


# Tests with no CPU meaning: node ids (or a function's id, every parameter) -> why. Each reason names the CUDA-only
# thing and, where there is one, the CPU test that holds the same claim for the CPU path.
CUDA_ONLY: dict[str, str] = {
    "tests/attention/test_backends.py::test_flash_attention_on_cuda":
        "flash-attn's kernels exist on CUDA only (the CPU backends' greedy identity: test_eager_and_sdpa_same_greedy_"
        "tokens)",
    "tests/attention/test_backends.py::test_flex_same_greedy_tokens_on_cuda":
        "flex attention is refused on CPU (Inductor's C++ flex kernel reads past the keys on some decode shapes); the "
        "refusal: test_flex_refused_on_cpu_untouched",
    "tests/compile/test_compile.py::test_gpu_fast_preset_replays_cuda_graphs":
        "counts CUDA graph replays (cudaGraphLaunch); the compiled step's identity on each device: test_fast_mode_"
        "token_identical_on_the_device",
    "tests/compile/test_compile.py::test_gpu_fast_default_model_fp32_token_identical":
        "the gpu-fast preset (CUDA graphs) on the default model; CPU presets are refused nothing and run in "
        "tests/test_presets_families.py",
    "tests/compile/test_compile.py::test_gpu_fast_default_model_bf16_decode_within_transformers_own_rounding":
        "the gpu-fast preset (CUDA graphs) on the default model in bf16",
    "tests/compile/test_fuse.py::test_gpu_fast_fused_step_runs_fewer_kernels_same_tokens":
        "counts CUDA kernel launches per decode token under CUDA graphs; the fused step's numerics and storage on CPU: "
        "the other tests of test_fuse.py",
    "tests/quantize/test_calibrated_devices.py::test_int4_calibrated_on_cpu_then_moved_repacks_for_cuda":
        "moves a CPU-calibrated model onto CUDA (two device types); each device's own packing and kernel: "
        "test_int4_calibrated_on_the_device_runs_its_int4_kernel",
    "tests/quantize/test_calibrated_devices.py::test_smoothquant_w8a8_calibrated_on_cpu_then_moved_to_cuda":
        "moves a CPU-calibrated model onto CUDA (two device types); each device's own kernel: "
        "test_smoothquant_w8a8_calibrated_on_the_device_runs_its_kernel",
    "tests/quantize/test_int4.py::test_int4_quantized_on_cpu_then_moved_runs_the_cuda_kernel":
        "moves a CPU-quantized model onto CUDA (two device types); each device's own kernel: "
        "test_int4_kernel_runs_and_matches",
    "tests/quantize/test_triton_gemv.py::test_kernels_replay_in_a_cuda_graph":
        "CUDA graph capture and replay of the Triton GEMV kernels",
    "tests/test_presets_families.py::test_cuda_preset_on_family":
        "gpu-fast is a CUDA-only preset (CUDA graphs): on CPU it is refused (test_cuda_preset_refused_on_cpu_model_"
        "untouched) and the CPU presets run on every family (test_preset_on_family)",
}


def _is_cuda(value) -> bool:
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def _function_id(item) -> str:
    return item.nodeid.split("[", 1)[0]


def _named_explicitly(item, args: Iterable[str]) -> bool:
    """Whether the command line named this test itself (``file.py::test[cuda]``), so its CPU twin was not collected
    by choice; the full run checks the pair."""
    path = str(item.path)
    name = _function_id(item).split("::", 1)[-1]
    for arg in args:
        if "::" not in arg:
            continue
        file, rest = arg.split("::", 1)
        if path.endswith(file.replace("\\", "/").lstrip("./")) and rest.split("[", 1)[0] == name:
            return True
    return False


def unpaired_gpu_tests(items: Iterable, allowlist: Mapping[str, str] | None = None, *,
                       args: Iterable[str] = ()) -> list[str]:
    """The node ids of ``gpu``-marked tests that break the rule: each must be the CUDA parameter of a test whose CPU
    parameter was collected too (the same function and the same other parameters, ``device="cpu"``), or be listed
    in ``allowlist`` (a node id, or a function's id for all its parameters) with a reason.

    Args:
        items: the collected test items.
        allowlist: node id or function id -> reason (default :data:`CUDA_ONLY`).
        args: the command line's paths; a test named there by its own node id is not held to a twin that was not
            collected by choice.

    Returns:
        Sorted node ids; empty when every GPU test is paired or allowlisted.

    Raises:
        ValueError: an allowlist entry without a reason.

    Example:
        >>> unpaired_gpu_tests([])
        []
    """
    allowlist = CUDA_ONLY if allowlist is None else allowlist
    for key, reason in allowlist.items():
        if not (isinstance(reason, str) and reason.strip()):
            raise ValueError(f"CUDA_ONLY[{key!r}] has no reason; say why the test has no CPU meaning")
    items = list(items)
    args = list(args)
    cpu_runs: dict[str, list[dict]] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get(DEVICE_PARAM) == "cpu":
            cpu_runs.setdefault(_function_id(item), []).append(
                {k: v for k, v in params.items() if k != DEVICE_PARAM})
    bad = []
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if item.nodeid in allowlist or _function_id(item) in allowlist:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _is_cuda(params.get(DEVICE_PARAM)):
            others = {k: v for k, v in params.items() if k != DEVICE_PARAM}
            if any(_same(others, twin) for twin in cpu_runs.get(_function_id(item), ())):
                continue
            if _named_explicitly(item, args):
                continue
        bad.append(item.nodeid)
    return sorted(bad)


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        try:
            if v is b[k] or v == b[k]:
                continue
        except Exception:  # a value whose == is not a bool (a tensor): compare what the test id shows
            pass
        if repr(v) != repr(b[k]):
            return False
    return True


def check_gpu_tests(items: Iterable, allowlist: Mapping[str, str] | None = None, *, args: Iterable[str] = ()) -> None:
    """Fail the collection when a ``gpu``-marked test breaks the rule of :func:`unpaired_gpu_tests`.

    Args:
        items: the collected test items.
        allowlist: node id or function id -> reason (default :data:`CUDA_ONLY`).
        args: the command line's paths (see :func:`unpaired_gpu_tests`).

    Raises:
        pytest.UsageError: naming each test and the two ways to fix it.

    Example:
        >>> check_gpu_tests([])  # nothing collected, nothing to pair
    """
    bad = unpaired_gpu_tests(items, allowlist, args=args)
    if not bad:
        return
    listing = "\n".join(f"  {nodeid}" for nodeid in bad)
    raise pytest.UsageError(
        f"{len(bad)} gpu-marked test(s) without a CPU run of the same body:\n{listing}\n"
        f"Fix each one of two ways: (1) take the `{DEVICE_PARAM}` fixture (tests/conftest.py: 'cpu' and 'cuda', "
        f"the latter marked gpu) instead of @pytest.mark.gpu, so CPU CI runs the same assertions, with what differs "
        f"by device read from tests/devices.py DEVICES; or (2) if the test has no CPU meaning (CUDA graphs, NCCL, "
        f"flash-attn, a Triton kernel with no CPU path), add its node id to tests/devices.py CUDA_ONLY with the "
        f"reason.")
