"""Strided windows over a long text and the per-window metric loop that never holds ``[T, V]`` in fp32."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.introspect import context_length, text_config

__all__ = ["Window", "window_layout", "window_logits", "measure", "model_context", "model_vocab", "CHUNK"]

# rows of [rows, V] log-softmax temporaries per step: 256 x 49,152 x 4 B = 48 MiB each
CHUNK = 256
# the longest window the default scheme uses, whatever the model's context
MAX_WINDOW = 1024


@dataclass(frozen=True)
class Window:
    """One forward pass of the strided scheme.

    Attributes:
        begin, end: the tokens ``[begin, end)`` fed to the model (positions restart at 0 in each window).
        first: the first *scored* position; logits at positions ``[first, end)`` are scored. Each
            position of the text is scored in exactly one window, with at least ``window - stride + 1``
            tokens of context (all preceding tokens in the first window).
    """

    begin: int
    end: int
    first: int

    @property
    def n_new(self) -> int:
        return self.end - self.first


def window_layout(n_tokens: int, window: int, stride: int) -> tuple[Window, ...]:
    """The windows that cover ``n_tokens`` tokens: length ``window``, start every ``stride`` tokens.

    The first window scores all its positions; each later one scores only the positions the
    previous windows did not reach (the standard strided-perplexity scheme of the transformers
    docs). ``n_tokens <= window`` gives one window: a plain full forward.

    Args:
        n_tokens: length of the token sequence (>= 1).
        window: tokens per forward pass (>= 1).
        stride: step between window starts, ``1 <= stride <= window``.

    Returns:
        The windows, in order.

    Raises:
        ValueError: a non-positive argument, or ``stride > window`` (positions would go unscored).

    Example:
        >>> [(w.begin, w.end, w.first) for w in window_layout(10, 6, 2)]
        [(0, 6, 0), (2, 8, 6), (4, 10, 8)]
    """
    for name, v in (("n_tokens", n_tokens), ("window", window), ("stride", stride)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if stride > window:
        raise ValueError(f"stride={stride} is larger than window={window}: tokens between windows would never be "
                         f"scored. Pass stride <= {window}")
    out, begin, done = [], 0, 0
    while True:
        end = min(begin + window, n_tokens)
        out.append(Window(begin, end, done))
        if end == n_tokens:
            return tuple(out)
        done, begin = end, begin + stride


def model_context(model: nn.Module) -> int | None:
    """The model's maximum sequence length (see :func:`infopt.core.introspect.context_length`), or None."""
    return context_length(model)


def model_vocab(model: nn.Module) -> int:
    """Width of the model's logits (``config.vocab_size``)."""
    return int(text_config(model.config).vocab_size)


def _keeps_logits(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):  # a C-implemented or oddly wrapped forward has no signature
        return False


@torch.inference_mode()
def window_logits(model: nn.Module, input_ids: torch.Tensor, w: Window) -> torch.Tensor:
    """Logits of the scored positions of one window: ``[w.n_new, V]``, fp32, on the CPU.

    Only the new positions go through the LM head (``logits_to_keep``) when the model supports it.

    Args:
        model: a transformers causal LM.
        input_ids: ``[1, T]`` token ids.
        w: the window.

    Returns:
        ``[w.n_new, V]`` fp32 logits; row ``i`` predicts token ``w.first + i + 1``.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> window_logits(m, torch.tensor([[1, 5, 9, 4]]), Window(0, 4, 2)).shape
        torch.Size([2, 49152])
    """
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"use_cache": False}
    if _keeps_logits(model):
        kwargs["logits_to_keep"] = w.n_new
    logits = model(input_ids[:, w.begin:w.end].to(device), **kwargs).logits  # [1, <=end-begin, V]
    return logits[0, -w.n_new:].float().cpu()


def _round_trip(lp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # lp: [rows, V] as a reference stored in `dtype` holds them, renormalised the way the reader renormalises
    # the stored rows (rounding breaks sum(p) = 1); for fp32 this is log_softmax(lp), bit-equal to the reader's
    return F.log_softmax(lp.to(dtype).float(), dim=-1)


class _Tally:
    """Running sums over scored positions, in float64."""

    def __init__(self, input_ids: torch.Tensor, with_ref: bool):
        self.ids = input_ids[0].cpu()  # [T]
        self.n = int(self.ids.shape[0])
        self.with_ref = with_ref
        self.nll = self.nll_ref = self.kl = 0.0
        self.targets = self.positions = self.top1 = 0
        self.kl_max, self.kl_max_pos = -1.0, -1

    def add(self, pos0: int, lp: torch.Tensor, lq: torch.Tensor | None, lp_cmp: torch.Tensor | None) -> None:
        # lp, lq, lp_cmp: [n, V] log-probs at positions pos0..pos0+n-1; row i predicts token pos0 + i + 1
        n = lp.shape[0]
        k = max(0, min(n, self.n - 1 - pos0))  # the last position of the text has no next token
        tgt = self.ids[pos0 + 1:pos0 + 1 + k].unsqueeze(-1)  # [k, 1]
        self.nll -= float(lp[:k].gather(-1, tgt).double().sum())
        self.targets += k
        self.positions += n
        if lq is None:
            return
        self.nll_ref -= float(lq[:k].gather(-1, tgt).double().sum())
        p = lq.exp()
        # p = 0 where lq = -inf: those terms are 0, not nan; tiny negatives are rounding, KL >= 0
        kl = torch.where(p > 0, p * (lq - lp_cmp), 0.0).sum(-1).clamp_min(0.0)  # [n]
        self.kl += float(kl.double().sum())
        i = int(kl.argmax())
        if float(kl[i]) > self.kl_max:
            self.kl_max, self.kl_max_pos = float(kl[i]), pos0 + i
        self.top1 += int((lp_cmp.argmax(-1) == lq.argmax(-1)).sum())

    def figures(self, ref_nll: float | None) -> dict[str, Any]:
        nll = self.nll / self.targets
        out: dict[str, Any] = {"tokens": self.n, "nll": nll, "ppl": float(torch.tensor(nll).exp())}
        if self.with_ref:
            nll_ref = ref_nll if ref_nll is not None else self.nll_ref / self.targets
            out.update(nll_ref=nll_ref, ppl_ref=float(torch.tensor(nll_ref).exp()), kl=self.kl / self.positions,
                       kl_max=self.kl_max, kl_max_pos=self.kl_max_pos, top1=self.top1 / self.positions)
        return out


def measure(
    model: nn.Module,
    input_ids: torch.Tensor,
    layout: tuple[Window, ...],
    *,
    ref_model: nn.Module | None = None,
    ref_logprobs: torch.Tensor | None = None,
    round_to: torch.dtype | None = None,
    ref_nll: float | None = None,
    sink: Callable[[int, torch.Tensor], None] | None = None,
    chunk: int = CHUNK,
) -> dict[str, Any]:
    """Run ``model`` window by window and fold perplexity (and, with a reference, KL/top-1) into sums.

    At most one window's logits (``[n_new, V]`` fp32, twice with a reference model) and one chunk of
    log-softmax temporaries are alive at a time.

    Args:
        model: the model measured.
        input_ids: ``[1, T]``.
        layout: from :func:`window_layout`; it must cover ``T`` tokens.
        ref_model: a reference model run on the same windows (``ref_model is model`` reuses the logits).
        ref_logprobs: ``[1, T, V]`` stored reference logits or log-probs, any float dtype.
        round_to: for stored log-probs, their dtype: the model's log-probs are rounded through it and
            renormalised before KL/top-1, exactly as the stored ones were, so a model compared with its
            own stored reference gives exactly 0. None (raw logits) compares unrounded.
        ref_nll: exact mean NLL of the reference (recorded when it was stored), used for ``ppl_ref``.
        sink: called as ``sink(position, log_probs)`` with each chunk's exact fp32 model log-probs.
        chunk: rows per log-softmax step.

    Returns:
        ``{"tokens", "nll", "ppl"}``, plus ``{"nll_ref", "ppl_ref", "kl", "kl_max", "kl_max_pos", "top1"}``
        with a reference.

    Example:
        >>> from infopt.models import tiny_model
        >>> m, ids = tiny_model(), torch.randint(0, 1000, (1, 40))
        >>> measure(m, ids, window_layout(40, 16, 8), ref_model=m)["kl"]
        0.0
    """
    if ref_model is not None and ref_logprobs is not None:
        raise ValueError("pass ref_model or ref_logprobs, not both")
    tally = _Tally(input_ids, with_ref=ref_model is not None or ref_logprobs is not None)
    for w in layout:
        logits = window_logits(model, input_ids, w)  # [n_new, V]
        ref = None
        if ref_model is model:
            ref = logits
        elif ref_model is not None:
            ref = window_logits(ref_model, input_ids, w)
        for s in range(0, w.n_new, chunk):
            e = min(s + chunk, w.n_new)
            pos = w.first + s
            lp = F.log_softmax(logits[s:e], dim=-1)  # [rows, V]
            if sink is not None:
                sink(pos, lp)
            lq = lp_cmp = None
            if ref_model is model:
                lq = lp_cmp = lp
            elif ref is not None:
                lq, lp_cmp = F.log_softmax(ref[s:e], dim=-1), lp
            elif ref_logprobs is not None:
                lq = F.log_softmax(ref_logprobs[0, pos:pos + e - s].float(), dim=-1)
                lp_cmp = lp if round_to is None else _round_trip(lp, round_to)
            tally.add(pos, lp, lq, lp_cmp)
        del logits, ref
    return tally.figures(ref_nll)
