"""Logit-level quality metrics of an optimized model against its original."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Reference", "default_text", "encode_text", "reference_logits", "logit_metrics", "compare", "gate_failures"]


def default_text(max_chars: int = 60_000) -> str:
    """English prose from Python's own documentation (``pydoc_data.topics``), cut deterministically.

    Present in every CPython install, so quality checks need no download.
    """
    from pydoc_data.topics import topics

    parts = [topics[k].strip() for k in sorted(topics)]
    return "\n\n".join(parts)[:max_chars]


def encode_text(text: str | None, tokenizer=None, *, max_tokens: int = 512) -> torch.Tensor:
    """Token ids ``[1, T]`` of ``text`` (default :func:`default_text`), at most ``max_tokens`` long.

    Without a tokenizer the embedded default model's tokenizer is used.
    """
    if tokenizer is None:
        from ..models import load_default_tokenizer

        tokenizer = load_default_tokenizer()
    ids = tokenizer(text if text is not None else default_text(), return_tensors="pt")["input_ids"]
    return ids[:, :max_tokens]


@dataclass
class Reference:
    """Token ids and the original model's logits on them (``[1, T]`` and ``[1, T, V]``, fp32, CPU)."""

    input_ids: torch.Tensor
    logits: torch.Tensor


@torch.inference_mode()
def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(input_ids.to(device), use_cache=False)
    return out.logits.float().cpu()


def reference_logits(model: nn.Module, text: str | None = None, tokenizer=None, *, max_tokens: int = 512,
                     input_ids: torch.Tensor | None = None) -> Reference:
    """Run ``model`` once on the evaluation text and keep its logits as the reference."""
    if input_ids is None:
        input_ids = encode_text(text, tokenizer, max_tokens=max_tokens)
    vocab = model.config.get_text_config().vocab_size
    if int(input_ids.max()) >= vocab:
        raise ValueError(f"token id {int(input_ids.max())} is outside the model's vocabulary ({vocab}); pass the "
                         "model's own tokenizer")
    return Reference(input_ids=input_ids, logits=_logits(model, input_ids))


def logit_metrics(logits: torch.Tensor, ref_logits: torch.Tensor, input_ids: torch.Tensor) -> dict[str, float]:
    """KL(ref || model) per token (mean, max), top-1 agreement, and both perplexities.

    Args:
        logits, ref_logits: ``[1, T, V]``.
        input_ids: ``[1, T]`` (for next-token perplexity).
    """
    lp = F.log_softmax(logits.float(), dim=-1)  # [1, T, V]
    lq = F.log_softmax(ref_logits.float(), dim=-1)
    kl = (lq.exp() * (lq - lp)).sum(-1)  # [1, T]
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
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
    """Metrics of ``model`` against a :class:`Reference` made from the original."""
    return logit_metrics(_logits(model, reference.input_ids), reference.logits, reference.input_ids)


def gate_failures(figures: dict[str, float], gate: dict[str, float]) -> list[str]:
    """The gate conditions ``figures`` miss, as readable lines (empty when the gate passes)."""
    out = []
    if "max_kl" in gate and figures["kl"] > gate["max_kl"]:
        out.append(f"KL {figures['kl']:.4g} > max_kl {gate['max_kl']}")
    if "min_top1" in gate and figures["top1"] < gate["min_top1"]:
        out.append(f"top-1 agreement {figures['top1']:.4f} < min_top1 {gate['min_top1']}")
    if "max_ppl_ratio" in gate and figures["ppl"] / figures["ppl_ref"] > gate["max_ppl_ratio"]:
        out.append(f"perplexity ratio {figures['ppl'] / figures['ppl_ref']:.4f} > max_ppl_ratio {gate['max_ppl_ratio']}")
    return out
