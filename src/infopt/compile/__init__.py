"""Compiled decoding (recipe stage ``compile``): the one-token decode step compiled over the static KV cache."""

from .decoder import CompiledForward, CompiledForwards, CompileStats, compile_stats, token_bucket
from .step import Compile, compile_, warmup

__all__ = ["Compile", "compile_", "warmup", "compile_stats", "CompileStats", "CompiledForwards", "CompiledForward", "token_bucket"]
