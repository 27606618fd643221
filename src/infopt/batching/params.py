"""Per-request settings and results of the batching engine: :class:`SamplingParams`, :class:`RequestOutput`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SamplingParams", "RequestOutput", "RequestMetrics", "FINISH_REASONS"]

FINISH_REASONS = ("length", "stop", "cancelled", "error")
"""``length``: max_new_tokens reached; ``stop``: an end-of-sequence token or a stop string; ``cancelled``:
:meth:`RequestHandle.cancel`; ``error``: the request failed (see ``RequestOutput.error``)."""


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    Args:
        max_new_tokens: tokens to generate at most (> 0).
        temperature: 0 (default) decodes greedily (fp32 argmax, as ``generate``); > 0 samples.
        top_k: keep the k most likely tokens before sampling (0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: all).
        stop: strings that end the request; the output text is cut before the first one (needs a tokenizer).
        seed: seeds this request's sampling alone, so its output does not depend on the other requests
            in the batch. None: a seed drawn from torch's global generator at submission.
        min_new_tokens: end-of-sequence tokens are masked until this many tokens were generated.
        ignore_eos: keep generating after an end-of-sequence token (fixed-length benchmarks).
        eos_token_ids: end-of-sequence ids; None: the model's generation config.

    Raises:
        ValueError: a field out of range, naming the field, the value and what is allowed.

    Example:
        >>> SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1).do_sample
        True
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.eos_token_ids is not None:
            ids = (self.eos_token_ids,) if _int(self.eos_token_ids) else tuple(self.eos_token_ids)
            object.__setattr__(self, "eos_token_ids", ids)
        checks = [
            ("max_new_tokens", _int(self.max_new_tokens) and self.max_new_tokens > 0, "an integer > 0"),
            ("temperature", isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and math.isfinite(self.temperature) and self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_k", _int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = no top-k)"),
            ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("seed", self.seed is None or _int(self.seed), "an integer or None"),
            ("min_new_tokens", _int(self.min_new_tokens) and 0 <= self.min_new_tokens, "an integer >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("eos_token_ids", self.eos_token_ids is None or all(_int(t) and t >= 0 for t in self.eos_token_ids),
             "token ids >= 0 or None"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter()``) and counts of one request.

    Attributes:
        arrival: when it was submitted. first_scheduled: its first forward. first_token: its first
        output token. finished: when it ended. prompt_tokens / cached_tokens: prompt length and how many
        prompt tokens the prefix cache supplied. output_tokens: generated. preemptions: times its KV was
        dropped for lack of blocks and recomputed.
    """

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first forward that included the request."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        """Time to first token: seconds from arrival (queueing included)."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token is None or self.finished is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end."""
        return None if self.finished is None else self.finished - self.arrival

    def as_dict(self) -> dict[str, float | int | None]:
        return {"queue_time": self.queue_time, "ttft": self.ttft, "tpot": self.tpot, "latency": self.latency,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens, "preemptions": self.preemptions}


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        request_id: the engine's id for it.
        prompt_token_ids: the prompt.
        token_ids: generated tokens (an end-of-sequence token that ended it included, as ``generate`` does;
            with a stop string, up to the token that completed it).
        text: the generated text (special tokens skipped, cut before a stop string); None without a tokenizer.
        finish_reason: one of :data:`FINISH_REASONS`.
        error: what went wrong, for ``finish_reason == "error"``.
        metrics: :class:`RequestMetrics`.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
