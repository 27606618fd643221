"""Saving and loading quantized models.

- :mod:`~infopt.quantize.serialization.serialize`: the ``quantization_config`` written beside the weights and the
  rebuilding of quantized layers from it.
- :mod:`~infopt.quantize.serialization.hf`: transformers' quantizer interface, so ``from_pretrained`` loads such folders.
- :mod:`~infopt.quantize.serialization.export`: quantized layers to the portable layouts other tools read.
"""
