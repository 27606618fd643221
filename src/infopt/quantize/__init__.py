"""Weight quantization (recipe stage ``quantize``): swap linear layers for quantized ones, in place."""

from .api import QUANTIZERS, quantize_
from .int8 import Int8Linear, Int8WeightOnly

__all__ = ["quantize_", "QUANTIZERS", "Int8WeightOnly", "Int8Linear"]
