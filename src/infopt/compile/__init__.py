"""Compiled decoding (recipe stage ``compile``): the decode and verify steps compiled over the static KV cache, and
the batching engine's packed step (:func:`engine_forward`)."""

from .decoder import CompiledForward, CompiledForwards, CompileStats, compile_stats, token_bucket
from .step import Compile, compile_, engine_forward, warmup

__all__ = ["Compile", "compile_", "engine_forward", "warmup", "compile_stats", "CompileStats", "CompiledForwards", "CompiledForward", "token_bucket"]
