"""A scaled rotary embedding between a transformers config and a GGUF file, both ways.

llama.cpp stores rotary scaling two ways, and infopt reads and writes both:

- ``linear`` as metadata (``{arch}.rope.scaling.type = "linear"``, ``{arch}.rope.scaling.factor``): every position
  is divided by the factor;
- ``llama3`` (Llama 3.1 / 3.2 / 3.3) as a tensor, ``rope_freqs.weight``: one divisor per rotary frequency
  (``head_dim / 2`` of them), 1 for short wavelengths, ``factor`` for long ones, smoothed between. The file keeps
  the divisors only; reading one back, the four ``llama3`` parameters are solved from them and the frequencies they
  give are checked against the file's before the model is built.

Any other scaling (``yarn``, ``longrope``, ``dynamic``, ...) is refused both ways with a
:class:`~infopt.core.errors.CheckpointError`: loaded without it, a model computes other positions than the file's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ...core.errors import CheckpointError

__all__ = ["rope_parameters", "export_rope", "rope_from_gguf", "check_rope"]

FREQS_TENSOR = "rope_freqs.weight"
_RTOL = 1e-5  # the frequencies a solved llama3 set gives against the file's (float32 divisors)


def rope_parameters(config) -> dict[str, Any]:
    """The config's rotary parameters: ``rope_parameters``, or the older top-level ``rope_theta`` / ``rope_scaling``;
    per layer type (Gemma 3's sliding and full layers), the full-attention layers'."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and not isinstance(next(iter(params.values())), dict):
        out = dict(params)
    else:
        out = dict((params or {}).get("full_attention") or {})
    if "rope_theta" not in out and getattr(config, "rope_theta", None) is not None:
        out["rope_theta"] = config.rope_theta
    scaling = getattr(config, "rope_scaling", None) or {}
    out["rope_type"] = out.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in out and key in scaling:
            out[key] = scaling[key]
    return out


def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """The unscaled frequencies, computed as transformers' rotary embeddings compute them (float32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def export_rope(config, arch: str) -> tuple[dict[str, Any], np.ndarray | None]:
    """What a GGUF file needs for ``config``'s rotary scaling: ``(metadata, divisors)``; metadata keys are without
    the ``{arch}.`` prefix, divisors the float32 ``rope_freqs.weight`` (or None).

    Raises:
        CheckpointError: a scaling llama.cpp does not compute as transformers does (see the module docstring), or
            ``llama3`` on an architecture whose llama.cpp graph does not read the divisors.

    Example:
        >>> from transformers import LlamaConfig
        >>> llama31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        ...            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        >>> config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
        ...                      rope_parameters=llama31)
        >>> metadata, divisors = export_rope(config, "llama")
        >>> metadata, divisors.shape, float(divisors.min()), float(divisors.max())
        ({}, (64,), 1.0, 8.0)
    """
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind == "default":
        return {}, None
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(params["factor"])}, None
    if kind == "llama3" and arch == "llama":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        base = _base_inv_freq(float(params["rope_theta"]), _head_dim(config))
        return {}, (base / scaled.float()).numpy().astype(np.float32)
    raise CheckpointError(f"export_gguf: the model's rotary embedding is scaled (rope_type {kind!r}); infopt writes "
                          "unscaled, linear and (for llama) llama3 rotary parameters only, and llama.cpp would "
                          "compute other positions than the model does. Convert this model with llama.cpp's "
                          "convert_hf_to_gguf.py instead")


def _llama3_divisors(wavelen: np.ndarray, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """The llama3 rule (Llama 3.1's published frequency scaling): the divisor of each frequency of ``wavelen``."""
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _solve_llama3(divisors: np.ndarray, base: float) -> dict[str, float] | None:
    """A ``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)`` set that gives
    ``divisors``, or None. Only the wavelength boundaries are fixed by the divisors (scaling the three together
    changes nothing), so ``low_freq_factor`` is taken as 1, as every Llama 3 checkpoint has it."""
    d = divisors.astype(np.float64)
    factor = float(d.max())
    wavelen = 2 * math.pi / _base_inv_freq(base, 2 * len(d)).double().numpy()
    ones = np.isclose(d, 1.0, rtol=_RTOL)
    full = np.isclose(d, factor, rtol=_RTOL)
    mid = ~ones & ~full
    candidates: list[tuple[float, float]] = []  # (high, old) with low = 1
    if mid.sum() >= 2:  # smooth = (old / wavelen - low) / (high - low): a line in 1 / wavelen
        smooth = (1 / d[mid] - 1 / factor) / (1 - 1 / factor)
        slope, icept = np.polyfit(1 / wavelen[mid], smooth, 1)
        if icept < 0:
            high = 1 - 1 / icept
            old = slope * (high - 1)
            candidates += [(round(high, 3), float(round(old))), (high, old)]  # round figures where they hold
    else:  # zero or one smoothed frequency: any boundaries around it give the same divisors; try a few
        last_one = wavelen[ones].max() if ones.any() else wavelen.min() / 2
        first_full = wavelen[full].min() if full.any() else wavelen.max() * 2
        for high in (2.0, 4.0, 8.0, 16.0, 32.0):
            if mid.any():
                s = (1 / d[mid][0] - 1 / factor) / (1 - 1 / factor)
                old = (s * (high - 1) + 1) * wavelen[mid][0]
            else:
                old = (last_one * high + first_full) / 2 if last_one * high < first_full else first_full * 0.99
            candidates.append((high, old))
    for high, old in candidates:
        if high <= 1 or old <= 0:
            continue
        got = _llama3_divisors(wavelen, factor, 1.0, high, old)
        if np.allclose(got, d, rtol=_RTOL, atol=0):
            return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
                    "original_max_position_embeddings": int(round(old)) if abs(old - round(old)) < 1e-6 * old
                    else float(old)}
    return None


def rope_from_gguf(cfg: dict[str, Any], arch: str, metadata: dict[str, Any], divisors: np.ndarray | None,
                   source: str) -> None:
    """Put a GGUF file's rotary scaling into the config dict ``cfg`` (as ``rope_scaling``), from its
    ``{arch}.rope.scaling.*`` metadata (without the prefix) and ``rope_freqs.weight`` (or None).

    Raises:
        CheckpointError: a scaling infopt does not map (named), or divisors no ``llama3`` set gives.

    Example:
        >>> cfg = {"rope_theta": 10000.0}
        >>> rope_from_gguf(cfg, "llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, None, "m.gguf")
        >>> cfg["rope_scaling"]
        {'rope_type': 'linear', 'factor': 4.0}
    """
    kind = str(metadata.get("rope.scaling.type") or "none")
    if kind == "linear":
        factor = float(metadata.get("rope.scaling.factor") or 1.0)
        if factor != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind != "none":
        raise CheckpointError(f"{source}: rotary scaling {kind!r} ({arch}.rope.scaling.type); infopt maps 'linear' "
                              "and llama3's rope_freqs tensor only, and without it the model would compute other "
                              "positions than the file's. Load the original checkpoint with from_pretrained")
    if divisors is None:
        return
    d = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if np.allclose(d, 1.0, rtol=_RTOL):
        return
    if "rope_scaling" in cfg:
        raise CheckpointError(f"{source}: both {arch}.rope.scaling.type {kind!r} and {FREQS_TENSOR}; infopt reads "
                              "one rotary scaling")
    solved = _solve_llama3(d, float(cfg.get("rope_theta", 10000.0)))
    if solved is None:
        raise CheckpointError(f"{source}: {FREQS_TENSOR} holds per-frequency divisors that no llama3 rotary scaling "
                              f"gives (max {d.max():.4g}); infopt cannot build a model that computes these positions")
    cfg["rope_scaling"] = {"rope_type": "llama3", **solved}


def check_rope(config, divisors: np.ndarray | None, source: str) -> None:
    """Check that the built ``config``'s rotary frequencies (through transformers' own functions) are the file's:
    the unscaled ones over the divisors of ``rope_freqs.weight``.

    Raises:
        CheckpointError: they are not.
    """
    if divisors is None:
        return
    params = rope_parameters(config)
    base = _base_inv_freq(float(params["rope_theta"]), _head_dim(config))
    want = base / torch.as_tensor(np.asarray(divisors, dtype=np.float32)).reshape(-1)
    kind = params["rope_type"]
    got = ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0].float() if kind in ROPE_INIT_FUNCTIONS else base
    if got.shape != want.shape or not torch.allclose(got, want, rtol=_RTOL * 10, atol=0):
        raise CheckpointError(f"{source}: the model built from the file's rotary parameters ({params}) computes "
                              f"other frequencies than its {FREQS_TENSOR}; refusing to load it silently wrong")
