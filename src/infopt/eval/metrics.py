"""Logit-level quality metrics of an optimized model against its original."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import IncompatibleModelError
from ..models import load_default_tokenizer
from .windows import Window, measure, model_vocab, window_layout

__all__ = [
    "Reference",
    "default_text",
    "resolve_text",
    "encode_text",
    "reference_logits",
    "logit_metrics",
    "compare",
    "check_reference",
    "gate_failures",
]


def default_text(max_chars: int = 60_000) -> str:
    """English prose from Python's own documentation (``pydoc_data.topics``), cut deterministically.

    Present in every CPython install, so quality checks need no download. The topics are joined
    in sorted key order; the default 60,000 characters are about 14,500 tokens of the default
    tokenizer.

    Args:
        max_chars: length of the returned text.

    Returns:
        The text.

    Example:
        >>> len(default_text(100)), "assert" in default_text()
        (100, True)
    """
    parts = [topics[k].strip() for k in sorted(topics)]
    return "\n\n".join(parts)[:max_chars]


def resolve_text(text: str | os.PathLike | None) -> str:
    """The evaluation text: :func:`default_text` for None, a file's contents for a path, else ``text``.

    A ``str`` is read as a file name when it names an existing file (and is one line, under 4,096
    characters); any other string is the text itself. A ``pathlib.Path`` must exist.

    Args:
        text: None, a path, or the text.

    Returns:
        The text (never empty).

    Raises:
        ValueError: the text (or the file) is empty or only whitespace.
        FileNotFoundError: a ``Path`` that does not exist.

    Example:
        >>> resolve_text("plain words")
        'plain words'
    """
    if text is None:
        return default_text()
    if isinstance(text, os.PathLike):
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"evaluation text file '{path}' does not exist")
        out = path.read_text(encoding="utf-8")
        where = f"the text file '{path}'"
    elif isinstance(text, str):
        if _names_file(text):
            out, where = Path(text).read_text(encoding="utf-8"), f"the text file '{text}'"
        else:
            out, where = text, "the evaluation text"
    else:
        raise ValueError(f"text must be a string, a path or None, got {type(text).__name__}")
    if not out.strip():
        raise ValueError(f"{where} is empty; pass some text (or None for Python's pydoc text)")
    return out


def _names_file(text: str) -> bool:
    if not text or "\n" in text or len(text) >= 4096:
        return False
    try:
        return Path(text).is_file()
    except OSError:  # a sentence is not a file name: too long a component, or characters the OS refuses
        return False


def encode_text(text: str | os.PathLike | None, tokenizer=None, *, max_tokens: int = 512) -> torch.Tensor:
    """Token ids ``[1, T]`` of ``text`` (default :func:`default_text`), at most ``max_tokens`` long.

    Without a tokenizer the embedded default model's tokenizer is used.

    Args:
        text: the text, a path to a UTF-8 text file, or None (see :func:`resolve_text`).
        tokenizer: a transformers tokenizer; None loads the default model's.
        max_tokens: keep the first ``max_tokens`` tokens.

    Returns:
        ``[1, T]`` int64 token ids, ``1 <= T <= max_tokens``.

    Raises:
        ValueError: ``max_tokens <= 0``, or an empty text.

    Example:
        >>> from infopt.models import load_default_tokenizer
        >>> encode_text("Hello world", load_default_tokenizer()).shape
        torch.Size([1, 2])
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer")
    return tokenize(resolve_text(text), tokenizer, max_tokens)


def tokenize(body: str, tokenizer, max_tokens: int) -> torch.Tensor:
    # body: the resolved text (never re-read as a path); ids: [1, min(T, max_tokens)]
    if tokenizer is None:
        tokenizer = load_default_tokenizer()
    ids = tokenizer(body, return_tensors="pt")["input_ids"]
    if ids.shape[-1] == 0:
        raise ValueError("the evaluation text encodes to no tokens; pass a longer text")
    return ids[:, :max_tokens]


@dataclass
class Reference:
    """Token ids and the original model's logits on them.

    Attributes:
        input_ids: ``[1, T]`` token ids, CPU.
        logits: ``[1, T, V]`` CPU. :func:`reference_logits` keeps raw fp32 logits;
            :func:`infopt.eval.make_reference` keeps log-probabilities (log-softmax, a valid set of
            logits) in fp16 by default. Row ``t`` predicts token ``t + 1``.
        window, stride: the strided layout the logits were computed with
            (:func:`infopt.eval.windows.window_layout`); ``window=None`` means one forward over all
            ``T`` tokens.
        meta: what it was computed from (text hash, tokenizer, model name, exact reference NLL, ...).

    Example:
        >>> ref = Reference(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8))
        >>> ref.layout()
        (Window(begin=0, end=3, first=0),)
    """

    input_ids: torch.Tensor
    logits: torch.Tensor
    window: int | None = None
    stride: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.input_ids.dim() != 2 or self.input_ids.shape[0] != 1:
            raise ValueError(f"Reference.input_ids must be [1, T], got shape {tuple(self.input_ids.shape)}")
        if self.logits.dim() != 3 or tuple(self.logits.shape[:2]) != tuple(self.input_ids.shape):
            raise ValueError(f"Reference.logits must be [1, T, V] with T = {self.input_ids.shape[1]}, got shape "
                             f"{tuple(self.logits.shape)}")

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def vocab(self) -> int:
        return int(self.logits.shape[-1])

    @property
    def round_to(self) -> torch.dtype | None:
        """The dtype a model's log-probs are rounded through before comparison (stored log-probs only)."""
        return self.logits.dtype if self.meta.get("logprobs") else None

    def layout(self) -> tuple[Window, ...]:
        """The windows the reference logits were computed on."""
        window = self.window or self.tokens
        return window_layout(self.tokens, window, self.stride or window)


def _check_ids(model: nn.Module, input_ids: torch.Tensor, what: str = "the model") -> None:
    vocab = model_vocab(model)
    top = int(input_ids.max())
    if top >= vocab:
        raise IncompatibleModelError(f"token id {top} is outside the vocabulary of {what} ({vocab}); pass the "
                                     "model's own tokenizer")


@torch.inference_mode()
def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(input_ids.to(device), use_cache=False)
    return out.logits.float().cpu()


def reference_logits(model: nn.Module, text: str | None = None, tokenizer=None, *, max_tokens: int = 512,
                     input_ids: torch.Tensor | None = None) -> Reference:
    """Run ``model`` once on the evaluation text and keep its fp32 logits as the reference.

    One forward over all tokens (no windows): meant for short texts such as the 512-token gate of
    :func:`infopt.optimize`. For long texts use :func:`infopt.eval.make_reference`.

    Args:
        model: the unoptimized model.
        text: see :func:`encode_text`.
        tokenizer: the model's tokenizer (default: the default model's).
        max_tokens: token budget.
        input_ids: ``[1, T]`` ids to use instead of encoding ``text``.

    Returns:
        A :class:`Reference` with raw ``[1, T, V]`` fp32 logits.

    Raises:
        ValueError: bad text or ``max_tokens``; ids outside the model's vocabulary
            (:class:`~infopt.core.errors.IncompatibleModelError`).

    Example:
        >>> from infopt.models import tiny_model
        >>> ref = reference_logits(tiny_model(), input_ids=torch.tensor([[1, 2, 3]]))
        >>> ref.logits.shape
        torch.Size([1, 3, 49152])
    """
    if input_ids is None:
        input_ids = encode_text(text, tokenizer, max_tokens=max_tokens)
    _check_ids(model, input_ids)
    return Reference(input_ids=input_ids, logits=_logits(model, input_ids))


def logit_metrics(logits: torch.Tensor, ref_logits: torch.Tensor,
                  input_ids: torch.Tensor | None = None) -> dict[str, float]:
    """KL(ref || model) per token (mean, max), top-1 agreement, and both perplexities, from full tensors.

    Args:
        logits, ref_logits: ``[1, T, V]`` (or ``[T, V]`` without ``input_ids``).
        input_ids: ``[1, T]`` (for next-token perplexity); None: no perplexities (e.g. logits teacher-forced
            through :func:`~infopt.eval.decode_path_logits`, whose targets are not the ids of a sequence).

    Returns:
        ``{"kl", "kl_max", "top1", "ppl", "ppl_ref", "tokens"}``, without the last three when ``input_ids`` is
        None; KL in nats/token.

    Example:
        >>> x = torch.randn(1, 4, 10)
        >>> logit_metrics(x, x, torch.tensor([[1, 2, 3, 4]]))["kl"]
        0.0
    """
    lp = F.log_softmax(logits.float(), dim=-1)  # [1, T, V]
    lq = F.log_softmax(ref_logits.float(), dim=-1)
    # KL is never negative; in fp32 a position whose logits differ by rounding only can sum to -1e-7, which a
    # lossless recipe's report would print as a negative KL (as eval.windows does, such a position counts 0)
    kl = (lq.exp() * (lq - lp)).sum(-1).clamp_min(0.0)  # [1, T]
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
    if input_ids is None:
        return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(top1)}
    tgt = input_ids[:, 1:]
    nll = -lp[:, :-1].gather(-1, tgt.unsqueeze(-1)).mean()
    nll_ref = -lq[:, :-1].gather(-1, tgt.unsqueeze(-1)).mean()
    return {
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float(top1),
        "ppl": float(nll.exp()),
        "ppl_ref": float(nll_ref.exp()),
        "tokens": int(input_ids.shape[1]),
    }


def compare(model: nn.Module, reference: Reference) -> dict[str, float]:
    """Metrics of ``model`` against a :class:`Reference` made from the original, on the reference's windows.

    Args:
        model: the (optimized) model.
        reference: from :func:`reference_logits`, :func:`infopt.eval.make_reference` or
            :func:`infopt.eval.load_reference`.

    Returns:
        ``{"kl", "kl_max", "top1", "ppl", "ppl_ref", "tokens"}`` (the figures a recipe gate reads);
        :func:`infopt.eval.evaluate` gives the fuller :class:`~infopt.eval.EvalResult`.

    Raises:
        ValueError: the reference's vocabulary differs from the model's, or it has fewer than 2 tokens.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> compare(m, reference_logits(m, input_ids=torch.tensor([[1, 2, 3]])))["kl"]
        0.0
    """
    check_reference(model, reference)
    fig = measure(model, reference.input_ids, reference.layout(), ref_logprobs=reference.logits,
                  round_to=reference.round_to, ref_nll=reference.meta.get("nll"))
    return {k: fig[k] for k in ("kl", "kl_max", "top1", "ppl", "ppl_ref", "tokens")}


def check_reference(model: nn.Module, reference: Reference) -> None:
    """Check that ``reference`` can be compared with ``model``.

    Args:
        model: the model to measure.
        reference: the reference.

    Returns:
        None.

    Raises:
        ValueError: the vocabularies differ or an id is outside the model's
            (:class:`~infopt.core.errors.IncompatibleModelError`), or fewer than 2 tokens.

    Example:
        >>> from infopt.models import tiny_model
        >>> check_reference(tiny_model(), Reference(torch.tensor([[1, 2]]), torch.zeros(1, 2, 49152)))
    """
    if model_vocab(model) != reference.vocab:
        raise IncompatibleModelError(
            f"the reference has logits over {reference.vocab} tokens but the model's vocabulary is "
            f"{model_vocab(model)}; compute the reference from the same model (before optimizing)")
    _check_ids(model, reference.input_ids)
    if reference.tokens < 2:
        raise ValueError(f"the reference has {reference.tokens} token; perplexity needs at least 2")


def gate_failures(figures: dict[str, Any], gate: dict[str, float]) -> list[str]:
    """The gate conditions ``figures`` miss, as readable lines (empty when the gate passes).

    Args:
        figures: from :func:`compare`, or ``EvalResult.to_dict()``; with ``figures["decode_path"]``
            (:func:`~infopt.eval.decode_path_compare`'s, as ``optimize``'s gate and ``run_bench`` measure it),
            ``max_kl`` and ``min_top1`` hold along the decode path too.
        gate: ``{"max_kl": ..., "min_top1": ..., "max_ppl_ratio": ..., "min_answers": ...}`` (any subset;
            ``min_answers`` reads ``figures["answers"]``, the share of identical chat answers).

    Returns:
        One line per missed limit.

    Example:
        >>> gate_failures({"kl": 0.02, "top1": 0.99, "ppl": 10.0, "ppl_ref": 10.0}, {"max_kl": 0.01})
        ['KL 0.02 > max_kl 0.01']
        >>> gate_failures({"kl": 0.004, "top1": 0.97, "decode_path": {"kl": 0.03, "top1": 0.9}}, {"max_kl": 0.01})
        ['decode-path KL 0.03 > max_kl 0.01']
    """
    out = []
    path = figures.get("decode_path") or {}
    if "max_kl" in gate and figures["kl"] > gate["max_kl"]:
        out.append(f"KL {figures['kl']:.4g} > max_kl {gate['max_kl']}")
    if "max_kl" in gate and path.get("kl", 0.0) > gate["max_kl"]:
        out.append(f"decode-path KL {path['kl']:.4g} > max_kl {gate['max_kl']}")
    if "min_top1" in gate and figures["top1"] < gate["min_top1"]:
        out.append(f"top-1 agreement {figures['top1']:.4f} < min_top1 {gate['min_top1']}")
    if "min_top1" in gate and path.get("top1", 1.0) < gate["min_top1"]:
        out.append(f"decode-path top-1 agreement {path['top1']:.4f} < min_top1 {gate['min_top1']}")
    if "max_ppl_ratio" in gate and figures["ppl"] / figures["ppl_ref"] > gate["max_ppl_ratio"]:
        out.append(f"perplexity ratio {figures['ppl'] / figures['ppl_ref']:.4f} > max_ppl_ratio {gate['max_ppl_ratio']}")
    if "min_answers" in gate and figures["answers"] < gate["min_answers"]:
        out.append(f"chat answers identical {figures['answers']:.3g} < min_answers {gate['min_answers']}")
    return out
