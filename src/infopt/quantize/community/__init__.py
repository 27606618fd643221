"""Community quantized checkpoints (GPTQ, AWQ GEMM, GGUF) loaded onto infopt's int4/int8 layers, no backend needed;
GGUF files written from a model (:func:`export_gguf`)."""

from .gguf_export import export_gguf
from .load import FORMATS, detect_format, load_quantized

__all__ = ["load_quantized", "export_gguf", "detect_format", "FORMATS"]
