"""Recipes: an ordered, validated set of steps, read from Python configs, dicts, YAML/JSON files or presets."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# importing the feature packages fills the step registry
from . import attention as _attention  # noqa: F401
from . import batching as _batching  # noqa: F401
from . import compile as _compile  # noqa: F401
from . import kvcache as _kvcache  # noqa: F401
from . import parallel as _parallel  # noqa: F401
from . import quantize as _quantize  # noqa: F401
from . import speculative as _speculative  # noqa: F401
from .core.errors import RecipeError, did_you_mean
from .core.step import FIDELITY, STAGES, STEP_TYPES, StepConfig

__all__ = ["Recipe", "Rule", "RULES", "rules_markdown", "PRESETS", "Preset", "available_steps", "check_rules", "check_gate"]


@dataclass(frozen=True)
class Rule:
    """One composition rule between two steps.

    Attributes:
        a, b: step patterns: ``stage``, ``stage:kind``, optionally with ``[field=value]``
            (``attention[backend=sdpa]``) or ``[field!=value]``.
        relation: ``conflicts`` (a and b cannot both be present) or ``requires`` (a needs some b).
        reason: why, in one sentence.
        fix: what to use instead.
        unless: a step pattern whose presence lifts the rule (None: always holds).
    """

    a: str
    b: str
    relation: str
    reason: str
    fix: str
    unless: str | None = None

    def __post_init__(self):
        if self.relation not in ("conflicts", "requires"):
            raise ValueError(f"Rule.relation={self.relation!r}; allowed: conflicts, requires")


_PATTERN = re.compile(r"^(?P<stage>[a-z_]+)(?::(?P<kind>[a-z0-9_]+))?(?:\[(?P<field>[a-z_]+)(?P<op>!?=)(?P<value>[^\]]+)\])?$")


def matches(pattern: str, step: StepConfig) -> bool:
    """True when ``step`` fits a rule pattern (see :class:`Rule`)."""
    m = _PATTERN.match(pattern)
    if m is None:
        raise ValueError(f"bad rule pattern {pattern!r}")
    if m["stage"] != step.stage:
        return False
    if m["kind"] is not None and m["kind"] != step.kind:
        return False
    if m["field"] is not None:
        value = str(getattr(step, m["field"], None)).lower()
        hit = value == m["value"].lower()
        return not hit if m["op"] == "!=" else hit
    return True


RULES: tuple[Rule, ...] = (
    Rule("compile", "kvcache:paged", "conflicts",
         "the compiled decode step needs static shapes, and the paged cache's block tables change shape every step "
         "(the batching engine's step, compiled with dynamic shapes, serves a paged cache)",
         "use kvcache static with compile, add batching, or drop compile to keep paged + prefix caching",
         unless="batching"),
    Rule("compile", "kvcache:static", "requires",
         "a compiled decode step over a growing KV cache sees a new shape every token and recompiles each time",
         "add kvcache.Static(max_length=...) to the recipe (it is applied before compile), or batching",
         unless="batching"),
    Rule("compile[aot=true]", "batching", "conflicts",
         "AOTInductor packages are built for the decode step over a static cache; the batching engine's step is "
         "compiled with dynamic shapes by torch.compile",
         "use compile aot: auto or false with batching"),
    Rule("batching[batch_invariant=true]", "compile", "conflicts",
         "batch-invariant steps run eagerly in fixed row blocks; a compiled step's matrix products are Inductor's, "
         "sized by the batch",
         "drop compile with batching batch_invariant: true"),
    Rule("compile", "attention[backend=flex]", "conflicts",
         "flex attention compiles its own kernels; compiling the whole forward around it is not supported here",
         "use attention backend 'sdpa' with compile, or drop compile"),
    Rule("kvcache:heavy_hitter", "attention[backend!=eager]", "conflicts",
         "H2O eviction needs the attention weights, which only the eager backend returns",
         "use attention backend 'eager' with kvcache heavy_hitter"),
    Rule("speculative", "kvcache:sinks", "conflicts",
         "speculative decoding rolls rejected draft tokens back with crop, which a cache that evicted tokens cannot undo",
         "use kvcache static (or no kvcache step) with speculative decoding"),
    Rule("speculative", "kvcache:heavy_hitter", "conflicts",
         "speculative decoding rolls rejected draft tokens back with crop, which a cache that evicted tokens cannot undo",
         "use kvcache static (or no kvcache step) with speculative decoding"),
    Rule("kvcache:paged", "attention[backend!=paged]", "conflicts",
         "the paged cache is read by the paged attention kernel only",
         "use attention backend 'paged' with kvcache paged, or leave the attention step out (kvcache paged then "
         "switches the backend itself)"),
    Rule("speculative", "kvcache:quantized", "conflicts",
         "speculative decoding rolls rejected draft tokens back, and a quantized cache cannot un-quantize what it "
         "already folded into its int blocks",
         "use kvcache static (or no kvcache step) with speculative decoding"),
    Rule("speculative", "kvcache:paged", "conflicts",
         "speculative decoding rolls rejected draft tokens back, while the paged cache's full blocks are shared "
         "through the prefix cache as soon as they fill, so a rejected token cannot be taken back",
         "use kvcache static (or no kvcache step) with speculative decoding"),
    Rule("speculative", "batching", "conflicts",
         "the batching engine runs its own decode loop, which does not speculate",
         "use speculative decoding for single-stream latency, batching for throughput"),
    Rule("batching", "kvcache[kind!=paged]", "conflicts",
         "the batching engine keeps every sequence's K/V in its own paged cache, so another cache kind would "
         "never see the batched calls",
         "leave the kvcache step out, or use kvcache paged (its block_size/num_blocks/prefix_caching then size "
         "the engine's cache)"),
    Rule("batching", "attention[backend!=paged]", "conflicts",
         "the batching engine packs every sequence into one row read by the paged attention kernel",
         "use attention backend 'paged' with batching, or leave the attention step out (batching switches it)"),
    Rule("compile", "quantize:bnb_int8", "conflicts",
         "bitsandbytes kernels break the compiled graph",
         "use quantize int8 (native) with compile"),
    Rule("compile", "quantize:bnb_nf4", "conflicts",
         "bitsandbytes kernels break the compiled graph",
         "use quantize int4 (native) with compile"),
    Rule("parallel[tensor!=none]", "quantize:bnb_int8", "conflicts",
         "bitsandbytes keeps int8 weights in its own packed format with whole-tensor quantization state, which "
         "tensor parallelism cannot split by rows or columns",
         "use quantize int8 (native) with parallel tensor; its scales are sharded with their rows"),
    Rule("parallel[tensor!=none]", "quantize:bnb_nf4", "conflicts",
         "bitsandbytes keeps NF4 weights in its own packed format with whole-tensor quantization state, which "
         "tensor parallelism cannot split by rows or columns",
         "use quantize int4 (native) with parallel tensor; its groups are sharded with their columns"),
    Rule("parallel[tensor!=none]", "quantize:smoothquant", "conflicts",
         "W8A8 layers quantize each activation row over its full width; a row-parallel shard sees only its slice",
         "use quantize int8 (weight-only) with parallel tensor, or parallel pipeline with smoothquant"),
    Rule("parallel[tensor!=none]", "quantize:fp8", "conflicts",
         "FP8 layers quantize each activation row over its full width (a row-parallel shard sees only its slice), "
         "and tensor parallelism does not slice their fp8 weights and scales",
         "use quantize int8 (weight-only) with parallel tensor, or parallel pipeline with fp8"),
)


def rules_markdown(rules: Iterable[Rule] = RULES) -> str:
    """The rules as the Markdown table docs/recipes.md shows (a test keeps the two equal).

    Example:
        >>> rules_markdown().splitlines()[0]
        '| a | b | relation | reason | fix |'
    """
    rows = ["| a | b | relation | reason | fix |", "|---|---|---|---|---|"]
    rows += [f"| `{r.a}` | `{r.b}` | {r.relation}{f' (unless `{r.unless}`)' if r.unless else ''} | {r.reason} | "
             f"{r.fix} |" for r in rules]
    return "\n".join(rows)


def check_rules(steps: Iterable[StepConfig], rules: Iterable[Rule] = RULES) -> None:
    """Raise :class:`RecipeError` for the first rule a recipe breaks.

    Example:
        >>> from infopt.compile import Compile
        >>> check_rules([Compile()])
        Traceback (most recent call last):
        ...
        infopt.core.errors.RecipeError: compile requires kvcache:static: a compiled decode step ...
    """
    steps = list(steps)
    for rule in rules:
        a_steps = [s for s in steps if matches(rule.a, s)]
        if not a_steps or (rule.unless is not None and any(matches(rule.unless, s) for s in steps)):
            continue
        b_steps = [s for s in steps if s not in a_steps and matches(rule.b, s)]
        a_key = a_steps[0].key
        if rule.relation == "conflicts" and b_steps:
            raise RecipeError(f"{a_key} cannot be combined with {b_steps[0].key}: {rule.reason}. Fix: {rule.fix}")
        if rule.relation == "requires" and not b_steps:
            raise RecipeError(f"{a_key} requires {rule.b}: {rule.reason}. Fix: {rule.fix}")


@dataclass(frozen=True)
class Preset:
    """A named recipe with a one-line description; :attr:`fidelity` is its weakest step's."""

    name: str
    description: str
    steps: tuple[dict[str, Any], ...]

    @property
    def fidelity(self) -> str:
        """``exact``, ``lossless`` or ``lossy``: the weakest :attr:`~infopt.core.step.StepConfig.fidelity` of the
        preset's steps.

        Example:
            >>> PRESETS["cpu-lossless"].fidelity, PRESETS["cpu-fast"].fidelity
            ('lossless', 'lossy')
        """
        return max((Recipe.parse({"steps": list(self.steps)}).steps), key=lambda st: FIDELITY.index(st.fidelity)
                   ).fidelity


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("cpu-lossless", "lossless (the model's own math; greedy output parts only at near-ties), faster: "
               "speculative decoding drafted by an int4 copy of "
               "the model (int8 head, int8 activations where the CPU has the kernel) and verified by the original "
               "weights, on a static KV cache with compiled verify and draft steps (AOTInductor packages on CPU; fp32 "
               "linears on prepacked weights)",
               ({"kvcache": {"kind": "static"}}, {"compile": {"mode": "default", "aot": "auto",
                                                             "warmup_batch_sizes": "auto"}},
                {"speculative": {"method": "self_draft", "quantize": "int4", "num_tokens": "adaptive"}})),
        Preset("cpu-fast", "fastest CPU decode: int4 weights (group 32, int8 head that a tied embedding shares; int8 "
               "activations on AVX512-VNNI and AVX2 CPUs) held to KL <= 0.02 (measured when applied; layers that break "
               "it are kept in higher precision and listed in the report), static KV cache in fp16, decode step compiled "
               "(an AOTInductor package on CPU), prompts of 64+ tokens attending in bf16 where the CPU has native bf16",
               ({"attention": {"backend": "sdpa_gqa", "prompt_dtype": "bfloat16"}},
                {"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True,
                              "activations": "auto", "max_kl": 0.02}},
                {"kvcache": {"kind": "static", "dtype": "float16"}},
                {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": "auto"}})),
        Preset("memory-saver", "smallest weights + KV cache: int4 weights (group 32, int8 head that a tied embedding "
               "shares) held to KL <= 0.02 as cpu-fast's are, and an int4 KV cache; decode is not compiled (slower than "
               "cpu-fast)",
               ({"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True,
                              "max_kl": 0.02}},
                {"kvcache": {"kind": "quantized", "bits": 4}})),
        Preset("throughput", "many concurrent requests: the continuous-batching engine on a paged KV cache with "
               "prefix caching, its steps compiled while the recipe is applied (minutes on a small CPU the first "
               "time, over a minute in each later process, which traces the model again: `infopt recipes "
               "throughput` gives the measured times); "
               "lossless (batched kernels sum in another order: greedy output parts only at near-ties)",
               ({"kvcache": {"kind": "paged"}}, {"compile": {"mode": "default"}},
                {"batching": {"max_seqs": 64, "max_batch_tokens": 512}})),
        Preset("gpu-fast", "CUDA: static KV cache + compiled decode step with CUDA graphs (the original weights; fused "
               "kernels)",
               ({"attention": {"backend": "sdpa"}}, {"kvcache": {"kind": "static"}},
                {"compile": {"mode": "reduce-overhead"}})),
    )
}


def available_steps() -> dict[str, list[str | None]]:
    """Registered steps: ``{stage: [kinds]}`` in canonical stage order."""
    return {s: sorted(STEP_TYPES[s], key=lambda k: k or "") for s in STAGES if s in STEP_TYPES}


@dataclass(frozen=True)
class Recipe:
    """An ordered, structurally valid list of steps (plus an optional quality gate).

    Build one with :meth:`parse` from any accepted spelling. Steps are kept in canonical stage
    order (:data:`infopt.core.step.STAGES`), whatever order they were written in.

    Example:
        >>> r = Recipe.parse({"steps": [{"kvcache": {"kind": "static"}}, {"attention": "eager"}]})
        >>> [s.key for s in r.steps]
        ['attention', 'kvcache:static']
        >>> Recipe.from_yaml(r.to_yaml()) == r
        True
    """

    steps: tuple[StepConfig, ...]
    gate: dict[str, float] | None = None
    name: str | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        seen: dict[str, StepConfig] = {}
        for s in self.steps:
            if not isinstance(s, StepConfig):
                raise RecipeError(f"recipe steps must be step configs, got {type(s).__name__}: {s!r}")
            if s.stage in seen:
                raise RecipeError(
                    f"duplicate step: {seen[s.stage].key} and {s.key} are both '{s.stage}' steps; a recipe has at "
                    "most one step per stage. Keep one of them"
                )
            seen[s.stage] = s
        order = {st: i for i, st in enumerate(STAGES)}
        object.__setattr__(self, "steps", tuple(sorted(self.steps, key=lambda s: order[s.stage])))
        if self.gate is not None:
            check_gate(self.gate)
        check_rules(self.steps)

    # -- parsing ---------------------------------------------------------------------------
    @classmethod
    def parse(cls, obj: Any) -> Recipe:
        """Accept a :class:`Recipe`, a step config, a list of configs or dicts, a dict with ``steps``,
        a YAML/JSON file path, or a preset name.

        Raises:
            RecipeError: anything malformed, with the offending part named.
        """
        if isinstance(obj, Recipe):
            return obj
        if isinstance(obj, StepConfig):
            return cls((obj,))
        if isinstance(obj, (str, os.PathLike)):
            return cls._parse_str(obj)
        if isinstance(obj, dict):
            if "steps" not in obj:
                if len(obj) == 1 and next(iter(obj)) in STAGES:
                    return cls((StepConfig.from_dict(obj),))
                hints = "".join(dict.fromkeys(did_you_mean(k, ("steps", *STAGES)) for k in obj))
                raise RecipeError(
                    "a recipe mapping needs a 'steps' list, e.g. {'steps': [{'quantize': {'method': 'int8'}}]}; "
                    f"got keys {sorted(obj, key=str)}.{hints}".rstrip(".")
                )
            keys = ("steps", "gate", "name", "description")
            unknown = sorted(set(obj) - set(keys), key=str)
            if unknown:
                hints = "".join(did_you_mean(k, keys) for k in unknown)
                raise RecipeError(f"unknown recipe key(s) {unknown}; allowed: {', '.join(keys)}.{hints}".rstrip("."))
            steps = obj["steps"]
            if not isinstance(steps, list):
                raise RecipeError(f"recipe 'steps' must be a list, got {type(steps).__name__}")
            return cls(tuple(cls._step(s, i) for i, s in enumerate(steps)), gate=obj.get("gate"), name=obj.get("name"))
        if isinstance(obj, (list, tuple)):
            return cls(tuple(cls._step(s, i) for i, s in enumerate(obj)))
        raise RecipeError(
            f"cannot read a recipe from {type(obj).__name__}; pass step configs, a dict with 'steps', "
            f"a YAML/JSON path, or a preset name ({', '.join(PRESETS)})"
        )

    @staticmethod
    def _step(s: Any, i: int) -> StepConfig:
        if isinstance(s, StepConfig):
            return s
        try:
            return StepConfig.from_dict(s)
        except RecipeError as e:  # same class (an UnknownFieldError stays one), with the step's place
            raise type(e)(f"step {i + 1}: {e}") from None

    @classmethod
    def _parse_str(cls, s: str | os.PathLike) -> Recipe:
        text = str(s)
        if text in PRESETS:
            p = PRESETS[text]
            return cls(tuple(StepConfig.from_dict(d) for d in p.steps), name=p.name, source=f"preset {p.name}")
        path = Path(text)
        if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
            if not path.is_file():
                raise RecipeError(f"recipe file '{path}' does not exist")
            # a .json file is read as JSON, so its errors are JSON's (YAML would read it too, and blame YAML)
            read = cls.from_json if path.suffix.lower() == ".json" else cls.from_yaml
            try:
                r = read(path.read_text())
            except RecipeError as e:
                raise RecipeError(f"recipe file '{path}': {e}") from None
            return Recipe(r.steps, gate=r.gate, name=r.name or path.stem, source=str(path))
        raise RecipeError(
            f"'{text}' is neither a preset ({', '.join(PRESETS)}) nor a .yaml/.json recipe file."
            f"{did_you_mean(text, PRESETS)} Run `infopt recipes` to list presets"
        )

    @classmethod
    def from_yaml(cls, text: str) -> Recipe:
        """Parse YAML (or JSON) text.

        Raises:
            RecipeError: malformed YAML, with the line and column.
        """
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise RecipeError(f"malformed recipe YAML{where}: {getattr(e, 'problem', e)}") from None
        if data is None:
            raise RecipeError("the recipe is empty; write at least {steps: [...]}")
        return cls.parse(data)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Parse JSON text (what :meth:`to_json` writes).

        Raises:
            RecipeError: malformed JSON, with the line and column.

        Example:
            >>> Recipe.from_json('{"steps": [{"attention": "eager"}]}').describe()
            'attention'
            >>> Recipe.from_json('{"steps": [}')
            Traceback (most recent call last):
            ...
            infopt.core.errors.RecipeError: malformed recipe JSON at line 1, column 12: Expecting value
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(f"malformed recipe JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        if data is None:
            raise RecipeError('the recipe is empty; write at least {"steps": [...]}')
        return cls.parse(data)

    # -- writing ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.name:
            out["name"] = self.name
        out["steps"] = [s.to_dict() for s in self.steps]
        if self.gate:
            out["gate"] = dict(self.gate)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        return " -> ".join(s.key for s in self.steps) or "(empty)"


_GATE_KEYS = {"max_kl": "mean KL divergence, nats/token", "min_top1": "top-1 agreement, 0..1",
              "max_ppl_ratio": "perplexity / reference perplexity",
              "min_answers": "share of the built-in chat questions answered as the original does, 0..1"}


def check_gate(gate: Any) -> None:
    """Raise :class:`RecipeError` unless ``gate`` maps known keys to numbers in their range.

    ``max_kl`` is a non-negative number, ``min_top1`` a fraction in [0, 1] and ``max_ppl_ratio`` a ratio >= 1
    (below 1 the optimized model would have to beat the original). Checked before the model is touched, so a
    gate no model can pass fails here rather than after optimizing.

    Raises:
        RecipeError: not a mapping, an unknown key (with a "did you mean"), a value that is not a number or is
            out of its range (with the likely intended value for percentages).

    Example:
        >>> check_gate({"max_kl": 0.01, "min_top1": 0.98})
        >>> check_gate({"min_top1": 98})
        Traceback (most recent call last):
        ...
        infopt.core.errors.RecipeError: gate min_top1=98 is out of range: top-1 agreement is a fraction ... 0.98?
    """
    if not isinstance(gate, dict):
        raise RecipeError(f"gate must be a mapping like {{max_kl: 0.01, min_top1: 0.98}}, got {gate!r}")
    for k, v in gate.items():
        if k not in _GATE_KEYS:
            allowed = ", ".join(f"{a} ({b})" for a, b in _GATE_KEYS.items())
            raise RecipeError(f"unknown gate key {k!r}; allowed: {allowed}.{did_you_mean(k, _GATE_KEYS)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            raise RecipeError(f"gate {k}={v!r} must be a number ({_GATE_KEYS[k]})")
        if k == "max_kl" and v < 0:
            raise RecipeError(f"gate max_kl={v!r} is out of range: a KL divergence is >= 0 (e.g. max_kl: 0.01)")
        if k == "min_top1" and not 0 <= v <= 1:
            hint = f" Did you mean {v / 100:g}?" if 1 < v <= 100 else ""
            raise RecipeError(f"gate min_top1={v!r} is out of range: top-1 agreement is a fraction from 0 to 1.{hint}")
        if k == "min_answers" and not 0 <= v <= 1:
            hint = f" Did you mean {v / 100:g}?" if 1 < v <= 100 else ""
            raise RecipeError(f"gate min_answers={v!r} is out of range: the share of identical chat answers is a "
                              f"fraction from 0 to 1 (0.75: six of the eight built-in questions).{hint}")
        if k == "max_ppl_ratio" and v < 1:
            hint = f" Did you mean {1 + v:g}?" if 0 < v < 0.5 else ""
            raise RecipeError(f"gate max_ppl_ratio={v!r} is out of range: it is optimized / original perplexity, so "
                              f"below 1 no model passes it reliably; 1.02 allows 2% higher perplexity.{hint}")
