"""``evaluate``: strided perplexity of a model and its KL / top-1 agreement against a reference, cached on disk."""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..core.errors import IncompatibleModelError
from ..models import load_default_tokenizer
from .metrics import Reference, _check_ids, check_reference, resolve_text, tokenize
from .store import load_reference, reference_meta, save_reference
from .windows import MAX_WINDOW, Window, measure, model_context, model_vocab, window_layout

__all__ = ["EvalResult", "evaluate", "make_reference", "reference_for", "STORE_DTYPES"]

# dtypes a reference may store its log-probs in (see docs/eval.md for the KL error of each)
STORE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class EvalResult:
    """What :func:`evaluate` measured.

    Attributes:
        tokens: evaluated tokens ``T`` (perplexity averages over the ``T - 1`` next-token targets;
            KL and top-1 over all ``T`` positions).
        window, stride, windows: the strided layout (tokens per forward, step, number of forwards).
        nll, ppl: the model's mean negative log-likelihood (nats/token) and ``exp(nll)``.
        reference: ``None``, ``"model"`` or ``"stored <dtype>"``.
        nll_ref, ppl_ref: the same for the reference.
        kl: mean KL(reference || model), nats/token.
        kl_max, kl_max_pos: the largest per-position KL and its position ``t`` (the distribution of
            token ``t + 1`` given tokens ``<= t`` of the evaluated ids).
        kl_max_context, kl_max_next: decoded last tokens up to ``kl_max_pos`` and the token that
            follows in the text (when a tokenizer is at hand).
        top1: fraction of positions where both argmax tokens agree.
        seconds: wall time of the evaluation.
    """

    tokens: int
    window: int
    stride: int
    windows: int
    nll: float
    ppl: float
    reference: str | None = None
    nll_ref: float | None = None
    ppl_ref: float | None = None
    kl: float | None = None
    kl_max: float | None = None
    kl_max_pos: int | None = None
    kl_max_context: str | None = None
    kl_max_next: str | None = None
    top1: float | None = None
    seconds: float = 0.0

    @property
    def ppl_ratio(self) -> float | None:
        """``ppl / ppl_ref`` (None without a reference); the ``max_ppl_ratio`` gate reads this."""
        return None if self.ppl_ref is None else self.ppl / self.ppl_ref

    def to_dict(self) -> dict[str, Any]:
        """All fields plus ``ppl_ratio``; JSON-serialisable, and accepted by :func:`gate_failures`."""
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}

    def __str__(self) -> str:
        def f(v, spec):
            return "-" if v is None else format(v, spec)

        has_ref = self.reference is not None
        rows = [("perplexity", f(self.ppl_ref, ".4f"), f(self.ppl, ".4f"),
                 f"{self.ppl_ratio:.4f}x" if has_ref else "")]
        if has_ref:
            at = f"at token {self.kl_max_pos}"
            if self.kl_max_context is not None:
                at += f": {self.kl_max_context[-40:]!r} -> {self.kl_max_next!r}"
            rows += [("KL mean (nats/token)", "0", f(self.kl, ".4g"), ""),
                     ("KL max (nats)", "0", f(self.kl_max, ".4g"), at),
                     ("top-1 agreement", "1", f(self.top1, ".4f"), "")]
        w = max(len(r[0]) for r in rows)
        lines = [f"{'':<{w}}  {'reference':>10}  {'model':>10}  ratio / where"]
        lines += [f"{a:<{w}}  {b:>10}  {c:>10}  {d}".rstrip() for a, b, c, d in rows]
        lines.append(f"{self.tokens} tokens, {self.windows} window(s) of <= {self.window} tokens, stride "
                     f"{self.stride}; reference: {self.reference or 'none'}; {self.seconds:.1f}s")
        return "\n".join(lines)


def _positive(name: str, v: Any) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        raise ValueError(f"{name}={v!r} must be a positive integer")


def _default_layout(models: list[nn.Module], window: int | None, stride: int | None) -> tuple[int, int]:
    """``(window, stride)``: window = min(context, 1024), stride = window // 2, unless given."""
    ctxs = [c for c in (model_context(m) for m in models) if c]
    ctx = min(ctxs) if ctxs else None
    if window is not None and ctx is not None and window > ctx:
        raise ValueError(f"window={window} exceeds the model's context ({ctx} tokens); pass window <= {ctx}")
    w = window or min(ctx or MAX_WINDOW, MAX_WINDOW)
    s = stride or max(1, w // 2)
    if s > w:
        raise ValueError(f"stride={s} is larger than the window ({w} tokens): tokens between windows would never "
                         f"be scored. Pass stride <= {w}")
    return w, s


def _ref_layout(ref: Reference, window: int | None, stride: int | None) -> tuple[Window, ...]:
    have = ref.layout()
    if window is None and stride is None:
        return have
    w = window or ref.window or ref.tokens
    want = window_layout(ref.tokens, w, stride or ref.stride or min(w, ref.tokens))
    if want != have:
        raise ValueError(f"the reference was computed with window={ref.window or ref.tokens}, stride="
                         f"{ref.stride or ref.window or ref.tokens}, which places its windows differently from "
                         f"window={window}, stride={stride}; leave window/stride unset to use the reference's, "
                         "or compute a new reference")
    return have


def _check_context(model: nn.Module, layout: tuple[Window, ...]) -> None:
    ctx, longest = model_context(model), max(w.end - w.begin for w in layout)
    if ctx is not None and longest > ctx:
        raise ValueError(f"a window of {longest} tokens exceeds the model's context ({ctx}); use a reference computed "
                         f"with window <= {ctx}")


def _tokenizer(tokenizer):
    if tokenizer is not None:
        return tokenizer
    return load_default_tokenizer()


def _encode_checked(model: nn.Module, text, tokenizer, max_tokens: int):
    """``(tokenizer, body, ids)``: the resolved text and its ``[1, T]`` ids, checked against ``model``."""
    tokenizer = _tokenizer(tokenizer)
    body = resolve_text(text)
    ids = tokenize(body, tokenizer, max_tokens)
    _check_ids(model, ids)
    if ids.shape[1] < 2:
        raise ValueError(f"the text is {ids.shape[1]} token long; perplexity needs at least 2 tokens")
    return tokenizer, body, ids


def _prepare_reference(model: nn.Module, text, tokenizer, max_tokens: int, stride: int | None,
                       window: int | None, dtype: torch.dtype | str, *, original_only: bool):
    """Validate a reference request: ``(ids, window, stride, dtype, identity)`` (see :func:`make_reference`).

    ``original_only`` refuses an optimized model before the text is encoded.
    """
    _positive("max_tokens", max_tokens)
    _positive("stride", stride)
    _positive("window", window)
    dtype = _store_dtype(dtype)
    if original_only:
        _check_unoptimized(model)
    tokenizer, body, ids = _encode_checked(model, text, tokenizer, max_tokens)
    w, s = _default_layout([model], window, stride)
    return ids, w, s, dtype, _identity(model, tokenizer, body, ids, max_tokens, w, s, dtype)


def evaluate(
    model: nn.Module,
    reference: nn.Module | Reference | str | os.PathLike | None = None,
    text: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    max_tokens: int = 4096,
    stride: int | None = None,
    window: int | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on a text, and with a reference, KL / top-1 agreement against it.

    Strided scheme (the one the transformers perplexity guide describes): windows of ``window``
    tokens (default ``min(model context, 1024)``) start every ``stride`` tokens (default half the
    window, 512 for a 1024 window); the first window scores all its positions, each later one only
    the positions not scored yet, so every position is scored once with at least
    ``window - stride + 1`` tokens of context. Metrics are folded into sums window by window: only
    one window's ``[n, V]`` logits (two with a reference model) are alive at a time.

    Args:
        model: the model measured (usually the optimized one).
        reference: None (perplexity only); a reference model run on the same windows (e.g. an
            unoptimized copy; exact fp32 KL); a :class:`Reference` (from :func:`make_reference`,
            :func:`reference_for` or :func:`reference_logits`: its tokens and windows are used); or
            the path of a saved reference.
        text: a string, a path to a UTF-8 text file, or None for :func:`default_text`. Not allowed
            with a :class:`Reference`, which brings its own tokens.
        tokenizer: the model's tokenizer (default: the default model's).
        max_tokens: evaluate the first ``max_tokens`` tokens of the text.
        stride: step between windows (default: the reference's, else ``window // 2``).
        window: tokens per forward (default: the reference's, else ``min(context, 1024)``).

    Returns:
        An :class:`EvalResult`.

    Raises:
        ValueError: an empty text, fewer than 2 tokens, ``max_tokens``/``stride``/``window`` <= 0,
            ``stride > window``, a window longer than the model's context, ``text`` with a
            :class:`Reference`, windows that differ from the reference's; vocabularies that differ
            or ids outside the model's (:class:`~infopt.core.errors.IncompatibleModelError`).
        FileNotFoundError: ``reference`` names a file that does not exist.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> r = evaluate(m, m, "Readability counts. " * 40, max_tokens=64)
        >>> r.kl, r.top1, r.tokens
        (0.0, 1.0, 64)
    """
    t0 = time.perf_counter()
    _positive("max_tokens", max_tokens)
    _positive("stride", stride)
    _positive("window", window)
    ref_model, ref = None, None
    if isinstance(reference, (str, os.PathLike)):
        if not Path(reference).is_file():
            raise FileNotFoundError(f"reference file '{reference}' does not exist (the evaluation text goes in text=)")
        ref = load_reference(reference)
    elif isinstance(reference, Reference):
        ref = reference
    elif isinstance(reference, nn.Module):
        ref_model = reference
    elif reference is not None:
        raise ValueError(f"reference must be a model, a Reference, a saved reference path or None, got "
                         f"{type(reference).__name__}")

    if ref is not None:
        if text is not None:
            raise ValueError("a Reference brings its own tokens; drop text= (or compute a reference on that text)")
        check_reference(model, ref)
        ids, layout = ref.input_ids, _ref_layout(ref, window, stride)
        _check_context(model, layout)
        fig = measure(model, ids, layout, ref_logprobs=ref.logits, round_to=ref.round_to, ref_nll=ref.meta.get("nll"))
        kind = f"stored {str(ref.logits.dtype).removeprefix('torch.')}"
    else:
        if ref_model is not None and model_vocab(ref_model) != model_vocab(model):
            raise IncompatibleModelError(f"the reference model's vocabulary ({model_vocab(ref_model)}) differs from "
                                         f"the model's ({model_vocab(model)}); compare a model with its own original")
        tokenizer, _, ids = _encode_checked(model, text, tokenizer, max_tokens)
        w, s = _default_layout([model] + ([ref_model] if ref_model is not None else []), window, stride)
        layout = window_layout(int(ids.shape[1]), w, s)
        fig = measure(model, ids, layout, ref_model=ref_model)
        kind = None if ref_model is None else "model"

    first = layout[0]
    out = EvalResult(tokens=int(ids.shape[1]), window=first.end - first.begin,
                     stride=layout[1].begin - first.begin if len(layout) > 1 else first.end - first.begin,
                     windows=len(layout), nll=fig["nll"], ppl=fig["ppl"], reference=kind)
    if kind is not None:
        out.nll_ref, out.ppl_ref, out.kl, out.top1 = fig["nll_ref"], fig["ppl_ref"], fig["kl"], fig["top1"]
        out.kl_max, out.kl_max_pos = fig["kl_max"], fig["kl_max_pos"]
        if tokenizer is not None:
            pos = out.kl_max_pos
            out.kl_max_context = tokenizer.decode(ids[0, max(0, pos - 11):pos + 1].tolist())
            out.kl_max_next = tokenizer.decode(ids[0, pos + 1:pos + 2].tolist()) if pos + 1 < out.tokens else None
    out.seconds = time.perf_counter() - t0
    return out


def _store_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str) and dtype in STORE_DTYPES:
        return STORE_DTYPES[dtype]
    if dtype in STORE_DTYPES.values():
        return dtype
    raise ValueError(f"reference dtype={dtype!r}; allowed: {', '.join(STORE_DTYPES)}")


def _identity(model, tokenizer, body: str, ids: torch.Tensor, max_tokens: int, window: int, stride: int,
              dtype: torch.dtype) -> dict[str, Any]:
    # what a cached reference must match to be reused (JSON scalars only)
    return {
        "text_sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(),
        "ids_sha256": hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest(),
        "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "model": str(getattr(model.config, "name_or_path", "") or model.config.model_type),
        "vocab": model_vocab(model),
        "max_tokens": max_tokens,
        "window": window,
        "stride": stride,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _build(model: nn.Module, ids: torch.Tensor, window: int, stride: int, dtype: torch.dtype,
           identity: dict[str, Any]) -> Reference:
    layout = window_layout(int(ids.shape[1]), window, stride)
    store = torch.empty((1, ids.shape[1], model_vocab(model)), dtype=dtype)  # [1, T, V] log-probs

    def sink(pos: int, lp: torch.Tensor) -> None:
        store[0, pos:pos + lp.shape[0]] = lp.to(dtype)

    fig = measure(model, ids, layout, sink=sink)
    meta = {**identity, "logprobs": True, "nll": fig["nll"], "ppl": fig["ppl"], "infopt": __version__}
    return Reference(input_ids=ids.cpu(), logits=store, window=window, stride=stride, meta=meta)


def _check_unoptimized(model: nn.Module) -> None:
    report = model.__dict__.get("infopt")
    if report is not None and getattr(report, "steps", None):
        raise IncompatibleModelError(
            "the model is already optimized (model.infopt lists " + ", ".join(s.key for s in report.steps)
            + "); a reference must come from the original. Compute it before infopt.optimize, or call "
            "infopt.undo(model) first")


def make_reference(
    model: nn.Module,
    text: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    max_tokens: int = 4096,
    stride: int | None = None,
    window: int | None = None,
    dtype: torch.dtype | str = torch.float16,
) -> Reference:
    """Run the (unoptimized) model over the text window by window and keep its log-probs.

    The log-probs of each scored position are stored once (``[1, T, V]`` in ``dtype``: 2 bytes per
    entry in fp16, 384 MiB for 4,096 tokens of a 49,152 vocabulary). The exact fp32 NLL is kept in
    ``meta["nll"]`` so ``ppl_ref`` does not suffer from the rounding. fp16 log-probs are the default:
    near the probable tokens (log-prob in [-4, 0]) fp16 is exact to ~1e-3, which moves KL by less than
    1e-5 nats/token; bf16 is ~8x coarser (see docs/eval.md for measured figures).

    Args:
        model: the unoptimized model.
        text, tokenizer, max_tokens, stride, window: as for :func:`evaluate`.
        dtype: ``torch.float16`` (default), ``torch.bfloat16`` or ``torch.float32`` (or their names).

    Returns:
        A :class:`Reference` with ``window``, ``stride`` and ``meta`` set.

    Raises:
        ValueError: as for :func:`evaluate`; an unsupported ``dtype``; an optimized model
            (:class:`~infopt.core.errors.IncompatibleModelError`).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> ref = make_reference(m, "Simple is better than complex. " * 30, max_tokens=100, window=64)
        >>> ref.logits.shape, ref.logits.dtype, evaluate(m, ref).kl
        (torch.Size([1, 100, 49152]), torch.float16, 0.0)
    """
    ids, w, s, dtype, identity = _prepare_reference(model, text, tokenizer, max_tokens, stride, window, dtype,
                                                    original_only=True)
    return _build(model, ids, w, s, dtype, identity)


def reference_for(
    model: nn.Module,
    path: str | os.PathLike,
    text: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    max_tokens: int = 4096,
    stride: int | None = None,
    window: int | None = None,
    dtype: torch.dtype | str = torch.float16,
    recompute: bool = False,
) -> Reference:
    """The reference of ``model`` on a text, computed once and loaded from ``path`` afterwards.

    The cache is reused only when its metadata matches this call exactly: text hash, token-id hash,
    tokenizer name, model name, vocabulary, ``max_tokens``, ``window``, ``stride`` and ``dtype``.
    On any mismatch (or an unreadable file) it is recomputed and overwritten, with a
    ``UserWarning`` naming what differed. Call it before optimizing: computing needs the original.

    Args:
        model: the model; when the cache is missing or stale it must not be optimized yet.
        path: the cache file (safetensors; see :func:`save_reference`).
        text, tokenizer, max_tokens, stride, window, dtype: as for :func:`make_reference`.
        recompute: compute and overwrite even when the cache matches.

    Returns:
        The :class:`Reference`.

    Raises:
        ValueError: as for :func:`make_reference`; in particular
            :class:`~infopt.core.errors.IncompatibleModelError` when it would have to compute from an
            already optimized model.

    Example:
        >>> import tempfile
        >>> from infopt.models import tiny_model
        >>> m, path = tiny_model(), tempfile.mkdtemp() + "/ref.safetensors"
        >>> a = reference_for(m, path, "Flat is better than nested. " * 20, max_tokens=50)  # computes
        >>> b = reference_for(m, path, "Flat is better than nested. " * 20, max_tokens=50)  # loads
        >>> torch.equal(a.logits, b.logits)
        True
    """
    ids, w, s, dtype, identity = _prepare_reference(model, text, tokenizer, max_tokens, stride, window, dtype,
                                                    original_only=False)  # a cache hit may come from any model
    p = Path(path)
    if p.exists() and not recompute:
        try:
            stored = reference_meta(p).get("meta") or {}
        except ValueError as e:
            warnings.warn(f"reference cache '{p}' is unreadable ({e}); recomputing it", stacklevel=2)
        else:
            diff = [k for k in identity if stored.get(k) != identity[k]]
            if not diff:
                return load_reference(p)
            warnings.warn(f"reference cache '{p}' was computed with different "
                          + "; ".join(f"{k} ({_short(stored.get(k))} != {_short(identity[k])})" for k in diff)
                          + "; recomputing it", stacklevel=2)
    _check_unoptimized(model)
    ref = _build(model, ids, w, s, dtype, identity)
    save_reference(ref, p)
    return ref


def _short(v: Any) -> str:
    return repr(v[:12] + "...") if isinstance(v, str) and len(v) == 64 else repr(v)
