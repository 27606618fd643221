"""Step configs and the flat registries that map a config type to its transform.

A step is a frozen dataclass subclassing :class:`StepConfig`. It names its recipe ``stage``
(and, for stages with several kinds, the ``kind`` and the recipe field that selects it), validates
its fields in ``__post_init__``, and round-trips through ``to_dict``/``from_dict``. The function that
applies it is registered beside it with :func:`register_transform`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from .errors import RecipeError
from .introspect import ModelInfo

__all__ = [
    "STAGES",
    "StepConfig",
    "ApplyContext",
    "STEP_TYPES",
    "TRANSFORMS",
    "register_step",
    "register_transform",
    "step_class",
    "bad_field",
]

STAGES: tuple[str, ...] = ("attention", "quantize", "parallel", "kvcache", "compile", "speculative", "batching")
"""Canonical order in which :func:`infopt.optimize` applies steps, whatever order a recipe lists them."""

# stage -> kind (None for single-kind stages) -> config class
STEP_TYPES: dict[str, dict[str | None, type[StepConfig]]] = {}
# config class -> transform(model, config, ctx)
TRANSFORMS: dict[type[StepConfig], Callable[[nn.Module, StepConfig, ApplyContext], None]] = {}


def bad_field(cls_or_obj: Any, name: str, value: Any, allowed: str) -> RecipeError:
    """Build the error for an invalid config field: names the config, the field, the value and what is allowed."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    return RecipeError(f"{cls.__name__}.{name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class StepConfig:
    """Base class of every recipe step.

    Class attributes set by subclasses:
        stage: one of :data:`STAGES`.
        kind: the value selecting this class within its stage (``"int8"``), or None.
        discriminator: the recipe field holding ``kind`` (``"method"`` for quantize).
        lossless: True when the step keeps greedy output token-identical (tests assert it); lossy
            steps are measured with :mod:`infopt.eval` instead.
    """

    stage: ClassVar[str] = ""
    kind: ClassVar[str | None] = None
    discriminator: ClassVar[str | None] = None
    lossless: ClassVar[bool] = False  # greedy output token-identical to the unoptimized model (fp32)

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
            {'attention': {'backend': 'eager'}}
        """
        body = {}
        if self.discriminator is not None and self.discriminator not in {f.name for f in dataclasses.fields(self)}:
            body[self.discriminator] = self.kind
        body.update(self.fields_dict())
        return {self.stage: body}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> StepConfig:
        """Build from a flat field dict, with a :class:`RecipeError` for unknown fields."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise RecipeError(
                f"{cls.__name__} ({cls.stage}) has no field(s) {', '.join(map(repr, unknown))}; "
                f"allowed fields: {', '.join(names) or '(none)'}"
            )
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
    msg = f"unknown recipe step '{stage}'. Steps available: {', '.join(known)}"
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
        raise RecipeError(f"unknown {stage} {disc} {kind!r}; allowed: {allowed}")
    return kinds[kind]


def register_step(cls: type[StepConfig]) -> type[StepConfig]:
    """Class decorator adding a config class to :data:`STEP_TYPES`."""
    if cls.stage not in STAGES:
        raise ValueError(f"{cls.__name__}.stage={cls.stage!r}; allowed: {', '.join(STAGES)}")
    kinds = STEP_TYPES.setdefault(cls.stage, {})
    if cls.kind in kinds and kinds[cls.kind] is not cls:
        raise ValueError(f"{cls.stage}:{cls.kind} is registered twice ({kinds[cls.kind].__name__}, {cls.__name__})")
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
    """

    info: ModelInfo | None = None
    steps: tuple[StepConfig, ...] = ()
    notes: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    calibration: Any = None
    rebuild: bool = False
