"""Memory estimator (``infopt memory``): weights, KV cache and activations of a causal LM, from its config alone."""

from .arch import (
    KNOWN_CONFIGS,
    ArchSpec,
    MemoryInputError,
    Projection,
    arch_spec,
    load_known_config,
    resolve_config,
)
from .estimate import DTYPE_BITS, GPUS, GpuFit, MemoryEstimate, estimate_memory

__all__ = [
    "estimate_memory",
    "MemoryEstimate",
    "GpuFit",
    "GPUS",
    "DTYPE_BITS",
    "KNOWN_CONFIGS",
    "ArchSpec",
    "Projection",
    "MemoryInputError",
    "arch_spec",
    "load_known_config",
    "resolve_config",
]
