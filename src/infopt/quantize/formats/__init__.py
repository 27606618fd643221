"""Quantized formats: the layers a quantized model holds, their packed layouts and the kernels they call.

- :mod:`~infopt.quantize.formats.primitives`: the quantization formulas (scales, zero points, rounding, nibble packing)
  and :class:`~infopt.quantize.formats.primitives.KeepsFormat`, the base of every quantized layer.
- :mod:`~infopt.quantize.formats.int8`, :mod:`~infopt.quantize.formats.int4`, :mod:`~infopt.quantize.formats.fp8`:
  weight-only int8 / int4 / FP8 layers and their configs (``Int8WeightOnly``, ``Int4WeightOnly``, ``FP8``).
- :mod:`~infopt.quantize.formats.a8`: the int8-activation block layouts of the CPU kernels.
- :mod:`~infopt.quantize.formats.w8a8`: int8 weights and activations (SmoothQuant's layer).
- :mod:`~infopt.quantize.formats.bnb`: bitsandbytes' int8 and NF4 layers (optional backend).
"""
