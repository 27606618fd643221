"""Compiled decoding (recipe stage ``compile``): the one-token decode step compiled over the static KV cache."""

from .decoder import CompiledDecoder, CompileStats, compile_stats
from .step import Compile, compile_, warmup

__all__ = ["Compile", "compile_", "warmup", "compile_stats", "CompileStats", "CompiledDecoder"]
