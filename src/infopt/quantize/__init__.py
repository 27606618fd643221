"""Weight quantization (recipe stage ``quantize``): swap linear layers for quantized ones, in place."""

from .api import CALIBRATED, QUANTIZERS, quantize_, register_calibrated, register_quantizer
from .int4 import Int4Linear, Int4WeightOnly
from .int8 import Int8Linear, Int8WeightOnly

__all__ = ["quantize_", "QUANTIZERS", "CALIBRATED", "register_quantizer", "register_calibrated", "Int8WeightOnly",
           "Int8Linear", "Int4WeightOnly", "Int4Linear"]
