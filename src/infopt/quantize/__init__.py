"""Weight quantization (recipe stage ``quantize``): swap linear layers for quantized ones, in place."""

import importlib

from ..core.import_hooks import after_import
from .algorithms.awq import AWQ
from .algorithms.gptq import GPTQ
from .algorithms.qat import QAT, QATLinear, convert_qat_, prepare_qat_, qat_param_groups
from .algorithms.smoothquant import SmoothQuantW8A8, smooth_
from .api import CALIBRATED, QUANTIZERS, quantize_, register_calibrated, register_quantizer
from .experts import QuantizedExperts
from .formats.bnb import BnbInt8, BnbNF4
from .formats.fp8 import FP8, FP8Linear
from .formats.int4 import Int4Linear, Int4WeightOnly
from .formats.int8 import Int8Linear, Int8WeightOnly
from .formats.w8a8 import W8A8Linear
from .serialization.serialize import quantization_config_for

__all__ = ["quantize_", "QUANTIZERS", "CALIBRATED", "register_quantizer", "register_calibrated", "Int8WeightOnly",
           "Int8Linear", "Int4WeightOnly", "Int4Linear", "QuantizedExperts",
           "GPTQ", "AWQ", "QAT", "QATLinear", "prepare_qat_", "convert_qat_", "qat_param_groups",
           "SmoothQuantW8A8", "W8A8Linear", "smooth_", "BnbInt8", "BnbNF4", "FP8", "FP8Linear",
           "quantization_config_for"]


def _register_with_transformers() -> None:
    # import_module, not `from .hf import register`: when .hf itself is being imported (its import of
    # transformers.quantizers triggers this hook) it is partly initialised, and registers at its end
    importlib.import_module(f"{__name__}.serialization.hf")


# transformers' from_pretrained rebuilds infopt-quantized folders once infopt is imported; the registry module is
# slow to import, so the registration waits until transformers' loader imports it (see infopt.quantize.serialization.hf)
after_import("transformers.quantizers.auto", _register_with_transformers)
