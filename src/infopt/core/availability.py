"""Optional-backend discovery: find packages without importing them, import lazily with a clear error."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from .errors import MissingBackendError

__all__ = ["Backend", "BACKENDS", "is_available", "require", "lazy_import", "cuda_available", "fast_bf16_gemm"]


@dataclass(frozen=True)
class Backend:
    """An optional package infopt can use.

    Attributes:
        module: the import name (``bitsandbytes``).
        extra: the ``infopt[...]`` extra that installs it.
        purpose: what infopt uses it for, shown in error messages.
    """

    module: str
    extra: str
    purpose: str


BACKENDS: dict[str, Backend] = {
    b.module: b
    for b in (
        Backend("bitsandbytes", "bnb", "bitsandbytes int8/nf4 quantization"),
        Backend("flash_attn", "flash", "the flash_attention_2 attention backend"),
        Backend("gptqmodel", "gptq", "loading GPTQ checkpoints made by gptqmodel"),
        Backend("awq", "awq", "loading AWQ checkpoints made by autoawq"),
        Backend("gguf", "gguf", "reading GGUF files (the embedded default model)"),
        Backend("matplotlib", "bench", "benchmark charts"),
    )
}


def is_available(module: str) -> bool:
    """Return True when ``module`` can be imported, without importing it.

    Example:
        >>> is_available("json")
        True
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _install_hint(module: str) -> str:
    backend = BACKENDS.get(module)
    if backend is None:
        return f"pip install {module}"
    return f"pip install 'infopt[{backend.extra}]'"


def require(module: str, *, feature: str | None = None) -> None:
    """Raise :class:`MissingBackendError` when ``module`` is not installed.

    Args:
        module: import name of the backend.
        feature: what the caller wanted to do, for the message.

    Raises:
        MissingBackendError: naming the extra to install.
    """
    if is_available(module):
        return
    backend = BACKENDS.get(module)
    what = feature or (backend.purpose if backend else module)
    raise MissingBackendError(
        f"{what} needs the optional package '{module}', which is not installed. "
        f"Fix: {_install_hint(module)}",
        package=module,
        extra=backend.extra if backend else None,
    )


def lazy_import(module: str, *, feature: str | None = None) -> ModuleType:
    """Import an optional backend at the point of use.

    Import errors other than "not installed" propagate unchanged: a broken install is never
    turned into a silent fallback.

    Example:
        >>> lazy_import("json").dumps([1])
        '[1]'
    """
    require(module, feature=feature)
    return importlib.import_module(module)


def cuda_available() -> bool:
    """True when torch sees a CUDA device. Imports torch, never initializes a CUDA context itself."""
    return torch.cuda.is_available()


def fast_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX), so that a bf16 GEMM beats fp32;
    elsewhere bf16 GEMMs are emulated and slower than fp32 ones."""
    cpu = getattr(torch, "cpu", None)
    probes = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(p() for p in probes if p is not None)
