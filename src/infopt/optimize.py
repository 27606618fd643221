"""``optimize(model, recipe)``: validate a whole recipe, apply its steps in canonical order, report, undo."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .core.availability import require
from .core.errors import IncompatibleModelError, QualityGateError, RecipeError
from .core.introspect import inspect_model, param_bytes
from .core.patch import get_handle, set_attr
from .core.patch import undo as _undo_patches
from .core.step import TRANSFORMS, ApplyContext, StepConfig
from .generate import routing_stats
from .recipe import PRESETS, Recipe, check_gate, check_rules

__all__ = ["optimize", "undo", "validate", "OptimizationReport", "StepReport"]


@dataclass
class StepReport:
    """What one applied step did."""

    key: str
    config: dict[str, Any]
    seconds: float
    notes: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizationReport:
    """Attached to an optimized model as ``model.infopt``.

    Attributes:
        steps: one :class:`StepReport` per applied step, in the order applied.
        memory_before / memory_after: parameter + buffer bytes before the first and after the last step.
        gate: the quality figures measured when a gate was given (``kl``, ``top1``, ...).
    """

    model: Any = field(repr=False, compare=False)
    steps: list[StepReport] = field(default_factory=list)
    memory_before: int = 0
    memory_after: int = 0
    gate: dict[str, float] | None = None

    @property
    def routing(self) -> dict[str, Any]:
        """``generate`` calls served by infopt vs handed to the original, with reasons."""
        return routing_stats(self.model).as_dict()

    def applied_steps(self) -> tuple[StepConfig, ...]:
        """The step configs applied so far, in the order applied."""
        return tuple(StepConfig.from_dict(s.config) for s in self.steps)

    @property
    def fallbacks(self) -> list[str]:
        return [f"{s.key}: {f}" for s in self.steps for f in s.fallbacks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.__dict__ for s in self.steps],
            "memory_before": self.memory_before,
            "memory_after": self.memory_after,
            "fallbacks": self.fallbacks,
            "routing": self.routing,
            "gate": self.gate,
        }

    def __str__(self) -> str:
        lines = ["infopt report", f"  {'step':<22} {'seconds':>8}  notes"]
        for s in self.steps:
            lines.append(f"  {s.key:<22} {s.seconds:>8.2f}  {'; '.join(s.notes)}")
        mb = 2**20
        lines.append(f"  parameters+buffers: {self.memory_before / mb:.1f} MiB -> {self.memory_after / mb:.1f} MiB")
        if self.fallbacks:
            lines.append("  fallbacks: " + "; ".join(self.fallbacks))
        r = self.routing
        if r["infopt"] or r["original"]:
            lines.append(f"  generate calls: {r['infopt']} infopt, {r['original']} original {r['reasons'] or ''}")
        if self.gate:
            lines.append("  quality gate: " + ", ".join(f"{k}={v:.4g}" for k, v in self.gate.items()))
        return "\n".join(lines)

    def _summary_rows(self) -> list[tuple[str, str]]:
        """The lines under the step table, as ``(label, value)`` pairs, for the notebook reprs."""
        mb = 2**20
        rows = [("parameters + buffers", f"{self.memory_before / mb:.1f} MiB -> {self.memory_after / mb:.1f} MiB")]
        r = self.routing
        if r["infopt"] or r["original"]:
            reasons = ", ".join(f"{k}: {v}" for k, v in (r["reasons"] or {}).items())
            rows.append(("generate calls", f"{r['infopt']} infopt, {r['original']} original"
                         + (f" ({reasons})" if reasons else "")))
        if self.gate:
            rows.append(("quality gate", ", ".join(f"{k}={v:.4g}" for k, v in self.gate.items())))
        return rows

    def _repr_html_(self) -> str:
        """The report as an HTML table, which Jupyter shows for ``model.infopt``."""
        from html import escape

        cells = "".join(
            f"<tr><td><code>{escape(s.key)}</code></td><td style='text-align:right'>{s.seconds:.2f}</td>"
            f"<td style='text-align:left'>{escape('; '.join(s.notes))}</td>"
            f"<td style='text-align:left'>{escape('; '.join(s.fallbacks)) or '-'}</td></tr>"
            for s in self.steps)
        summary = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td colspan='3' style='text-align:left'>"
                          f"{escape(v)}</td></tr>" for k, v in self._summary_rows())
        return ("<table><caption style='text-align:left'><b>infopt report</b></caption>"
                "<thead><tr><th>step</th><th>seconds</th><th>notes</th><th>fallbacks</th></tr></thead>"
                f"<tbody>{cells}{summary}</tbody></table>")

    def _repr_markdown_(self) -> str:
        """The report as a Markdown table (for front ends that render Markdown rather than HTML)."""

        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", " ") or "-"

        lines = ["**infopt report**", "", "| step | seconds | notes | fallbacks |", "|---|---:|---|---|"]
        lines += [f"| `{s.key}` | {s.seconds:.2f} | {cell('; '.join(s.notes))} | {cell('; '.join(s.fallbacks))} |"
                  for s in self.steps]
        lines += [""] + [f"- {k}: {cell(v)}" for k, v in self._summary_rows()]
        return "\n".join(lines)


def _existing_report(model: nn.Module) -> OptimizationReport | None:
    rep = model.__dict__.get("infopt")
    return rep if isinstance(rep, OptimizationReport) else None


def _check_materialized(model: nn.Module) -> None:
    """Raise :class:`IncompatibleModelError` when some of the model's tensors hold no data: on the meta device
    (built under ``torch.device("meta")``, ``init_empty_weights``, or offloaded by accelerate) or lazy
    (``nn.LazyLinear`` before its first forward). Steps would otherwise fail midway with torch's own errors."""
    from torch.nn.parameter import is_lazy

    empty = [(n, "lazy" if is_lazy(t) else "meta") for n, t in _named_tensors(model) if is_lazy(t) or t.is_meta]
    if not empty:
        return
    names = ", ".join(n for n, _ in empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
    if any(kind == "meta" for _, kind in empty):
        offloaded = any(hasattr(m, "_hf_hook") for m in model.modules())
        why = ("accelerate offloaded them (a device_map with 'cpu'/'disk' offload keeps weights off the model)"
               if offloaded else "the model was built without weights (under torch.device('meta') or "
               "init_empty_weights)")
        raise IncompatibleModelError(
            f"{len(empty)} of the model's tensors are on the meta device ({names}): {why}, so they hold no data to "
            "optimize. Load the weights first, e.g. AutoModelForCausalLM.from_pretrained(path) without an offloading "
            "device_map, or model.to_empty(device='cpu') then model.load_state_dict(...). Nothing was changed"
        )
    raise IncompatibleModelError(
        f"{len(empty)} of the model's tensors are not materialised yet ({names}: lazy modules get their shape on the "
        "first forward). Run one forward pass first, e.g. model(input_ids). Nothing was changed"
    )


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=True)
    yield from model.named_buffers(remove_duplicate=True)


def validate(model: nn.Module, recipe: Any) -> tuple[Recipe, dict[str, list[str]]]:
    """Check a recipe against a model without changing anything.

    Returns:
        ``(recipe, fallbacks)``: the parsed :class:`Recipe` and, per step key, the fallbacks it will take.

    Raises:
        RecipeError, IncompatibleModelError, MissingBackendError: the first problem found.
    """
    r, fallbacks, _ = _validate(model, recipe)
    return r, fallbacks


def _validate(model: nn.Module, recipe: Any):
    """:func:`validate`, also returning the :class:`~infopt.core.introspect.ModelInfo` it read."""
    r = Recipe.parse(recipe)
    if not r.steps:
        raise RecipeError(
            "the recipe has no steps, so there is nothing to apply (the model is left as it is). Give steps, e.g. "
            "[infopt.quantize.Int8WeightOnly()] or {'steps': [{'quantize': {'method': 'int8'}}]}, or a preset name "
            f"({', '.join(PRESETS)}); `infopt recipes --fields` lists every step. To measure the model as it is, "
            "use infopt.eval.evaluate"
        )
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise IncompatibleModelError(
            f"optimize() needs a transformers causal LM (AutoModelForCausalLM), got {type(model).__name__}"
        )
    _check_materialized(model)
    info = inspect_model(model)
    prior = _existing_report(model)
    if prior is not None:
        done = {s.key.split(":")[0]: s.key for s in prior.steps}
        again = [s.key for s in r.steps if s.stage in done]
        if again:
            raise RecipeError(
                f"the model already has {', '.join(done[k.split(':')[0]] for k in again)} applied; "
                "call infopt.undo(model) first, then optimize with the full recipe"
            )
        check_rules(prior.applied_steps() + r.steps)
    fallbacks: dict[str, list[str]] = {}
    for step in r.steps:
        if type(step) not in TRANSFORMS:
            raise RecipeError(f"step {step.key} has no registered transform (internal error; please report it)")
        for mod in step.required_backends():
            require(mod, feature=f"recipe step {step.key}")
    for step in r.steps:
        try:
            fallbacks[step.key] = list(step.check(model, info, r.steps))
        except IncompatibleModelError as e:
            if r.source != f"preset {r.name}":
                raise
            # a preset's user did not write the step that failed: name the preset and the ones that apply here
            fits = [name for name in PRESETS if name != r.name and _preset_fits(model, info, name)]
            raise IncompatibleModelError(
                f"preset '{r.name}' does not apply to this model ({info.device.type}): {e}. "
                f"Presets that apply to it: {', '.join(fits) or 'none'}"
            ) from None
    return r, fallbacks, info


def _preset_fits(model: nn.Module, info, name: str) -> bool:
    """True when every step of preset ``name`` passes its checks on ``model`` (nothing is changed)."""
    from .core.errors import InfoptError

    steps = Recipe.parse(name).steps
    try:
        for step in steps:
            step.check(model, info, steps)
    except InfoptError:
        return False
    return True


def optimize(model: nn.Module, recipe: Any, *, gate: dict[str, float] | None = None, gate_text: str | None = None,
             tokenizer=None, calibration=None, rebuild: bool = False):
    """Apply a recipe to ``model`` in place and return the same object.

    The whole recipe is validated first (structure, composition rules, architecture, device,
    dtype, optional backends); any problem raises before the model is touched. Steps then run in
    canonical stage order. If a step fails midway, the changes this call made are rolled back.

    Args:
        model: a transformers causal LM.
        recipe: step configs, a dict ``{"steps": [...]}``, a YAML/JSON path, or a preset name.
        gate: quality limits (``{"max_kl": 0.01, "min_top1": 0.98}``), overriding the recipe's own gate.
            Measured against the model's own logits from before the recipe was applied.
        gate_text: text to measure the gate on (default: :func:`infopt.eval.default_text`).
        tokenizer: the model's tokenizer, used to encode ``gate_text`` and text calibration data
            (default: the embedded default model's tokenizer, which only suits models sharing its vocabulary).
        calibration: data for steps that calibrate (GPTQ, AWQ, SmoothQuant): token ids ``[n, seq]``,
            a list of id tensors, or a list of strings (encoded with ``tokenizer``). None: each step's
            default (Python's documentation text, a slice disjoint from the one :mod:`infopt.eval` scores).
        rebuild: used by :func:`infopt.load_optimized`: calibrating steps build modules of the right
            structure without calibrating, because saved weights are loaded over them.

    Returns:
        The same model, with a report at ``model.infopt``.

    Raises:
        RecipeError, IncompatibleModelError, MissingBackendError: validation failed; model untouched.
        QualityGateError: the optimized model missed the gate; it stays optimized (``infopt.undo`` reverts).

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), "cpu-lossless")
        >>> [s.key for s in m.infopt.steps]
        ['kvcache:static', 'compile', 'speculative:self_draft']
        >>> infopt.undo(m)  # generate's wrapper and decoder, its cache, forwards and speculative parts, the drafter,
        ...                 # the attention backend, the fused projections, the packed head, the report and the save hook
        11
    """
    if gate is not None:
        check_gate(gate)
    r, fallbacks, info = _validate(model, recipe)
    gate = gate if gate is not None else r.gate
    reference = None
    if gate:
        from . import eval as ev

        reference = ev.reference_logits(model, text=gate_text, tokenizer=tokenizer)

    handle = get_handle(model)
    mark = len(handle.records)
    report = _existing_report(model)
    new_report = report is None
    if new_report:
        report = OptimizationReport(model=model, memory_before=param_bytes(model))
    applied: list[StepReport] = []
    after: list = []  # run once every step is applied (a compile warm-up through the final decode loop)
    try:
        for step in r.steps:
            ctx = ApplyContext(info=info, steps=r.steps, fallbacks=list(fallbacks.get(step.key, [])),
                               tokenizer=tokenizer, calibration=calibration, rebuild=rebuild, after=after)
            t0 = time.perf_counter()
            TRANSFORMS[type(step)](model, step, ctx)
            applied.append(StepReport(step.key, step.to_dict(), time.perf_counter() - t0, ctx.notes, ctx.fallbacks,
                                      ctx.stats))
        for fn in after:
            fn()
    except BaseException:
        for rec in reversed(handle.records[mark:]):
            rec.revert()
        del handle.records[mark:]
        raise
    report.steps.extend(applied)
    report.memory_after = param_bytes(model)
    if new_report:
        set_attr(model, model, "infopt", report, step="optimize")
        if callable(getattr(model, "save_pretrained", None)):
            from .io import install_save_hook

            install_save_hook(model)

    if gate:
        from . import eval as ev

        figures = ev.compare(model, reference)
        report.gate = figures
        failed = ev.gate_failures(figures, gate)
        if failed:
            raise QualityGateError(
                "quality gate failed: " + "; ".join(failed)
                + ". The model stays optimized: accept it, or call infopt.undo(model) and pick a milder recipe",
                figures=figures,
            )
    return model


def undo(model: nn.Module) -> int:
    """Revert everything infopt did to ``model``: modules, methods, hooks, config values, the report.

    Returns:
        The number of recorded changes reverted.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [infopt.attention.Attention("eager")])
        >>> infopt.undo(m), m.config._attn_implementation  # the backend, the report, the save hook
        (3, 'sdpa')
    """
    return _undo_patches(model)
