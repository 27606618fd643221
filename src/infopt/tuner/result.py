"""What :func:`infopt.tune` returns: every candidate's figures, the best recipe, a table, a YAML file, a chart."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.availability import lazy_import
from ..core.errors import RecipeError
from ..recipe import Recipe

__all__ = ["Trial", "TuneResult", "STATUSES"]

STATUSES: dict[str, str] = {
    "best": "fastest candidate within the gate",
    "pass": "within the gate",
    "gate": "measured, missed the quality gate",
    "not identical": "claims lossless, but its greedy tokens differ from the plain model's",
    "not lossless": "has a lossy step, and the gate is lossless (not run)",
    "dominated": "a finer setting of its family (or the same lossy steps) already missed the gate (not run)",
    "invalid": "the recipe does not fit this model or machine (not run)",
    "budget": "the time budget would be exceeded (not run)",
    "error": "raised while applied or measured",
}
"""Each trial's status and what it means."""


@dataclass
class Trial:
    """One candidate and what the tuner learned about it.

    Attributes:
        name: the candidate's label.
        recipe: its recipe.
        status: one of :data:`STATUSES`.
        reason: why (the gate line missed, the validation error, ...), or "".
        speed: the workload's metric on the optimized model (e.g. decode tokens/s), or None when not measured.
        baseline: the same metric on the plain model, in the same run.
        speedup: ``speed / baseline`` (inverted for lower-is-better metrics): above 1 is faster.
        kl, top1: quality against the plain model (None when not measured).
        exact: greedy tokens identical to the plain model's on the workload (None when not measured).
        seconds: wall time spent on this candidate.
    """

    name: str
    recipe: Recipe
    status: str
    reason: str = ""
    speed: float | None = None
    baseline: float | None = None
    speedup: float | None = None
    kl: float | None = None
    top1: float | None = None
    exact: bool | None = None
    seconds: float = 0.0
    bench: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (the recipe as a dict, the bench result left out)."""
        return {"name": self.name, "recipe": self.recipe.to_dict(), "status": self.status, "reason": self.reason,
                "speed": self.speed, "baseline": self.baseline, "speedup": self.speedup, "kl": self.kl,
                "top1": self.top1, "exact": self.exact, "seconds": self.seconds}


def _f(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


@dataclass
class TuneResult:
    """The outcome of :func:`infopt.tune`.

    Attributes:
        workload: the benchmark workload measured.
        metric: the figure ranked (``decode_tokens_per_s``, ...), and ``higher`` whether more is better.
        gate: ``"lossless"`` or the gate dict.
        trials: every candidate, in the order considered.
        budget_s, elapsed_s: the time budget and the time spent.
        machine: the bench harness's machine record of the first measured candidate (None if none ran).

    Example:
        >>> r = TuneResult("decode", "decode_tokens_per_s", True, "lossless", [], 60.0, 1.0)
        >>> r.best is None, r.table().splitlines()[0]
        (True, '| candidate | status | decode_tokens_per_s | speedup | KL | top-1 | identical | s | note |')
    """

    workload: str
    metric: str
    higher: bool
    gate: Any
    trials: list[Trial]
    budget_s: float
    elapsed_s: float
    machine: dict[str, Any] | None = None

    @property
    def best(self) -> Trial | None:
        """The fastest trial within the gate, or None when none passed (keep the model as it is)."""
        return next((t for t in self.trials if t.status == "best"), None)

    @property
    def recipe(self) -> Recipe | None:
        """The best trial's recipe (named ``tuned-<workload>``), or None."""
        b = self.best
        return None if b is None else Recipe(b.recipe.steps, gate=self._recipe_gate(), name=f"tuned-{self.workload}")

    def _recipe_gate(self) -> dict[str, float] | None:
        return dict(self.gate) if isinstance(self.gate, dict) else None

    def save_yaml(self, path: str | Path) -> Path:
        """Write the best recipe as YAML, which :func:`infopt.optimize` and ``infopt optimize --recipe`` read.

        Args:
            path: the file to write.

        Returns:
            The path.

        Raises:
            RecipeError: no candidate passed the gate.

        Example:
            >>> r = TuneResult("decode", "decode_tokens_per_s", True, "lossless", [], 60.0, 1.0)
            >>> r.save_yaml("tuned.yaml")
            Traceback (most recent call last):
            ...
            infopt.core.errors.RecipeError: no candidate passed the gate ..., so there is no recipe to save; ...
        """
        r = self.recipe
        if r is None:
            raise RecipeError(f"no candidate passed the gate ({self._gate_str()}) within the budget, so there is no "
                              "recipe to save; loosen the gate, raise budget_s, or keep the model as it is")
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(r.to_yaml())
        return p

    def _gate_str(self) -> str:
        return "lossless" if self.gate == "lossless" else ", ".join(f"{k}={v}" for k, v in dict(self.gate).items())

    # -- tables ----------------------------------------------------------------------------------------------
    def _rows(self) -> list[list[str]]:
        return [[t.name, t.status, _f(t.speed), f"{t.speedup:.2f}x" if t.speedup is not None else "-",
                 _f(t.kl, 3), _f(t.top1, 4), _f(t.exact), f"{t.seconds:.0f}", t.reason.replace("|", "/")]
                for t in self.trials]

    def _head(self) -> list[str]:
        return ["candidate", "status", self.metric, "speedup", "KL", "top-1", "identical", "s", "note"]

    def _summary(self) -> str:
        b = self.best
        verdict = (f"best: {b.name} ({b.speedup:.2f}x the plain model)" if b is not None
                   else "best: none passed the gate; keep the model as it is")
        return (f"infopt tune: workload {self.workload}, gate {self._gate_str()}, {len(self.trials)} candidates, "
                f"{sum(t.speed is not None for t in self.trials)} measured in {self.elapsed_s:.0f} s "
                f"(budget {self.budget_s:.0f} s); {verdict}")

    def table(self) -> str:
        """Every trial as a Markdown table (the first line is the header)."""
        lines = ["| " + " | ".join(self._head()) + " |", "|" + "---|" * len(self._head())]
        lines += ["| " + " | ".join(r) + " |" for r in self._rows()]
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self._summary() + "\n\n" + self.table()

    def __str__(self) -> str:
        head, rows = self._head(), self._rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([self._summary(), "", fmt.format(*head), *(fmt.format(*r) for r in rows)])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the settings, the trials and the best recipe."""
        r = self.recipe
        return {"workload": self.workload, "metric": self.metric, "higher_is_better": self.higher,
                "gate": self.gate, "budget_s": self.budget_s, "elapsed_s": self.elapsed_s, "machine": self.machine,
                "best": None if r is None else r.to_dict(), "trials": [t.to_dict() for t in self.trials]}

    # -- chart --------------------------------------------------------------------------------------------------
    def plot(self, path: str | Path) -> Path:
        """A PNG of speed against quality (KL) for every measured candidate; needs matplotlib (``infopt[bench]``).

        Args:
            path: the PNG to write.

        Returns:
            The path.

        Raises:
            MissingBackendError: matplotlib is not installed.
        """
        lazy_import("matplotlib", feature="the tuner's chart (infopt tune --plot)")
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7.5, 4.8))
        ax = fig.subplots()
        colors = {"best": "#d4a017", "pass": "#2a9d4b", "gate": "#c0392b", "not identical": "#c0392b",
                  "error": "#7f7f7f"}
        measured = [t for t in self.trials if t.speed is not None]
        base = [t.baseline for t in measured if t.baseline is not None]
        if base:
            ax.axhline(sorted(base)[len(base) // 2], color="#888888", lw=1, ls=":", label="plain transformers")
        for t in measured:
            x = max(t.kl or 0.0, 0.0)
            ax.scatter([x], [t.speed], s=120 if t.status == "best" else 40, marker="*" if t.status == "best" else "o",
                       color=colors.get(t.status, "#7f7f7f"), zorder=3)
            ax.annotate(t.name, (x, t.speed), fontsize=6, xytext=(4, 3), textcoords="offset points")
        for t in self.trials:  # missed the gate in the quality check: no speed measured
            if t.speed is None and t.kl is not None:
                ax.scatter([t.kl], [0], marker="x", color=colors["gate"], zorder=3)
        if isinstance(self.gate, dict) and "max_kl" in self.gate:
            ax.axvline(self.gate["max_kl"], color=colors["gate"], lw=1, ls="--", label=f"max_kl {self.gate['max_kl']}")
        ax.set_xscale("symlog", linthresh=1e-4)
        ax.set_xlim(left=-1e-5)  # KL is never negative: no empty negative half (a little room for the KL = 0 column)
        ax.set_xlabel("KL divergence from the plain model, nats/token (0 = lossless)")
        ax.set_ylabel(f"{self.metric} ({'higher' if self.higher else 'lower'} is better)")
        ax.set_title(f"infopt tune — {self.workload}, gate {self._gate_str()}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        return out
