"""Quality in a user's terms: does the optimized model give the same chat answers?

KL divergence and top-1 agreement on reference text measure every token's distribution, but a user sees answers: a
KL of 0.003 nats per token still flips a greedy answer wherever the original's top two tokens were close, and once
one token differs the rest of the answer follows another path. :func:`answer_agreement` greedy-decodes a small
built-in set of chat questions (:data:`CHAT_PROMPTS`: facts, arithmetic, code, instructions, languages) with both
models and reports how many answers are the same, where each parted and by how much the original preferred its
token there (its top-2 logit margin at that step: a near-tie parts at a small margin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["CHAT_PROMPTS", "AnswerAgreement", "chat_ids", "reference_answers", "answer_agreement"]

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is 12 times 7?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping better.",
)
"""The built-in chat questions (English, short answers), chosen to cover recall, arithmetic, code and instructions."""


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    """``question`` as a user turn in the tokenizer's chat template, ready for the answer.

    Args:
        tokenizer: a tokenizer with a chat template.
        question: the user's message.

    Returns:
        ``[1, S]`` token ids, ending with the template's assistant header.

    Example:
        >>> from infopt.models import load_default_tokenizer
        >>> tok = load_default_tokenizer()
        >>> ids = chat_ids(tok, "Hi")
        >>> ids.shape[0], tok.decode(ids[0]).rstrip().endswith("assistant")
        (1, True)
    """
    msgs = [{"role": "user", "content": question}]
    enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]


@dataclass
class AnswerAgreement:
    """How the optimized model's greedy answers compare with the original's.

    Attributes:
        same: answers identical token for token.
        total: questions asked.
        parted_at: per question, the generated-token index where the answers first differ (None: identical).
        margins: per question, the original model's top-1 minus top-2 logit at that token (None: identical).
        answers: per question, ``(original, optimized)`` decoded text.
    """

    same: int
    total: int
    parted_at: list[int | None] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)
    answers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.same / self.total if self.total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"same": self.same, "total": self.total, "rate": self.rate, "parted_at": self.parted_at,
                "margins": self.margins, "answers": self.answers}

    def __str__(self) -> str:
        parts = [f"{self.same}/{self.total} chat answers identical"]
        parted = [(i, t, m) for i, (t, m) in enumerate(zip(self.parted_at, self.margins, strict=True)) if t is not None]
        if parted:
            parts.append("others parted at token " + ", ".join(
                f"{t} (original's top-2 margin {m:.2f})" for _, t, m in parted))
        return "; ".join(parts)


@torch.inference_mode()
def reference_answers(model: nn.Module, tokenizer, prompts: Sequence[str] = CHAT_PROMPTS, *,
                      max_new_tokens: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The original model's greedy answers and, for each generated token, its top-2 logit margin: what
    :func:`answer_agreement` compares against (record before optimizing in place).

    Args:
        model: the original model.
        tokenizer: its tokenizer (with a chat template).
        prompts: the questions (default :data:`CHAT_PROMPTS`).
        max_new_tokens: answer length recorded.

    Returns:
        Per prompt, ``(generated ids [n], margins [n])``.

    Example:
        >>> from infopt.models import tiny_model, load_default_tokenizer
        >>> (ids, margins), = reference_answers(tiny_model(), load_default_tokenizer(), CHAT_PROMPTS[:1],
        ...                                     max_new_tokens=3)
        >>> ids.shape == margins.shape == (3,), bool((margins >= 0).all())
        (True, True)
    """
    out = []
    for q in prompts:
        ids = chat_ids(tokenizer, q)
        res = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
        gen = res.sequences[0, ids.shape[1]:]
        scores = torch.stack([s[0].float() for s in res.scores])  # [n, vocab]
        top2 = scores.topk(2, dim=-1).values
        out.append((gen.cpu(), (top2[:, 0] - top2[:, 1]).cpu()))
    return out


@torch.inference_mode()
def answer_agreement(model: nn.Module, tokenizer, reference: list[tuple[torch.Tensor, torch.Tensor]],
                     prompts: Sequence[str] = CHAT_PROMPTS, *, max_new_tokens: int = 32) -> AnswerAgreement:
    """Greedy-decode ``prompts`` with ``model`` and compare with :func:`reference_answers` of the original.

    Args:
        model: the optimized model.
        tokenizer: its tokenizer (with a chat template).
        reference: :func:`reference_answers` of the original model on the same prompts.
        prompts: the questions (default :data:`CHAT_PROMPTS`).
        max_new_tokens: answer length compared.

    Returns:
        An :class:`AnswerAgreement`.

    Raises:
        ValueError: ``reference`` does not have one entry per prompt.

    Example:
        >>> from infopt.models import tiny_model, load_default_tokenizer
        >>> tok, m = load_default_tokenizer(), tiny_model()
        >>> ref = reference_answers(m, tok, CHAT_PROMPTS[:2], max_new_tokens=4)
        >>> answer_agreement(m, tok, ref, CHAT_PROMPTS[:2], max_new_tokens=4).same
        2
    """
    if len(reference) != len(prompts):
        raise ValueError(f"reference holds {len(reference)} answers for {len(prompts)} prompts; record it with "
                         "reference_answers on the same prompts")
    result = AnswerAgreement(same=0, total=len(prompts))
    for q, (ref_ids, margins) in zip(prompts, reference, strict=True):
        ids = chat_ids(tokenizer, q)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        got = out[0, ids.shape[1]:].cpu()
        n = min(len(got), len(ref_ids))
        diff = (got[:n] != ref_ids[:n]).nonzero()
        if len(diff):
            at = int(diff[0])
        elif len(got) != len(ref_ids):
            at = n  # one stopped where the other went on
        else:
            at = None
        result.same += at is None
        result.parted_at.append(at)
        result.margins.append(None if at is None or at >= len(margins) else float(margins[at]))
        result.answers.append((tokenizer.decode(ref_ids, skip_special_tokens=True).strip(),
                               tokenizer.decode(got, skip_special_tokens=True).strip()))
    return result
