"""Quantization algorithms: how the weights of a quantized format are chosen.

- :mod:`~infopt.quantize.algorithms.layerwise`: the calibrated methods' common loop (one decoder layer at a time on
  captured activations).
- :mod:`~infopt.quantize.algorithms.gptq`, :mod:`~infopt.quantize.algorithms.awq`: GPTQ and AWQ on that loop.
- :mod:`~infopt.quantize.algorithms.smoothquant`: SmoothQuant's smoothing before W8A8.
- :mod:`~infopt.quantize.algorithms.qat`, :mod:`~infopt.quantize.algorithms.qat_train`: quantization-aware training
  (fake-quantized layers, the distillation loop) and its conversion to the real formats.
"""
