"""Recipe configs of the ``speculative`` stage: ``draft_model``, ``prompt_lookup`` and ``self_draft``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import IncompatibleModelError, RecipeError
from ..core.step import STEP_TYPES, StepConfig, bad_field, register_step

__all__ = ["DraftModel", "PromptLookup", "SelfDraft", "ADAPTIVE_CAP", "check_draft_folder"]

ADAPTIVE_CAP = {"draft_model": 7, "self_draft": 7, "prompt_lookup": 10}
"""Longest draft an adaptive ``num_tokens`` may pick, per method. A model draft's 7 tokens and the pending one make
an 8-token verify, a power of two: a compiled verify runs one graph per power-of-two width, and on a CPU a verify of
9..16 tokens costs a third more than one of 2..8 while a model draft's eighth token is rarely worth it."""


def _check_num_tokens(obj, value) -> None:
    if value == "adaptive":
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 32:
        raise bad_field(obj, "num_tokens", value, "an integer 1..32 or 'adaptive'")


class _Speculative(StepConfig):
    stage: ClassVar[str] = "speculative"
    discriminator: ClassVar[str] = "method"
    fidelity: ClassVar[str] = "lossless"  # greedy output is the target's (verified k tokens per forward); sampling keeps its distribution

    @property
    def fixed_tokens(self) -> int | None:
        """The fixed draft length, or None for adaptive."""
        n = self.num_tokens  # type: ignore[attr-defined]
        return None if n == "adaptive" else n

    @property
    def cap(self) -> int:
        """The longest draft a round may have."""
        n = self.fixed_tokens
        return ADAPTIVE_CAP[self.kind] if n is None else n


@register_step
@dataclass(frozen=True)
class DraftModel(_Speculative):
    """Speculative decoding with a separate, smaller draft model sharing the target's tokenizer.

    Args:
        draft: the draft model (an ``nn.Module``), a local Hugging Face folder, or ``"default"`` (the embedded
            SmolLM2-135M-Instruct, a draft for larger models of its family).
        num_tokens: tokens drafted per round, or ``"adaptive"`` (picked each round from the measured
            acceptance rate and round times, 0 when drafting does not pay).

    Raises:
        RecipeError: a bad ``num_tokens``, a ``draft`` that is neither a module nor a string, or a folder that does
            not exist or holds no ``config.json`` (checked here, before transformers is asked: infopt never
            downloads, and transformers would read a missing folder as a Hub repo id).

    Example:
        >>> from infopt.models import tiny_model
        >>> DraftModel(tiny_model(num_layers=1), num_tokens=3).num_tokens
        3
    """

    kind: ClassVar[str] = "draft_model"
    draft: Any = "default"
    num_tokens: int | str = 4

    def __post_init__(self):
        _check_num_tokens(self, self.num_tokens)
        if not isinstance(self.draft, str) and not hasattr(self.draft, "forward"):
            raise bad_field(self, "draft", self.draft, "a causal LM module, a local model folder, or 'default'")
        if isinstance(self.draft, str) and self.draft != "default":
            check_draft_folder(self.draft)


def check_draft_folder(draft: str | os.PathLike) -> Path:
    """The local model folder ``draft`` names, or a :class:`RecipeError` saying why it is not one.

    infopt never downloads: ``draft`` must be a folder written by ``save_pretrained`` (``config.json`` and weights).
    A name that is not a folder would reach transformers as a Hub repo id and fail with a message about repo ids.

    Raises:
        RecipeError: no such folder (with how to download a Hub model first), a file, or a folder without
            ``config.json``.

    Example:
        >>> check_draft_folder("no/such/folder")
        Traceback (most recent call last):
        ...
        infopt.core.errors.RecipeError: DraftModel.draft='no/such/folder': there is no folder ...
    """
    path = Path(draft).expanduser()
    where = "" if path.is_absolute() else f" ({path.absolute()})"
    if not path.exists():
        hub = ""
        if re.fullmatch(r"[\w.\-]+/[\w.\-]+", str(draft)):
            hub = (f" If {str(draft)!r} is a Hugging Face Hub repo, download it first, e.g. "
                   f"`hf download {draft} --local-dir ./{str(draft).split('/')[-1]}`, and pass that folder.")
        raise RecipeError(f"DraftModel.draft={str(draft)!r}: there is no folder at that path{where}. infopt never "
                          "downloads models: the draft is a local Hugging Face folder (config.json and weights), a "
                          f"loaded model, or 'default' (the embedded SmolLM2-135M-Instruct).{hub}")
    if not path.is_dir():
        raise RecipeError(f"DraftModel.draft={str(draft)!r} is a file{where}; give the folder that holds the draft "
                          "model's config.json and weights")
    if not (path / "config.json").is_file():
        raise RecipeError(f"DraftModel.draft={str(draft)!r}: the folder{where} has no config.json, so it is not a "
                          "Hugging Face model folder; give the folder written by the draft model's save_pretrained")
    return path


@register_step
@dataclass(frozen=True)
class PromptLookup(_Speculative):
    """Speculative decoding without a draft model: drafts are the continuation of the latest earlier
    occurrence of the last n-gram in the prompt and the text generated so far (Saxena 2023).

    Pays off where outputs copy from the input (editing, summarising with quotes, code changes, RAG).

    Args:
        num_tokens: tokens drafted per round (at most), or ``"adaptive"``.
        ngram: ``(min, max)`` n-gram sizes matched, longest first.

    Raises:
        RecipeError: a bad ``num_tokens`` or ``ngram``.

    Example:
        >>> PromptLookup(num_tokens=8, ngram=(1, 3)).to_dict()
        {'speculative': {'method': 'prompt_lookup', 'num_tokens': 8, 'ngram': [1, 3]}}
    """

    kind: ClassVar[str] = "prompt_lookup"
    num_tokens: int | str = 8
    ngram: tuple[int, int] = (1, 3)

    def __post_init__(self):
        _check_num_tokens(self, self.num_tokens)
        ng = self.ngram
        if (not isinstance(ng, tuple) or len(ng) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in ng) or not 1 <= ng[0] <= ng[1] <= 16):
            raise bad_field(self, "ngram", ng, "(min, max) integers with 1 <= min <= max <= 16")


def _quantize_config(obj, value) -> StepConfig | None:
    if value is None or isinstance(value, StepConfig):
        if isinstance(value, StepConfig) and value.stage != "quantize":
            raise bad_field(obj, "quantize", value, "a quantize step config (Int4WeightOnly, Int8WeightOnly, ...)")
        return value
    kinds = STEP_TYPES.get("quantize", {})
    if isinstance(value, str):
        # the draft's head is quantized too (int8): a tied fp32 head is the largest tensor a small draft reads.
        # int4's activations are int8 where the C++ kernel has VNNI/AVX2 ("auto"): the draft only proposes tokens
        # the original weights verify, so its extra rounding costs acceptance, never exactness, and the int8-dot
        # kernel is the faster one (benchmarks/int4_rows.py; docs/speculative.md)
        if value == "int4":  # the default model's 576 channels take group size 32, not the default 128
            return (kinds["int4"](group_size=32, include_lm_head=True, activations="auto") if "int4" in kinds
                    else _missing(obj, value))
        if value == "int8":
            return kinds["int8"](include_lm_head=True) if "int8" in kinds else _missing(obj, value)
        if value in kinds:
            return kinds[value]()
        raise bad_field(obj, "quantize", value, ", ".join(sorted(k for k in kinds if k)) + ", a quantize config, or null")
    if isinstance(value, dict):
        body = dict(value)
        if set(body) == {"quantize"} and isinstance(body["quantize"], dict):  # the to_dict spelling, nested
            body = dict(body["quantize"])
        if "method" not in body:
            raise bad_field(obj, "quantize", value, "a mapping with 'method' (e.g. {method: int4, group_size: 32})")
        return StepConfig.from_dict({"quantize": body})
    raise bad_field(obj, "quantize", value, "a quantize config, a method name ('int4', 'int8'), a mapping, or null")


def _missing(obj, value):
    raise bad_field(obj, "quantize", value, "a registered quantize method (import infopt.quantize)")


@register_step
@dataclass(frozen=True)
class SelfDraft(_Speculative):
    """Speculative decoding drafting with a cheaper copy of the target itself: quantized (int4/int8 weights)
    and/or cut to its first ``num_layers`` layers. Parameters the copy leaves unchanged (the embedding, norms,
    an unquantized head) are shared with the target, so its memory cost is its quantized weights (stated
    in the report).

    Args:
        quantize: a quantize step config (``Int4WeightOnly(group_size=32)``, ``Int8WeightOnly()``), a method
            name (``"int4"``: int4 with group size 32, an int8 head and int8 activations where the CPU has the
            kernel for them; ``"int8"``: int8 with an int8 head), a
            recipe mapping, or None (no quantization).
        num_layers: keep only the first ``num_layers`` decoder layers in the draft (None: all).
        num_tokens: tokens drafted per round, or ``"adaptive"`` (the default).

    Raises:
        RecipeError: neither quantization nor truncation (the draft would be the target), a bad field.

    Example:
        >>> SelfDraft(quantize="int8", num_tokens=4).quantize.kind
        'int8'
    """

    kind: ClassVar[str] = "self_draft"
    quantize: Any = "int4"
    num_layers: int | None = None
    num_tokens: int | str = "adaptive"

    def __post_init__(self):
        _check_num_tokens(self, self.num_tokens)
        object.__setattr__(self, "quantize", _quantize_config(self, self.quantize))
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool)
                                            or self.num_layers < 1):
            raise bad_field(self, "num_layers", self.num_layers, "a positive integer or null")
        if self.quantize is None and self.num_layers is None:
            raise RecipeError("SelfDraft needs quantize and/or num_layers: with neither, the draft is the target "
                              "itself and drafting only adds work. Example: SelfDraft(quantize='int4')")

    def check(self, model, info, steps):
        n = getattr(info, "num_layers", None)
        if self.num_layers is not None and n is not None and self.num_layers > n:
            raise IncompatibleModelError(f"SelfDraft(num_layers={self.num_layers}) exceeds the model's {n} layers; "
                                         f"use num_layers <= {n}")
        return []
