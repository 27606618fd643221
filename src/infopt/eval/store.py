"""Reference logits on disk: one safetensors file, its metadata as JSON in the file's header."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .metrics import Reference

__all__ = ["save_reference", "load_reference", "reference_meta", "FORMAT"]

# metadata key in the safetensors header, and the format version written under it
_KEY = "infopt_reference"
FORMAT = 1


def save_reference(reference: Reference, path: str | os.PathLike) -> Path:
    """Write a :class:`~infopt.eval.Reference` to one safetensors file.

    The file holds ``input_ids`` (``[1, T]`` int64) and ``logits`` (``[1, T, V]`` in the reference's
    dtype: fp16 log-probs for :func:`~infopt.eval.make_reference`, 2 bytes x T x V, e.g. 384 MiB for
    4,096 tokens x 49,152), and in its header a JSON object under ``"infopt_reference"``: the format
    version, ``window``, ``stride``, ``tokens``, ``vocab``, ``dtype`` and the reference's ``meta``
    (text hash, tokenizer, model name, max_tokens, exact reference NLL). The write goes to a
    temporary file first and is renamed into place, so a crash never leaves half a file.

    Args:
        reference: the reference to save.
        path: file to write (parent folders are created); ``.safetensors`` is the usual suffix.

    Returns:
        The path written.

    Raises:
        ValueError: the metadata is not JSON-serialisable.

    Example:
        >>> import tempfile, torch
        >>> ref = Reference(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8, dtype=torch.float16))
        >>> p = save_reference(ref, tempfile.mkdtemp() + "/ref.safetensors")
        >>> load_reference(p).logits.dtype
        torch.float16
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "format": FORMAT,
        "window": reference.window,
        "stride": reference.stride,
        "tokens": reference.tokens,
        "vocab": reference.vocab,
        "dtype": str(reference.logits.dtype).removeprefix("torch."),
        "meta": reference.meta,
    }
    try:
        text = json.dumps(header)
    except TypeError as e:
        raise ValueError(f"Reference.meta must be JSON-serialisable to be saved: {e}") from None
    tensors = {"input_ids": reference.input_ids.detach().cpu().contiguous(),
               "logits": reference.logits.detach().cpu().contiguous()}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={_KEY: text})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def reference_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of a saved reference, read from the file header without loading the logits.

    Args:
        path: a file written by :func:`save_reference`.

    Returns:
        ``{"format", "window", "stride", "tokens", "vocab", "dtype", "meta": {...}}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a safetensors file written by :func:`save_reference`.

    Example:
        >>> import tempfile, torch
        >>> p = save_reference(Reference(torch.tensor([[1, 2]]), torch.zeros(1, 2, 4)), tempfile.mkdtemp() + "/r")
        >>> reference_meta(p)["tokens"]
        2
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"reference file '{p}' does not exist")
    try:
        with safe_open(str(p), framework="pt") as f:
            header = (f.metadata() or {}).get(_KEY)
    except SafetensorError as e:
        raise ValueError(f"'{p}' is not a safetensors file ({e}); write references with save_reference") from None
    if header is None:
        raise ValueError(f"'{p}' is a safetensors file but not an infopt reference (no '{_KEY}' metadata); "
                         "write references with infopt.eval.save_reference")
    data = json.loads(header)
    if data.get("format") != FORMAT:
        raise ValueError(f"'{p}' is an infopt reference of format {data.get('format')!r}; this version reads "
                         f"format {FORMAT}. Delete it and compute it again (infopt.eval.reference_for does)")
    return data


def load_reference(path: str | os.PathLike) -> Reference:
    """Load a :class:`~infopt.eval.Reference` written by :func:`save_reference` (bit-identical tensors).

    Args:
        path: the file.

    Returns:
        The reference, its logits in the dtype they were saved in.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a reference file, or one of another format version.

    Example:
        >>> import tempfile, torch
        >>> ref = Reference(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 8), window=2, stride=1)
        >>> back = load_reference(save_reference(ref, tempfile.mkdtemp() + "/ref.safetensors"))
        >>> torch.equal(back.logits, ref.logits), back.window, back.stride
        (True, 2, 1)
    """
    data = reference_meta(path)
    tensors = load_file(str(path))
    missing = {"input_ids", "logits"} - set(tensors)
    if missing:
        raise ValueError(f"reference file '{path}' lacks tensor(s) {sorted(missing)}; it is damaged, compute it again")
    return Reference(input_ids=tensors["input_ids"], logits=tensors["logits"], window=data["window"],
                     stride=data["stride"], meta=dict(data.get("meta") or {}))
