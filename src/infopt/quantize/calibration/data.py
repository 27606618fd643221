"""Calibration data for quantizers that need activations (GPTQ, AWQ, SmoothQuant): token ids ``[n, seq]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...core.errors import RecipeError
from ...core.introspect import text_config
from ...models import load_default_tokenizer

__all__ = ["calibration_text", "calibration_ids", "EVAL_CHARS"]

EVAL_CHARS = 60_000
"""Characters of :func:`infopt.eval.default_text` the evaluation scores; calibration starts after them."""


def calibration_text() -> str:
    """Python's documentation text (``pydoc_data.topics``) after the slice :mod:`infopt.eval` scores.

    About 400,000 characters (~95,000 tokens of the default tokenizer): calibration and evaluation
    never see the same text.

    Example:
        >>> from infopt.eval import default_text
        >>> default_text(10**7).index(calibration_text()[:200]) >= EVAL_CHARS
        True
    """
    from ...eval import default_text

    return default_text(10**7)[EVAL_CHARS:]


def _vocab(model: nn.Module) -> int:
    return int(text_config(model.config).vocab_size)


def _chunks(ids: torch.Tensor, samples: int, seq_len: int) -> torch.Tensor:
    # ids: [T] -> [min(samples, T // seq_len), seq_len], evenly spread over the text
    n = ids.numel() // seq_len
    if n == 0:
        raise RecipeError(
            f"calibration data is {ids.numel()} tokens long, shorter than one sample of seq_len={seq_len}; "
            "pass more text or lower seq_len"
        )
    rows = ids[: n * seq_len].view(n, seq_len)
    if n > samples:
        pick = torch.linspace(0, n - 1, samples).round().long()
        rows = rows[pick]
    return rows.contiguous()


def calibration_ids(model: nn.Module, calibration: Any = None, *, tokenizer: Any = None, samples: int = 32,
                    seq_len: int = 512) -> torch.Tensor:
    """Turn any accepted calibration input into token ids ``[n, seq_len]`` (``n <= samples``) on the model's device.

    Args:
        model: the model to calibrate (its vocabulary bounds the ids).
        calibration: None (:func:`calibration_text`), a string, a list of strings (joined with blank
            lines), an int tensor ``[n, seq]`` or ``[T]``, or a list of 1-D id tensors (concatenated).
        tokenizer: encodes text; None uses the embedded default model's tokenizer, which needs the
            model to share its vocabulary.
        samples: at most this many rows, spread evenly over the data.
        seq_len: tokens per row.

    Returns:
        int64 ids ``[n, seq_len]``.

    Raises:
        RecipeError: an unusable input (wrong type, ids out of the vocabulary, too short, a
            tokenizer whose vocabulary does not fit the model).

    Example:
        >>> from infopt.models import tiny_model
        >>> calibration_ids(tiny_model(), torch.arange(4096) % 100, samples=4, seq_len=256).shape
        torch.Size([4, 256])
    """
    vocab = _vocab(model)
    device = next(model.parameters()).device
    if calibration is None or isinstance(calibration, str) or (
        isinstance(calibration, Sequence) and calibration and all(isinstance(c, str) for c in calibration)
    ):
        text = calibration_text() if calibration is None else (
            calibration if isinstance(calibration, str) else "\n\n".join(calibration))
        if tokenizer is None:
            tokenizer = load_default_tokenizer()
            if len(tokenizer) > vocab:
                raise RecipeError(
                    f"calibration text needs the model's tokenizer: the default tokenizer has {len(tokenizer)} tokens "
                    f"but the model's vocabulary is {vocab}. Pass tokenizer=... or token ids as calibration"
                )
        ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    elif torch.is_tensor(calibration):
        ids = calibration
    elif isinstance(calibration, Sequence) and calibration and all(torch.is_tensor(c) for c in calibration):
        ids = torch.cat([c.reshape(-1) for c in calibration])
    else:
        raise RecipeError(
            f"calibration must be None, text, a list of texts, token ids [n, seq] or a list of id tensors; "
            f"got {type(calibration).__name__}"
        )
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise RecipeError(f"calibration token ids must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise RecipeError(
            f"calibration token ids must lie in [0, {vocab}) (the model's vocabulary); got [{int(ids.min())}, "
            f"{int(ids.max())}]"
        )
    ids = ids.long().cpu()
    if ids.dim() == 2 and ids.shape[1] >= seq_len:
        rows = ids[:, :seq_len]
        if rows.shape[0] > samples:
            rows = rows[torch.linspace(0, rows.shape[0] - 1, samples).round().long()]
        return rows.contiguous().to(device)
    return _chunks(ids.reshape(-1), samples, seq_len).to(device)
