"""``optimize(model, recipe)``: validate a whole recipe, apply its steps in canonical order, report, undo."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from .core.availability import require
from .core.errors import IncompatibleModelError, InfoptError, QualityGateError, RecipeError
from .core.introspect import inspect_model, param_bytes
from .core.patch import get_handle, set_attr
from .core.patch import undo as _undo_patches
from .core.save_hook import install_save_hook
from .core.step import TRANSFORMS, ApplyContext, StepConfig
from .generate import decoder_for, routing_stats, tensors_bytes
from .models import load_default_tokenizer
from .recipe import PRESETS, Recipe, check_gate, check_rules

__all__ = ["optimize", "undo", "validate", "explain", "resident_bytes", "OptimizationReport", "StepReport"]


@dataclass
class StepReport:
    """What one applied step did."""

    key: str
    config: dict[str, Any]
    seconds: float
    notes: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def _gate_text(figures: dict[str, Any]) -> str:
    """The gate's figures on one line, the decode path's as ``decode_path.kl=...``.

    Example:
        >>> _gate_text({"kl": 0.00312, "top1": 0.97, "decode_path": {"kl": 0.0034, "tokens": 32}})
        'kl=0.00312, top1=0.97, decode_path.kl=0.0034, decode_path.tokens=32'
    """
    flat = {}
    for k, v in figures.items():
        flat.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    return ", ".join(f"{k}={v:.4g}" for k, v in flat.items())


@dataclass
class OptimizationReport:
    """Attached to an optimized model as ``model.infopt``.

    Attributes:
        steps: one :class:`StepReport` per applied step, in the order applied.
        memory_before / memory_after: parameter + buffer bytes before the first and after the last step.
        gate: the quality figures measured when a gate was given: :func:`infopt.eval.compare`'s (``kl``,
            ``top1``, ...), ``decode_path`` (:func:`infopt.eval.decode_path_compare`'s, for a ``max_kl`` or
            ``min_top1`` limit) and ``answers`` (for ``min_answers``).
    """

    model: Any = field(repr=False, compare=False)
    steps: list[StepReport] = field(default_factory=list)
    memory_before: int = 0
    memory_after: int = 0
    gate: dict[str, Any] | None = None
    rss_before: int | None = None
    rss_after: int | None = None

    @property
    def resident(self) -> dict[str, int]:
        """Bytes the optimized model holds now, by what they are (:func:`resident_bytes`): its weights and buffers,
        prepacked linear copies, a speculative draft, KV caches kept between calls. Read live: a cache grows
        with the calls."""
        return resident_bytes(self.model)

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
            "resident": self.resident,
            "rss_before": self.rss_before,
            "rss_after": self.rss_after,
            "fallbacks": self.fallbacks,
            "routing": self.routing,
            "gate": self.gate,
        }

    def __str__(self) -> str:
        lines = ["infopt report", f"  {'step':<22} {'seconds':>8}  notes"]
        for s in self.steps:
            lines.append(f"  {s.key:<22} {s.seconds:>8.2f}  {'; '.join(s.notes)}")
        mb = 2**20
        parts = self.resident
        lines.append(f"  resident: {sum(parts.values()) / mb:.1f} MiB (weights and buffers before: "
                     f"{self.memory_before / mb:.1f} MiB)")
        lines += [f"    {k:<40} {v / mb:>9.1f} MiB" for k, v in parts.items()]
        if self.rss_before is not None and self.rss_after is not None:
            lines.append(f"  process memory (RSS) while applying: {self.rss_before / mb:.0f} -> {self.rss_after / mb:.0f} "
                         "MiB (also counts compiled code, compiler caches, and a checkpoint's memory-mapped pages "
                         "still mapped)")
        if self.fallbacks:
            lines.append("  fallbacks: " + "; ".join(self.fallbacks))
        r = self.routing
        if r["infopt"] or r["original"]:
            lines.append(f"  generate calls: {r['infopt']} infopt, {r['original']} original {r['reasons'] or ''}")
        if self.gate:
            lines.append("  quality gate: " + _gate_text(self.gate))
        return "\n".join(lines)

    def _summary_rows(self) -> list[tuple[str, str]]:
        """The lines under the step table, as ``(label, value)`` pairs, for the notebook reprs."""
        mb = 2**20
        parts = self.resident
        rows = [("resident", f"{sum(parts.values()) / mb:.1f} MiB (weights and buffers before: "
                             f"{self.memory_before / mb:.1f} MiB): "
                 + ", ".join(f"{k} {v / mb:.1f} MiB" for k, v in parts.items()))]
        r = self.routing
        if r["infopt"] or r["original"]:
            reasons = ", ".join(f"{k}: {v}" for k, v in (r["reasons"] or {}).items())
            rows.append(("generate calls", f"{r['infopt']} infopt, {r['original']} original"
                         + (f" ({reasons})" if reasons else "")))
        if self.gate:
            rows.append(("quality gate", _gate_text(self.gate)))
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


def process_rss() -> int | None:
    """This process's resident memory in bytes (Linux ``/proc/self/statm``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """What an optimized model holds in memory, by what it is, each storage counted once: ``weights and buffers``
    (its parameters and buffers), ``prepacked linear copies`` (oneDNN's packed weights beside the originals), and
    what the decoder's parts keep between calls (a speculative draft model, a static KV cache, a paged or engine KV
    pool). Compiled code and Python objects are not counted.

    Example:
        >>> import infopt, torch
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [{"kvcache": "static"}])
        >>> list(resident_bytes(m))
        ['weights and buffers']
        >>> _ = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
        >>> list(resident_bytes(m))
        ['weights and buffers', 'static KV cache (kept for the next call)']
    """
    seen: set = set()
    out = {"weights and buffers": tensors_bytes([*model.parameters(), *model.buffers()], seen)}
    dec = decoder_for(model)
    parts = [p for p in (getattr(dec, "speculative", None), getattr(dec, "cache", None),
                         getattr(dec, "engine", None)) if p is not None]
    modules = list(model.modules())
    draft = getattr(getattr(parts[0], "drafter", None), "draft", None) if parts else None
    if isinstance(draft, nn.Module):
        modules += list(draft.modules())
    packed = [m for m in modules if "_infopt_packed" in m.__dict__]
    packed += [g for m in modules if getattr(g := m.__dict__.get("_infopt_fused"), "packed", None) is not None]
    if packed:
        from .compile.packed import packed_bytes

        out["prepacked linear copies"] = packed_bytes(list({id(x): x for x in packed}.values()))
    for part in parts:
        for k, v in part.resident(seen).items():
            out[k] = out.get(k, 0) + v
    return {k: v for k, v in out.items() if v or k == "weights and buffers"}


def _existing_report(model: nn.Module) -> OptimizationReport | None:
    rep = model.__dict__.get("infopt")
    return rep if isinstance(rep, OptimizationReport) else None


def _check_materialized(model: nn.Module) -> None:
    """Raise :class:`IncompatibleModelError` when some of the model's tensors hold no data: on the meta device
    (built under ``torch.device("meta")``, ``init_empty_weights``, or offloaded by accelerate) or lazy
    (``nn.LazyLinear`` before its first forward). Steps would otherwise fail midway with torch's own errors."""
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
            Measured against the model's own logits from before the recipe was applied. ``min_answers`` (0..1) also
            asks that share of the built-in chat questions (:data:`infopt.eval.CHAT_PROMPTS`) be answered as the
            original answers them (greedy, 32 tokens; the tokenizer needs a chat template).
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
    reference = path_reference = None
    answers = chat_tokenizer = None
    if gate:
        from . import eval as ev

        reference = ev.reference_logits(model, text=gate_text, tokenizer=tokenizer)
        if {"max_kl", "min_top1"} & gate.keys():  # and along the decode path, which a compiled step may compute
            # otherwise than the whole-sequence forward above
            path_reference = ev.decode_path_reference(model, reference.input_ids)
        if "min_answers" in gate:  # the original's greedy answers to the built-in chat questions, before any change
            # the given tokenizer, else the embedded default model's (which suits only models sharing its vocabulary
            # and chat template)
            chat_tokenizer = tokenizer if tokenizer is not None else load_default_tokenizer()
            answers = ev.reference_answers(model, chat_tokenizer)

    handle = get_handle(model)
    mark = len(handle.records)
    report = _existing_report(model)
    new_report = report is None
    rss = process_rss()
    if new_report:
        report = OptimizationReport(model=model, memory_before=param_bytes(model), rss_before=rss)
    applied: list[StepReport] = []
    after: list = []  # run once every step is applied (a compile warm-up through the final decode loop)
    owners: list[int] = []  # the applied step that queued each of ``after``: its seconds include that work
    try:
        for step in r.steps:
            ctx = ApplyContext(info=info, steps=r.steps, fallbacks=list(fallbacks.get(step.key, [])),
                               tokenizer=tokenizer, calibration=calibration, rebuild=rebuild, after=after)
            t0 = time.perf_counter()
            TRANSFORMS[type(step)](model, step, ctx)
            applied.append(StepReport(step.key, (ctx.config or step).to_dict(), time.perf_counter() - t0, ctx.notes,
                                      ctx.fallbacks, ctx.stats))
            owners += [len(applied) - 1] * (len(after) - len(owners))
        for fn, owner in zip(after, owners, strict=True):
            t0 = time.perf_counter()
            fn()
            applied[owner].seconds += time.perf_counter() - t0
    except BaseException:
        for rec in reversed(handle.records[mark:]):
            rec.revert()
        del handle.records[mark:]
        raise
    report.steps.extend(applied)
    report.memory_after = param_bytes(model)
    report.rss_after = process_rss()
    if new_report:
        set_attr(model, model, "infopt", report, step="optimize")
        if callable(getattr(model, "save_pretrained", None)):
            install_save_hook(model)

    if gate:
        from . import eval as ev

        figures = ev.compare(model, reference)
        if path_reference is not None:
            figures["decode_path"] = ev.decode_path_compare(model, path_reference)
        if answers is not None:
            agreement = ev.answer_agreement(model, chat_tokenizer, answers)
            figures["answers"] = agreement.rate
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


def explain(model: nn.Module, recipe: Any) -> str:
    """The plan :func:`optimize` would carry out for ``recipe`` on ``model``, as text, changing nothing.

    The recipe is validated against the model exactly as :func:`validate` does (``optimize`` runs the same checks
    first), then described: the steps in the canonical order they run, each step's fields (with the default where a
    value differs from it) and the fallbacks it will take on this model, the quality gate, and steps an earlier
    ``optimize`` already applied. ``infopt optimize ... --dry-run`` prints this text.

    Args:
        model: a transformers causal LM; it is only read.
        recipe: anything :func:`optimize` accepts (step configs, a mapping, a YAML/JSON path, a preset name).

    Returns:
        The plan, several lines, without a trailing newline.

    Raises:
        RecipeError, IncompatibleModelError, MissingBackendError: what :func:`validate` raises, for the same
            problems.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> print(infopt.explain(tiny_model(), [infopt.kvcache.Static(max_length=64)]))  # doctest: +ELLIPSIS
        plan for LlamaForCausalLM (llama, 2 layers, hidden 64, torch.float32, cpu): 1 step, in the order they run
          1. kvcache:static  (Static; lossless)
               max_length = 64  (default None)
               batch_size = None
               dtype = None
               fallbacks: none
        ...
    """
    r, fallbacks, info = _validate(model, recipe)
    where = f"{type(model).__name__} ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size}, " \
            f"{info.dtype}, {info.device.type})"
    head = f"plan for {where}: {len(r.steps)} step{'s' if len(r.steps) != 1 else ''}, in the order they run"
    lines = [head if r.source is None else f"{r.source}: {head}"]  # "preset cpu-fast: ...", "r.yaml: ..."
    for i, step in enumerate(r.steps, 1):
        lines.append(f"  {i}. {step.key}  ({type(step).__name__}; {step.fidelity})")
        defaults = _defaults(type(step))
        rows = [(f.name, getattr(step, f.name), defaults.get(f.name, _NO_DEFAULT)) for f in dataclasses.fields(step)]
        width = max((len(n) for n, _, _ in rows), default=0)
        for fname, value, default in rows:
            note = "" if default is _NO_DEFAULT or _same(value, default) else f"  (default {_show(default)})"
            lines.append(f"       {fname:<{width}} = {_show(value)}{note}")
        taken = fallbacks.get(step.key) or []
        lines.append("       fallbacks: " + ("; ".join(taken) if taken else "none"))
    gate = r.gate
    lines.append("  quality gate: " + (", ".join(f"{k} {v}" for k, v in gate.items()) if gate else "none"))
    prior = _existing_report(model)
    if prior is not None and prior.steps:
        lines.append("  already applied to this model: " + ", ".join(s.key for s in prior.steps)
                     + " (this recipe's steps are added to them)")
    lines.append("Nothing was changed. infopt.optimize(model, recipe) applies this plan; "
                 "infopt.undo(model) reverts it.")
    return "\n".join(lines)


_NO_DEFAULT = object()


def _defaults(cls: type[StepConfig]) -> dict[str, Any]:
    """Each field's default as the config holds it: read from a default-built config, so a default its
    ``__post_init__`` turns into a config (``SelfDraft.quantize="int4"``) compares with the built value; the
    declared defaults for a class that needs some field set (``Parallel``)."""
    try:
        built = cls()
    except (InfoptError, TypeError):
        built = None
    out = {}
    for f in dataclasses.fields(cls):
        if built is not None:
            out[f.name] = getattr(built, f.name)
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except (RuntimeError, TypeError, ValueError):  # a tensor compares element-wise: call it different
        return False


def _show(value: Any) -> str:
    """A field value as the plan shows it: a module by its class (its repr is the whole network)."""
    if isinstance(value, nn.Module):
        return f"<{type(value).__name__} module>"
    if isinstance(value, StepConfig):  # a nested config (a self-draft's quantize step): the fields it sets
        defaults = _defaults(type(value))
        set_ = [f"{f.name}={_show(getattr(value, f.name))}" for f in dataclasses.fields(value)
                if not _same(getattr(value, f.name), defaults.get(f.name, _NO_DEFAULT))]
        return f"{type(value).__name__}({', '.join(set_)})"
    return repr(value)

