"""Where a lossless recipe's greedy output parts from the reference, and whether each parting is a near-tie.

A lossless step computes the model's own math with sums in another order, so its logits differ from the reference's
in the last bits; a greedy token can flip only where the reference's top two tokens were that close. For every
request whose tokens differ, :func:`divergences` finds the first differing position, runs the reference model on the
prompt and its own tokens up to there, and reports the reference's top-2 logit margin at that step. A divergence
counts as a near-tie only below :data:`NEAR_TIE` for the model's dtype; one above it means the recipe changed the
math (a lossless claim that does not hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["NEAR_TIE", "near_tie_margin", "divergences", "summarize_divergences"]

NEAR_TIE: dict[str, float] = {"float32": 0.02, "float16": 0.1, "bfloat16": 0.25}
"""The reference's top-2 logit margin under which a flipped greedy token counts as a near-tie, per dtype.

Reordered fp32 sums move a 30-layer model's logits by about 1e-4 to 1e-3; a margin 20x that is still a tie. In
16-bit floats each rounding is 2^-11 (fp16) or 2^-8 (bf16) of a logit of 10-20, and batched or fused kernels round at
other places: 0.1 and 0.25 allow a few such roundings."""


def near_tie_margin(dtype: torch.dtype | str) -> float:
    """:data:`NEAR_TIE` for ``dtype`` (the bf16 margin for a dtype it does not list)."""
    return NEAR_TIE.get(str(dtype).replace("torch.", ""), NEAR_TIE["bfloat16"])


@torch.inference_mode()
def divergences(model: nn.Module, prompts: list[torch.Tensor], reference: list[list[int]], tokens: list[list[int]]
                ) -> list[dict[str, Any]]:
    """The first differing position of each request whose ``tokens`` differ from ``reference``, with the reference
    model's top-2 logit margin there.

    Args:
        model: the reference (unoptimized) model.
        prompts: per request, ``[1, prompt_len]`` token ids.
        reference: per request, the reference's generated tokens.
        tokens: per request, the tokens to compare.

    Returns:
        One dict per differing request: ``request``, ``position`` (generated-token index), ``reference_token``,
        ``token``, ``margin`` (reference's top-1 minus top-2 logit at that step), ``gap`` (its logit of its token
        minus of the other's) and ``near_tie`` (``margin`` below :func:`near_tie_margin` of the model's dtype).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> p = torch.tensor([[1, 2, 3]])
        >>> ref = m.generate(p, max_new_tokens=4, do_sample=False)[0, 3:].tolist()
        >>> divergences(m, [p], [ref], [ref])
        []
        >>> d, = divergences(m, [p], [ref], [ref[:2] + [(ref[2] + 1) % 100, 5]])
        >>> d["position"], d["margin"] >= 0, d["gap"] >= d["margin"]
        (2, True, True)
    """
    limit = near_tie_margin(next(model.parameters()).dtype)
    device = next(model.parameters()).device
    out = []
    for i, (prompt, ref, got) in enumerate(zip(prompts, reference, tokens, strict=True)):
        n = min(len(ref), len(got))
        pos = next((j for j in range(n) if ref[j] != got[j]), None)
        if pos is None:
            continue
        ids = torch.cat([prompt.reshape(1, -1).cpu(), torch.tensor([ref[:pos]], dtype=torch.long)], dim=1).to(device)
        logits = model(ids).logits[0, -1].float()
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1])
        out.append({"request": i, "position": pos, "reference_token": int(ref[pos]), "token": int(got[pos]),
                    "margin": margin, "gap": float(logits[ref[pos]] - logits[got[pos]]), "near_tie": margin < limit})
    return out


def summarize_divergences(found: list[dict[str, Any]], requests: int, dtype: torch.dtype | str) -> str:
    """One line for a report: how many requests parted, where, at what margins, and whether all were near-ties."""
    if not found:
        return f"greedy outputs identical to the baseline on all {requests} requests"
    limit = near_tie_margin(dtype)
    ties = sum(d["near_tie"] for d in found)
    shown = ", ".join(f"#{d['request']} at token {d['position']} (margin {d['margin']:.2g})" for d in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    verdict = (f"all near-ties (reference top-2 margin < {limit:g} in {str(dtype).replace('torch.', '')})"
               if ties == len(found) else
               f"{len(found) - ties} above the near-tie margin {limit:g}: the outputs differ by more than summation "
               "order")
    return f"greedy outputs part from the baseline on {len(found)} of {requests} requests: {shown}{more}; {verdict}"
