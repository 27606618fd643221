"""Verification rules of speculative decoding: greedy prefix matching and the rejection-sampling rule.

Both take the target's scores for every drafted position at once (one verify forward) and return, per
row, how many drafted tokens are accepted and the token the target adds after them. The sampling rule
(Leviathan et al. 2023; Chen et al. 2023) accepts drafted token ``x`` with probability
``min(1, p(x) / q(x))`` and, at the first rejection, samples from ``max(0, p - q)`` normalized, so every
emitted token is distributed exactly as the target's ``p``, whatever the draft's ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generate.sampling import filter_logits

__all__ = ["Warp", "verify_greedy", "verify_sample"]


@dataclass(frozen=True)
class Warp:
    """The sampling transforms ``generate`` applies before sampling, in its order: temperature, top-k, top-p.

    Attributes:
        temperature: divides the logits (1.0: unchanged).
        top_k: keep the ``top_k`` largest logits (0 or None: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: all).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def filter(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[..., V]`` (fp32) filtered by these settings: :func:`infopt.generate.sampling.filter_logits`.

        Example:
            >>> Warp(top_k=2).filter(torch.tensor([[1.0, 2.0, 3.0]]))
            tensor([[-inf, 2., 3.]])
        """
        return filter_logits(scores, self.temperature, self.top_k, self.top_p)


def verify_greedy(scores: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest drafted prefix the target's argmax agrees with.

    Args:
        scores: ``[B, k + 1, V]`` target scores (fp32, EOS already masked where ``min_new_tokens`` asks);
            position ``j`` predicts the token after the ``j``-th input.
        draft: ``[B, k]`` drafted tokens.
        lengths: ``[B]`` drafted tokens per row that are real (rows may draft fewer than ``k``).

    Returns:
        ``(accepted [B], targets [B, k + 1])``: accepted drafted tokens per row, and the target's argmax at
        every position (the emitted tokens are ``draft[:, :a]`` then ``targets[:, a]``).
    """
    targets = scores.argmax(dim=-1)  # [B, k + 1]
    k = draft.shape[1]
    ok = draft == targets[:, :k]
    ok &= torch.arange(k, device=draft.device)[None] < lengths[:, None]
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    return accepted, targets


def verify_sample(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, lengths: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative sampling rule: the emitted tokens are distributed exactly as the target's ``p``.

    Args:
        p: ``[B, k + 1, V]`` target probabilities (after warping).
        q: ``[B, k, V]`` draft probabilities the drafted tokens were sampled from, or None for a deterministic
            drafter (prompt lookup: ``q`` is a point mass on the drafted token).
        draft: ``[B, k]`` drafted tokens.
        lengths: ``[B]`` real drafted tokens per row.
        generator: random generator (default: torch's global one, as ``generate`` uses).

    Returns:
        ``(accepted [B], next_token [B])``: accepted drafted tokens per row, and the token sampled after them
        (from the residual ``max(0, p - q)`` at a rejection, from ``p`` when every drafted token was accepted).

    Example:
        >>> p = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]]); q = torch.tensor([[[0.0, 1.0]]])
        >>> a, t = verify_sample(p, q, torch.tensor([[1]]), torch.tensor([1]))
        >>> a.shape, t.shape
        (torch.Size([1]), torch.Size([1]))
    """
    B, k1, V = p.shape
    k = k1 - 1
    rows = torch.arange(B, device=p.device)
    if k > 0:
        p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
        q_d = torch.ones_like(p_d) if q is None else q.gather(-1, draft[..., None]).squeeze(-1)
        u = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p_d.dtype)
        ok = u * q_d < p_d  # u < p/q without dividing by a zero q
        ok &= torch.arange(k, device=p.device)[None] < lengths[:, None]
        accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=p.device)
    dist = p[rows, accepted]  # [B, V]: p at the first rejected (or the bonus) position
    rejected = accepted < lengths
    if bool(rejected.any()):
        at = accepted.clamp(max=max(k - 1, 0))
        if q is None:
            q_at = torch.zeros_like(dist).scatter_(-1, draft[rows, at][:, None], 1.0)
        else:
            q_at = q[rows, at]
        residual = (dist - q_at).clamp_(min=0)
        total = residual.sum(-1, keepdim=True)
        # p == q exactly leaves no residual, but then nothing is rejected; guard against rounding anyway
        residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), dist)
        dist = torch.where(rejected[:, None], residual, dist)
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    return accepted, next_token
