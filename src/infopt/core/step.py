"""Step configs and the flat registries that map a config type to its transform.

A step is a frozen dataclass subclassing :class:`StepConfig`. It names its recipe ``stage``
(and, for stages with several kinds, the ``kind`` and the recipe field that selects it), validates
its fields in ``__post_init__``, and round-trips through ``to_dict``/``from_dict``. The function that
applies it is registered beside it with :func:`register_transform`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from .errors import RecipeError, UnknownFieldError, did_you_mean
from .introspect import ModelInfo

__all__ = [
    "STAGES",
    "FIDELITY",
    "StepConfig",
    "ApplyContext",
    "STEP_TYPES",
    "TRANSFORMS",
    "register_step",
    "register_transform",
    "step_class",
    "bad_field",
    "unknown_fields",
    "describe_fields",
]

STAGES: tuple[str, ...] = ("attention", "quantize", "parallel", "kvcache", "compile", "speculative", "batching")

FIDELITY: tuple[str, ...] = ("exact", "lossless", "lossy")
"""What a step keeps of the model's numbers, strongest first (:attr:`StepConfig.fidelity`)."""
"""Canonical order in which :func:`infopt.optimize` applies steps, whatever order a recipe lists them."""

# stage -> kind (None for single-kind stages) -> config class
STEP_TYPES: dict[str, dict[str | None, type[StepConfig]]] = {}
# config class -> transform(model, config, ctx)
TRANSFORMS: dict[type[StepConfig], Callable[[nn.Module, StepConfig, ApplyContext], None]] = {}


def bad_field(cls_or_obj: Any, name: str, value: Any, allowed: str) -> RecipeError:
    """Build the error for an invalid config field: names the config, the field, the value and what is allowed.

    When the value's type does not fit the field's annotation (``group_size: "32"`` for an ``int`` field),
    the message says so first, since "allowed: 32, 64" alone reads as if 32 were refused. A misspelt
    choice among the allowed names gets a "did you mean".

    Args:
        cls_or_obj: the config class or instance.
        name: the field.
        value: the value refused.
        allowed: what the field accepts, in words or as a comma-separated list.

    Returns:
        The :class:`RecipeError` to raise.

    Example:
        >>> from infopt.quantize import Int4WeightOnly
        >>> str(bad_field(Int4WeightOnly, "group_size", "32", "32, 64, 128, 256"))  # doctest: +NORMALIZE_WHITESPACE
        "Int4WeightOnly.group_size='32' is invalid: it must be an integer, got the string '32' (write it without
        quotes); allowed: 32, 64, 128, 256"
    """
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    head = f"{cls.__name__}.{name}={value!r} is invalid"
    wanted = _type_mismatch(cls, name, value)
    if wanted is not None:
        unquote = " (write it without quotes)" if isinstance(value, str) and _parses_as(value, wanted[1]) else ""
        return RecipeError(f"{head}: it must be {wanted[0]}, got {_describe_value(value)}{unquote}; allowed: {allowed}")
    choices = [c.strip() for c in re.split(r",|\bor\b", allowed) if re.fullmatch(r"\s*[\w.\-]+\s*", c)]
    hint = did_you_mean(value, choices)
    return RecipeError(f"{head}; allowed: {allowed}" + (f".{hint}" if hint else ""))


# annotation type -> how a message names it
_TYPE_WORDS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                                 type(None): "null", tuple: "a list", list: "a list", dict: "a mapping"}


def _hint_types(hint: Any) -> tuple[type, ...] | None:
    """The runtime types an annotation admits, in its order, or None when any value may fit (``Any``, unknown forms)."""
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        out: list[type] = []
        for a in typing.get_args(hint):
            t = _hint_types(a)
            if t is None:
                return None
            out += [x for x in t if x not in out]
        return tuple(out)
    if origin is typing.Literal:
        return tuple(dict.fromkeys(type(a) for a in typing.get_args(hint)))
    if origin is not None:
        return (origin,) if isinstance(origin, type) else None
    if hint is None or hint is type(None):
        return (type(None),)
    return (hint,) if isinstance(hint, type) else None


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to isinstance, never to a recipe
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    if isinstance(value, (list, tuple)) and (list in allowed or tuple in allowed):
        return True
    return any(isinstance(value, t) for t in allowed if t is not bool)


def _type_mismatch(cls: type, name: str, value: Any) -> tuple[str, tuple[type, ...]] | None:
    """``(words, types)`` the field's annotation admits when ``value`` is of none of them, else None."""
    try:
        hint = typing.get_type_hints(cls).get(name)
    except (NameError, TypeError):  # an annotation only a type checker can resolve: no type to compare with
        return None
    allowed = _hint_types(hint) if hint is not None else None
    if not allowed or _fits(value, allowed):
        return None
    words = list(dict.fromkeys(_TYPE_WORDS.get(t, f"a {t.__name__}") for t in allowed))
    return (" or ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " or " + words[-1]), allowed


def _describe_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, (list, tuple)):
        return f"the list {list(value)!r}"
    if isinstance(value, dict):
        return f"the mapping {value!r}"
    return f"a {type(value).__name__}"


def _parses_as(text: str, allowed: tuple[type, ...]) -> bool:
    """True when a string would be a value of ``allowed`` written without quotes (``"32"``, ``"true"``)."""
    if bool in allowed and text.strip().lower() in ("true", "false"):
        return True
    for t in (int, float):
        if t in allowed:
            try:
                t(text)
                return True
            except ValueError:
                pass
    return False


def describe_fields(cls: type[StepConfig]) -> list[tuple[str, str, str]]:
    """``(name, type, default)`` of each field of a step config class, as ``infopt recipes --fields`` prints them.

    Example:
        >>> from infopt.attention import Attention
        >>> describe_fields(Attention)
        [('backend', 'str', "'sdpa'"), ('prompt_dtype', 'str | None', 'None')]
    """
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append((f.name, kind.replace("typing.", ""), default))
    return out


@dataclass(frozen=True)
class StepConfig:
    """Base class of every recipe step.

    Class attributes set by subclasses:
        stage: one of :data:`STAGES`.
        kind: the value selecting this class within its stage (``"int8"``), or None.
        discriminator: the recipe field holding ``kind`` (``"method"`` for quantize).
        fidelity: what the step keeps of the model's numbers, one of :data:`FIDELITY`:

            - ``"exact"``: the same kernels and the same order of operations: bit-identical logits;
            - ``"lossless"``: the same math, but sums may run in another order (fused or batched kernels, another
              attention kernel, several tokens per forward), so logits differ in the last bits and greedy output
              may part from the unoptimized model's only at a near-tie; ``infopt bench`` reports the reference's
              top-2 logit margin at every such divergence (:data:`infopt.bench.divergence.NEAR_TIE`);
            - ``"lossy"``: other numbers (quantized weights, an evicting cache): KL, top-1 and perplexity are
              measured with :mod:`infopt.eval`.

    ``lossless`` (a property) is true for ``exact`` and ``lossless`` steps.
    """

    stage: ClassVar[str] = ""
    kind: ClassVar[str | None] = None
    discriminator: ClassVar[str | None] = None
    fidelity: ClassVar[str] = "lossy"
    removed: ClassVar[dict[str, str]] = {}  # a field an earlier version had -> what to write instead

    @property
    def lossless(self) -> bool:
        """True for an ``exact`` or ``lossless`` step (:attr:`fidelity`)."""
        return self.fidelity in ("exact", "lossless")

    # -- identity -------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """``stage`` or ``stage:kind``; how rules and reports name the step."""
        return self.stage if self.kind is None else f"{self.stage}:{self.kind}"

    # -- serialization ----------------------------------------------------------------------
    def fields_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, StepConfig):
                v = v.to_dict()
            out[f.name] = v
        return out

    def to_dict(self) -> dict[str, Any]:
        """``{stage: {discriminator: kind, **fields}}``, the recipe spelling of this step.

        Example:
            >>> from infopt.attention import Attention
            >>> Attention("eager").to_dict()
            {'attention': {'backend': 'eager', 'prompt_dtype': None}}
        """
        body = {}
        if self.discriminator is not None and self.discriminator not in {f.name for f in dataclasses.fields(self)}:
            body[self.discriminator] = self.kind
        body.update(self.fields_dict())
        return {self.stage: body}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> StepConfig:
        """Build from a flat field dict, with an :class:`~infopt.core.errors.UnknownFieldError` (a
        :class:`RecipeError`) for unknown fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise unknown_fields(cls, unknown)
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in fields.items():
            hint = str(hints.get(k, ""))
            if isinstance(v, list) and "tuple" in hint:
                v = tuple(v)
            kwargs[k] = v
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong types the dataclass itself rejects
            raise RecipeError(f"{cls.__name__}: {e}") from e

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StepConfig:
        """Inverse of :meth:`to_dict`: ``{stage: {...}}`` to the registered config class.

        Raises:
            RecipeError: unknown stage or kind, unknown field, or an invalid value.
        """
        if not isinstance(d, dict) or len(d) != 1:
            raise RecipeError(
                f"a recipe step is a one-key mapping like {{'quantize': {{'method': 'int8'}}}}; got {d!r}"
            )
        (stage, body), = d.items()
        if body is None:
            body = {}
        if isinstance(body, str):  # shorthand: {attention: sdpa}, {quantize: int8}
            kinds = STEP_TYPES.get(stage)
            if kinds is None:
                raise RecipeError(_unknown_stage_msg(stage))
            if None in kinds:
                cls = kinds[None]
                if cls.discriminator is None:
                    raise RecipeError(f"step '{stage}' takes a mapping of fields, got the string {body!r}")
                return cls.from_fields({cls.discriminator: body})
            return step_class(stage, body).from_fields({})
        if not isinstance(body, dict):
            raise RecipeError(f"step '{stage}' must map to a dict of fields, got {type(body).__name__}: {body!r}")
        body = dict(body)
        kinds = STEP_TYPES.get(stage)
        if kinds is None:
            raise RecipeError(_unknown_stage_msg(stage))
        kind = None
        if None not in kinds:
            disc = next(iter(kinds.values())).discriminator
            if disc not in body:
                raise RecipeError(
                    f"step '{stage}' needs '{disc}' (one of: {', '.join(sorted(k for k in kinds if k))})"
                )
            kind = body.pop(disc)
        cls = step_class(stage, kind)
        return cls.from_fields(body)

    # -- validation against a model ------------------------------------------------------------
    def required_backends(self) -> tuple[str, ...]:
        """Import names of optional packages this step needs (checked before anything is applied)."""
        return ()

    def check(self, model: nn.Module, info: ModelInfo, steps: tuple[StepConfig, ...]) -> list[str]:
        """Raise if the step cannot apply to ``model``; return the fallbacks it will take (for the report).

        Args:
            model: the model (not to be mutated here).
            info: its :class:`ModelInfo`.
            steps: the whole recipe, in canonical order.

        Raises:
            IncompatibleModelError: architecture, dtype or device not supported.
        """
        return []


def _unknown_stage_msg(stage: str) -> str:
    known = [s for s in STAGES if s in STEP_TYPES]
    planned = [s for s in STAGES if s not in STEP_TYPES]
    hint = did_you_mean(stage, known)
    msg = f"unknown recipe step '{stage}'. Steps available: {', '.join(known)}" + (f".{hint}" if hint else "")
    if stage in planned:
        msg = f"recipe step '{stage}' is not available in this version of infopt. Steps available: {', '.join(known)}"
    return msg


def step_class(stage: str, kind: str | None) -> type[StepConfig]:
    """The config class registered for ``stage`` (and ``kind``).

    Raises:
        RecipeError: unknown stage or kind, listing what exists.
    """
    kinds = STEP_TYPES.get(stage)
    if kinds is None:
        raise RecipeError(_unknown_stage_msg(stage))
    if kind not in kinds:
        disc = next(iter(kinds.values())).discriminator
        allowed = ", ".join(sorted(str(k) for k in kinds if k is not None))
        hint = did_you_mean(kind, kinds)
        raise RecipeError(f"unknown {stage} {disc} {kind!r}; allowed: {allowed}" + (f".{hint}" if hint else ""))
    return kinds[kind]


def unknown_fields(cls: type[StepConfig], unknown: list[str]) -> UnknownFieldError:
    """The error for fields a step config does not have, worded alike for a constructor and a recipe mapping.

    Args:
        cls: the config class.
        unknown: the field names given that it lacks.

    Returns:
        The :class:`~infopt.core.errors.UnknownFieldError` to raise: it names the class and its recipe key, the
        unknown fields, the allowed ones, the closest match of each, and the command that lists them.

    Example:
        >>> from infopt.kvcache import Static
        >>> str(unknown_fields(Static, ["max_len"]))  # doctest: +NORMALIZE_WHITESPACE
        "Static (kvcache:static) has no field(s) 'max_len'; allowed fields: max_length, batch_size, dtype. Did you mean
        'max_length'? (`infopt recipes --fields kvcache:static` lists them with their defaults)"
    """
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    key = cls.stage if cls.kind is None else f"{cls.stage}:{cls.kind}"
    gone = [u for u in unknown if u in cls.removed]
    if gone:
        return UnknownFieldError(" ".join(f"{key}.{u} was removed: {cls.removed[u]}." for u in gone))
    hints = "".join(did_you_mean(u, names) for u in unknown)
    return UnknownFieldError(
        f"{cls.__name__} ({key}) has no field(s) {', '.join(map(repr, unknown))}; "
        f"allowed fields: {', '.join(names) or '(none)'}.{hints} "
        f"(`infopt recipes --fields {key}` lists them with their defaults)"
    )


def _check_keywords(cls: type[StepConfig]) -> None:
    """Wrap the dataclass ``__init__`` of ``cls`` so a misspelt keyword raises :func:`unknown_fields`' error
    (with a "did you mean") instead of Python's bare ``TypeError``; positional arguments pass through as before.
    Done once here, where every step class is registered, so no config class repeats it."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_infopt_checked", False):
        return
    names = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)  # keeps the signature help() and inspect show
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise unknown_fields(cls, unknown)
        init(self, *args, **kwargs)

    __init__._infopt_checked = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def register_step(cls: type[StepConfig]) -> type[StepConfig]:
    """Class decorator adding a config class to :data:`STEP_TYPES`.

    Apply it above ``@dataclass(frozen=True)``. It also makes the constructor refuse an unknown keyword with an
    :class:`~infopt.core.errors.UnknownFieldError` naming the closest field (``Static(max_len=128)``: "Did you
    mean 'max_length'?"), as a recipe mapping with that field does.

    Raises:
        ValueError: an unknown ``stage``, or a stage and kind another class already registered.
    """
    if cls.stage not in STAGES:
        raise ValueError(f"{cls.__name__}.stage={cls.stage!r}; allowed: {', '.join(STAGES)}")
    kinds = STEP_TYPES.setdefault(cls.stage, {})
    if cls.kind in kinds and kinds[cls.kind] is not cls:
        raise ValueError(f"{cls.stage}:{cls.kind} is registered twice ({kinds[cls.kind].__name__}, {cls.__name__})")
    _check_keywords(cls)
    kinds[cls.kind] = cls
    return cls


def register_transform(config_cls: type[StepConfig]):
    """Decorator registering ``fn(model, config, ctx)`` as the transform for ``config_cls``."""

    def deco(fn):
        TRANSFORMS[config_cls] = fn
        return fn

    return deco


@dataclass
class ApplyContext:
    """What a transform gets besides the model and its config.

    Attributes:
        info: the model's :class:`ModelInfo` at validation time.
        steps: the whole recipe in canonical order (for steps that adapt to their neighbours).
        notes: free-text lines for the report (what was done, bytes saved).
        fallbacks: fallbacks taken, for the report.
        stats: numbers for the report (``{"modules_swapped": 210}``).
        tokenizer: the model's tokenizer when the caller gave one (calibration text, gate text).
        calibration: calibration data the caller gave :func:`infopt.optimize` (token ids or texts),
            for steps that calibrate (GPTQ, AWQ, SmoothQuant); None lets them use their default.
        rebuild: True when a saved model is being rebuilt (:func:`infopt.load_optimized`): steps
            that calibrate only build modules of the right structure, because the saved weights
            are loaded over them.
        after: callables run once every step of the recipe is applied (a compile warm-up that must run
            the decode loop the later steps install), shared by all the recipe's steps.
        config: the step's config as applied, when the transform settled what the recipe left to it (a quantize
            step's ``keep`` entries that hold its ``max_kl``): the report and a saved recipe record this one.
    """

    info: ModelInfo | None = None
    steps: tuple[StepConfig, ...] = ()
    notes: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    calibration: Any = None
    rebuild: bool = False
    after: list = field(default_factory=list)
    config: StepConfig | None = None
