"""``infopt.tune``: measure candidate recipes on this machine and keep the fastest one within a quality gate."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from ..core.errors import IncompatibleModelError, InfoptError, MissingBackendError, RecipeError
from ..optimize import optimize, undo, validate
from ..quantize.calibration.cache import weights_fingerprint
from ..recipe import Recipe, check_gate
from .candidates import Candidate, as_candidates, default_candidates, quality_key
from .result import Trial, TuneResult

__all__ = ["tune", "parse_gate", "WORKLOAD_METRIC"]

WORKLOAD_METRIC: dict[str, tuple[str, bool]] = {
    "decode": ("decode_tokens_per_s", True),
    "long": ("decode_tokens_per_s", True),
    "batch": ("tokens_per_s", True),
    "throughput": ("tokens_per_s", True),
    "grounded": ("tokens_per_s", True),
    "prefix": ("tokens_per_s", True),
    "prompt512": ("ttft_p50_ms", False),
}
"""The figure the tuner ranks candidates by, per workload, and whether higher is better."""


def parse_gate(gate: Any) -> str | dict[str, float]:
    """Read a gate: ``"lossless"``, a dict (``{"max_kl": 0.02}``) or its command-line spelling ``"max_kl=0.02,min_top1=0.98"``.

    Args:
        gate: the gate in any of those forms.

    Returns:
        ``"lossless"`` or a checked dict.

    Raises:
        RecipeError: an unknown key, a value out of range, or a malformed string.

    Example:
        >>> parse_gate("max_kl=0.02"), parse_gate("lossless")
        ({'max_kl': 0.02}, 'lossless')
    """
    if isinstance(gate, str):
        text = gate.strip()
        if text.lower() == "lossless":
            return "lossless"
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            try:
                out[key.strip()] = float(value)
            except ValueError:
                eq = ""
            if not eq:
                raise RecipeError(f"gate {gate!r}: write 'lossless' or KEY=NUMBER pairs such as 'max_kl=0.02' "
                                  "(keys: max_kl, min_top1, max_ppl_ratio)") from None
        gate = out
    if not isinstance(gate, dict) or not gate:
        raise RecipeError(f"gate must be 'lossless' or a mapping such as {{'max_kl': 0.02}}, got {gate!r}")
    check_gate(gate)
    return {k: float(v) for k, v in gate.items()}


def _device(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _estimate(c: Candidate, done: list[tuple[Candidate, float]]) -> float:
    # seconds this candidate will likely take: the slowest finished one of its kind (compiled and/or calibrating),
    # else the slowest of any kind; 0 before anything ran (the first candidate always starts)
    same = [s for d, s in done if (d.compiles, d.calibrates) == (c.compiles, c.calibrates)]
    pool = same or [s for _, s in done]
    return max(pool) if pool else 0.0


def _check_restored(model: nn.Module, fingerprint: str, name: str) -> None:
    if getattr(model, "infopt", None) is not None or weights_fingerprint(model) != fingerprint:
        raise InfoptError(f"after trying {name}, infopt.undo did not restore the model bit for bit; the tuner stops "
                          "rather than measure the next candidates on a changed model (please report it)")


def _quality(model, tokenizer, recipe: Recipe, reference, calibration) -> dict[str, float]:
    """KL / top-1 of ``recipe``'s lossy steps alone (then undone): the cheap check before the speed run."""
    from .. import eval as ev

    steps = [s for s in recipe.steps if not s.lossless and s.stage != "compile"]
    optimize(model, steps, tokenizer=tokenizer, calibration=calibration)
    try:
        return ev.compare(model, reference)
    finally:
        undo(model)


def tune(model: nn.Module, tokenizer, workload: str = "decode", *, gate: Any = "lossless", budget_s: float = 1800.0,
         candidates: Any = None, calibrated: bool = False, repeats: int = 2, num_requests: int | None = None,
         seed: int = 0, calibration: Any = None, progress: bool = True) -> TuneResult:
    """Measure candidate recipes on this machine and return the fastest one that passes ``gate``.

    Each candidate is checked against the recipe rules and this model (:func:`infopt.validate`), against
    the gate (``"lossless"``: only steps that claim token-identical output, and the benchmark's greedy
    tokens must match the plain model's; a dict: the lossy steps' KL / top-1 / perplexity ratio on the
    evaluation text, measured once per distinct set of lossy steps before any speed run), then timed with
    the bench harness (:func:`infopt.bench.run_bench`: plain model and recipe interleaved, medians over
    ``repeats``). A candidate is skipped as dominated when a finer setting of its family (int4 group 32
    before 64 before 128) already missed the gate, and no candidate starts once the time spent plus its
    estimated duration (the slowest finished candidate of its kind) would pass ``budget_s``. After each
    candidate the model is undone and its weights' fingerprint checked against the original's.
    Calibrated quantizers run once per configuration (see :mod:`infopt.quantize.calibration.cache`).

    Args:
        model: an unoptimized transformers causal LM (left unoptimized on return).
        tokenizer: its tokenizer.
        workload: a bench workload (:data:`infopt.bench.WORKLOADS`); ranks by :data:`WORKLOAD_METRIC`.
        gate: ``"lossless"``, or limits such as ``{"max_kl": 0.02}`` (also ``"max_kl=0.02"``).
        budget_s: seconds the search may take.
        candidates: recipes to try instead of :func:`~infopt.tuner.candidates.default_candidates` (presets,
            step lists, dicts, YAML paths or :class:`~infopt.tuner.candidates.Candidate` s).
        calibrated: also try GPTQ and AWQ (default candidates only; minutes each on a real model).
        repeats: timed repeats per candidate.
        num_requests: override the workload's request count (quick runs).
        seed: the workload's seed.
        calibration: calibration data for calibrated steps (default: each step's own).
        progress: show the harness's progress bars.

    Returns:
        A :class:`~infopt.tuner.result.TuneResult`: ``best`` / ``recipe``, ``table()``, ``save_yaml(path)``,
        ``plot(path)``.

    Raises:
        RecipeError: a bad gate, workload, budget or candidate list; or the model is already optimized.
        InfoptError: undo did not restore the model after a candidate.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m, tok = tiny_model(max_positions=1024, with_tokenizer=True)
        >>> r = infopt.tune(m, tok, "prompt512", gate="lossless", repeats=1, num_requests=1, progress=False,
        ...                 candidates=["cpu-fast", [infopt.kvcache.Static()]])
        >>> [(t.name, t.status) for t in r.trials]
        [('preset:cpu-fast', 'not lossless'), ('kvcache:static', 'best')]
    """
    from ..bench import WORKLOADS, run_bench
    from ..eval import gate_failures, reference_logits

    if workload not in WORKLOADS:
        raise RecipeError(f"workload={workload!r}; allowed: {', '.join(WORKLOADS)}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0:
        raise RecipeError(f"budget_s={budget_s!r}; must be a positive number of seconds")
    if getattr(model, "infopt", None) is not None:
        raise RecipeError("the model is already optimized; call infopt.undo(model) before tuning it")
    gate = parse_gate(gate)
    metric, higher = WORKLOAD_METRIC[workload]
    cands = default_candidates(workload, device=_device(model), calibrated=calibrated) if candidates is None \
        else as_candidates(candidates)

    t_start = time.perf_counter()
    fingerprint = weights_fingerprint(model)
    reference = None if gate == "lossless" else reference_logits(model, tokenizer=tokenizer, max_tokens=512)
    trials: list[Trial] = []
    done: list[tuple[Candidate, float]] = []
    failed_keys: set[str] = set()
    failed_levels: dict[str, int] = {}  # family -> finest level that missed the gate
    figures_by_key: dict[str, dict[str, float]] = {}
    machine = None
    for c in cands:
        t0 = time.perf_counter()
        trial = Trial(c.name, c.recipe, "pass")
        trials.append(trial)
        elapsed = t0 - t_start
        if elapsed >= budget_s or elapsed + _estimate(c, done) > budget_s:
            trial.status, trial.reason = "budget", f"{elapsed:.0f} s spent, about {_estimate(c, done):.0f} s more"
            continue
        if gate == "lossless" and not c.lossless:
            lossy = ", ".join(s.key for s in c.recipe.steps if not s.lossless)
            trial.status, trial.reason = "not lossless", f"lossy: {lossy}"
            continue
        try:
            validate(model, c.recipe)
        except (RecipeError, IncompatibleModelError, MissingBackendError) as e:
            trial.status, trial.reason = "invalid", str(e).split(". ")[0]
            continue
        key = quality_key(c.recipe)
        if key in failed_keys or (c.family in failed_levels and failed_levels[c.family] <= c.level):
            trial.status = "dominated"
            trial.reason = "same lossy steps missed the gate" if key in failed_keys else \
                f"a finer {c.family} setting missed the gate"
            continue
        try:
            if reference is not None and key != "[]":  # lossy steps: check quality before spending a speed run
                if key not in figures_by_key:
                    figures_by_key[key] = _quality(model, tokenizer, c.recipe, reference, calibration)
                    _check_restored(model, fingerprint, c.name)
                figs = figures_by_key[key]
                trial.kl, trial.top1 = figs["kl"], figs["top1"]
                missed = gate_failures(figs, gate)
                if missed:
                    trial.status, trial.reason = "gate", "; ".join(missed)
                    failed_keys.add(key)
                    if c.family is not None:
                        failed_levels[c.family] = min(failed_levels.get(c.family, c.level), c.level)
                    continue
            res = run_bench(model, tokenizer, c.recipe, workload, repeats=repeats, seed=seed,
                            num_requests=num_requests, progress=progress, quality=reference is not None)
        except InfoptError:
            raise
        except Exception as e:  # one candidate failing (a compile error, say) must not end the search
            undo(model)
            trial.status, trial.reason = "error", f"{type(e).__name__}: {e}".splitlines()[0][:200]
            _check_restored(model, fingerprint, c.name)
            continue
        finally:
            trial.seconds = time.perf_counter() - t0
        _check_restored(model, fingerprint, c.name)
        machine = machine or res["machine"]
        trial.bench = dict(res)
        trial.speed, trial.baseline = res["optimized"][metric], res["baseline"][metric]
        trial.speedup = (trial.speed / trial.baseline if higher else trial.baseline / trial.speed) \
            if trial.speed and trial.baseline else None
        trial.exact = res["exact_greedy"]
        if res["quality"] is not None:
            trial.kl, trial.top1 = res["quality"]["kl"], res["quality"]["top1"]
            missed = gate_failures(res["quality"], gate)
            if missed:
                trial.status, trial.reason = "gate", "; ".join(missed)
        if gate == "lossless" and not trial.exact:
            trial.status, trial.reason = "not identical", "greedy tokens differ from the plain model's"
        trial.seconds = time.perf_counter() - t0
        done.append((c, trial.seconds))

    passing = [t for t in trials if t.status == "pass" and t.speedup is not None]
    if passing:
        max(passing, key=lambda t: t.speedup).status = "best"
    return TuneResult(workload, metric, higher, gate, trials, float(budget_s), time.perf_counter() - t_start, machine)
