"""Community quantized checkpoints (GPTQ, AWQ GEMM, GGUF) loaded onto infopt's int4/int8 layers, no backend needed."""

from .load import FORMATS, detect_format, load_quantized

__all__ = ["load_quantized", "detect_format", "FORMATS"]
