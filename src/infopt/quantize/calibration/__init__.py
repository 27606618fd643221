"""Calibration for the calibrated methods (GPTQ, AWQ, SmoothQuant, QAT).

- :mod:`~infopt.quantize.calibration.data`: the calibration token ids (the embedded text by default, or the user's).
- :mod:`~infopt.quantize.calibration.cache`: calibrated results cached on disk, keyed by model, config and data.
"""
