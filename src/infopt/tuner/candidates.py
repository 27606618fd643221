"""The recipes the tuner tries: the presets and the main variants of each step, with what makes one dominate another."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..core.errors import RecipeError
from ..recipe import PRESETS, Recipe

__all__ = ["Candidate", "default_candidates", "as_candidates", "quality_key", "is_lossless", "label", "BATCH_LIKE"]

BATCH_LIKE = ("batch", "throughput", "prefix")
"""Workloads of many requests, where the batching engine is a candidate."""


@dataclass(frozen=True)
class Candidate:
    """One recipe to try.

    Attributes:
        name: a short readable label (``"int4-g32+static+compile"``, ``"preset:cpu-fast"``).
        recipe: the recipe.
        family: candidates of one family differ only in how coarsely they quantize.
        level: coarseness inside the family (0 the finest): when a level misses the quality gate, every
            coarser level of its family is skipped as dominated.
        calibrates: a step needs calibration data (GPTQ, AWQ, ...): minutes on a real model, once (cached).
    """

    name: str
    recipe: Recipe
    family: str | None = None
    level: int = 0
    calibrates: bool = False

    @property
    def lossless(self) -> bool:
        """Every step keeps greedy output token-identical (by its own claim; the tuner checks the tokens)."""
        return is_lossless(self.recipe)

    @property
    def compiles(self) -> bool:
        return any(s.stage == "compile" for s in self.recipe.steps)


def is_lossless(recipe: Recipe) -> bool:
    """True when every step of ``recipe`` claims token-identical greedy output.

    Example:
        >>> is_lossless(Recipe.parse("cpu-lossless")), is_lossless(Recipe.parse("cpu-fast"))
        (True, False)
    """
    return all(s.lossless for s in recipe.steps)


def quality_key(recipe: Recipe) -> str:
    """The lossy steps of ``recipe`` as a string: candidates with equal keys share their quality figures'
    source (compile, a static cache and speculative decoding leave the logits as they are, up to rounding).

    Example:
        >>> quality_key(Recipe.parse("cpu-lossless"))
        '[]'
    """
    return json.dumps([s.to_dict() for s in recipe.steps if not s.lossless and s.stage != "compile"], sort_keys=True)


def _c(name: str, steps: list[dict[str, Any]], **kw) -> Candidate:
    return Candidate(name, Recipe.parse({"steps": steps, "name": name}), **kw)


_STATIC = {"kvcache": {"kind": "static"}}
# the lossy variants keep their cache in fp16 as cpu-fast does (a KL of ~1e-6 beside the weights' ~1e-3)
_STATIC16 = {"kvcache": {"kind": "static", "dtype": "float16"}}
# as the cpu-fast preset compiles (an AOTInductor package on CPU where it builds): the variants are measured with the
# step a user of the preset gets, and cpu-fast stays one of them (int4 g32 auto + static + this)
_COMPILE = {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": "auto"}}
# and as its prompts attend (bf16 where the CPU has native bf16): the int4 variants with a compiled step take it too,
# so cpu-fast is the g32 auto one of its family and a miss there prunes the coarser groups
_PROMPTS = {"attention": {"backend": "sdpa_gqa", "prompt_dtype": "bfloat16"}}


def _int4(group_size: int, activations: str = "auto") -> dict[str, Any]:
    # held to cpu-fast's bound (the layers that break it kept in higher precision), so cpu-fast is the g32 auto one
    return {"quantize": {"method": "int4", "group_size": group_size, "include_lm_head": True, "share_embedding": True,
                         "activations": activations, "max_kl": 0.02}}


def default_candidates(workload: str = "decode", *, device: str = "cpu", calibrated: bool = False) -> list[Candidate]:
    """The recipes :func:`infopt.tune` tries by default, most promising first (the budget may end the list).

    Presets come first (so the tuned recipe is never slower than a preset that fits the gate), then the
    step variants: int4 at group sizes 32/64/128 with int8 or float activations, int8 weights, each with and
    without a static cache + compiled decode step; speculative decoding (self-draft, prompt lookup) with and
    without a static cache; and with ``calibrated``, GPTQ and AWQ int4 (minutes each on a real model).

    Args:
        workload: the benchmark workload; batching candidates join on many-request workloads.
        device: ``"cpu"`` or ``"cuda"``: GPU-only presets are left out on CPU.
        calibrated: include the calibrated quantizers.

    Returns:
        The candidates, in trial order.

    Example:
        >>> names = [c.name for c in default_candidates("decode")]
        >>> names[:3]
        ['preset:cpu-lossless', 'preset:cpu-fast', 'preset:memory-saver']
    """
    many = workload in BATCH_LIKE
    out: list[Candidate] = []
    for name in PRESETS:
        if name == "gpu-fast" and device != "cuda":
            continue
        if name == "throughput" and not many:
            continue
        out.append(Candidate(f"preset:{name}", Recipe.parse(name), family=f"preset:{name}"))
    # lossless variants: decode-loop changes that keep the original weights
    out += [
        _c("static", [_STATIC]),
        _c("static+compile", [_STATIC, _COMPILE]),
        _c("self_draft+static", [{"speculative": {"method": "self_draft", "quantize": "int4",
                                                  "num_tokens": "adaptive"}}, _STATIC]),
        _c("prompt_lookup", [{"speculative": {"method": "prompt_lookup", "num_tokens": 8}}]),
        _c("prompt_lookup+static", [{"speculative": {"method": "prompt_lookup", "num_tokens": 8}}, _STATIC]),
    ]
    # lossy variants: coarser groups later in each family (skipped once a finer one misses the gate)
    for acts in ("auto", "float"):
        for level, g in enumerate((32, 64, 128)):
            out.append(_c(f"int4-g{g}-{acts}+static+compile", [_PROMPTS, _int4(g, acts), _STATIC16, _COMPILE],
                          family=f"int4-{acts}+static+compile", level=level))
            out.append(_c(f"int4-g{g}-{acts}", [_int4(g, acts)], family=f"int4-{acts}", level=level))
    int8 = {"quantize": {"method": "int8", "include_lm_head": True, "share_embedding": True}}
    out += [
        _c("int8+static+compile", [int8, _STATIC16, _COMPILE], family="int8", level=0),
        _c("int8", [int8], family="int8-eager", level=0),
        _c("int8-a8+static+compile", [{"quantize": {**int8["quantize"], "activations": "int8"}}, _STATIC16, _COMPILE],
           family="int8-a8", level=0),
    ]
    if many:
        out.append(_c("paged+batching", [{"kvcache": {"kind": "paged"}}, {"batching": {}}]))
    if calibrated:
        for method in ("gptq", "awq"):
            for level, g in enumerate((32, 64)):
                out.append(_c(f"{method}-g{g}+static+compile",
                              [{"quantize": {"method": method, "group_size": g}}, _STATIC16, _COMPILE],
                              family=method, level=level, calibrates=True))
    return _dedupe(out)


def _dedupe(cands: list[Candidate]) -> list[Candidate]:
    # a variant equal to an earlier candidate (cpu-fast is int4-g32-auto+static+compile) is dropped, and the earlier
    # one joins the variant's family at its level, so a miss still prunes the coarser levels
    out: list[Candidate] = []
    for c in cands:
        same = next((i for i, o in enumerate(out) if o.recipe.steps == c.recipe.steps), None)
        if same is None:
            out.append(c)
        elif c.family is not None and not out[same].family or str(out[same].family).startswith("preset:"):
            o = out[same]
            out[same] = Candidate(o.name, o.recipe, family=c.family, level=c.level,
                                  calibrates=o.calibrates or c.calibrates)
    return out


def label(recipe: Recipe) -> str:
    """A short name for a recipe: each step's key with the fields that differ from their defaults.

    Example:
        >>> from infopt.quantize import Int4WeightOnly
        >>> from infopt.kvcache import Static
        >>> label(Recipe.parse([Int4WeightOnly(group_size=32), Static()]))
        'quantize:int4(group_size=32)+kvcache:static'
    """
    parts = []
    for s in recipe.steps:
        changed = [f"{f.name}={getattr(s, f.name)}" for f in dataclasses.fields(s)
                   if f.default is not dataclasses.MISSING and getattr(s, f.name) != f.default]
        parts.append(s.key + (f"({','.join(changed)})" if changed else ""))
    return "+".join(parts) or "(empty)"


def as_candidates(items: Any) -> list[Candidate]:
    """Turn what the user passed as ``candidates`` into :class:`Candidate` s.

    Args:
        items: a list whose entries are :class:`Candidate` s, preset names, or anything
            :meth:`~infopt.recipe.Recipe.parse` reads (step configs, lists of them, dicts, YAML paths).

    Returns:
        The candidates, in the given order (a preset's name is ``preset:NAME``).

    Raises:
        RecipeError: an entry that is not a recipe, or two entries with one name.

    Example:
        >>> from infopt.kvcache import Static
        >>> [c.name for c in as_candidates(["cpu-fast", [Static()]])]
        ['preset:cpu-fast', 'kvcache:static']
    """
    if isinstance(items, (str, Recipe, Candidate)) or not hasattr(items, "__iter__"):
        raise RecipeError(f"candidates must be a list of recipes, got {type(items).__name__}")
    out: list[Candidate] = []
    for item in items:
        if isinstance(item, Candidate):
            out.append(item)
            continue
        r = Recipe.parse(item)
        name = f"preset:{item}" if isinstance(item, str) and item in PRESETS else (r.name or label(r))
        out.append(Candidate(name, r))
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RecipeError(f"two candidates are named {dup[0]!r}; give them distinct names (Recipe(name=...))")
    return out
