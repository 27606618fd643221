"""Drafters: where the tokens a speculative round proposes come from.

A drafter proposes up to ``k`` tokens per row given the decode state (:class:`~infopt.speculative.loop.State`),
and hears about each round's outcome through ``rollback`` so it can drop what the target rejected.

- :class:`LookupDrafter`: n-gram matches in the row's own prompt and output, found with tensor ops
  (one ``unfold`` and compare per n-gram size, no per-token Python scans).
- :class:`ModelDrafter`: a smaller causal LM (a separate draft model, or a quantized / layer-truncated
  copy of the target) decoding ``k`` tokens on its own croppable cache, whose slots mirror the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..generate import Forward, croppable, full_length_dynamic_cache, rollback

__all__ = ["Drafter", "LookupDrafter", "ModelDrafter", "rollback", "croppable"]


class Drafter:
    """Base class: ``begin`` at the start of a call, ``propose`` each round, ``rollback`` after verification."""

    #: cost of drafting one token, in target decode steps (adaptive k)
    draft_cost: float = 0.3
    #: acceptance-rate prior for the adaptive controller
    prior_acceptance: float = 0.7
    #: plain rounds between probes when drafting does not pay (a model drafter's probe also catches its cache up)
    probe_every: int = 32

    def begin(self, state, decoder=None) -> None:
        """A new ``generate`` call starts (the target's prefill is done); ``decoder`` is the target's
        :class:`~infopt.generate.Decoder` (None when the loop runs outside one)."""

    def propose(self, state, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft up to ``k`` tokens per row.

        Returns:
            ``(draft [B, k'], q [B, k', V] or None, lengths [B])``: ``k' <= k`` drafted columns, the draft
            distribution they were sampled from (None for a deterministic drafter) and the real count per row.
        """
        raise NotImplementedError

    def rollback(self, state) -> None:
        """The target kept ``state.length`` cache slots; drop anything past them."""

    def end(self) -> None:
        """The call ended: release per-call buffers."""


class LookupDrafter(Drafter):
    """Prompt lookup: the continuation of an earlier occurrence of the row's last n-gram (the most recent one
    with ``k`` tokens after it, else the earliest).

    Longer n-grams win; rows without any match draft nothing (the round is then a plain decode step).

    Args:
        ngram: ``(min, max)`` n-gram sizes tried, longest first.
    """

    draft_cost = 0.0  # a few tensor ops per round, next to a forward of the model
    prior_acceptance = 0.5
    probe_every = 8  # a probe costs one extra verified token

    def __init__(self, ngram: tuple[int, int] = (1, 3)):
        self.ngram = ngram

    def propose(self, state, k):
        out, ends = state.out, state.ends  # out: [B, T + N] prompt + emitted; ends: [B] filled length per row
        B = out.shape[0]
        L = int(ends.max())
        hist = out[:, :L]
        dev = out.device
        best_start = torch.full((B,), -1, dtype=torch.long, device=dev)
        for g in range(self.ngram[1], self.ngram[0] - 1, -1):
            if L <= g:
                continue
            key_idx = (ends - g).clamp(min=0)[:, None] + torch.arange(g, device=dev)  # [B, g]
            key = hist.gather(1, key_idx)
            windows = hist.unfold(1, g, 1)  # [B, L - g + 1, g]
            starts = torch.arange(windows.shape[1], device=dev)
            hit = (windows == key[:, None, :]).all(-1) & (starts[None] + g < ends[:, None])
            # the most recent match with a full k-token continuation, else the earliest (longest continuation)
            full = hit & (starts[None] + g + k <= ends[:, None])
            last = torch.where(full, starts[None], -1).max(dim=-1).values
            first = torch.where(hit, starts[None], L).min(dim=-1).values
            last = torch.where(last >= 0, last, torch.where(first < L, first, -1))
            found = (last >= 0) & (best_start < 0)
            best_start = torch.where(found, last + g, best_start)
        lengths = torch.where(best_start >= 0, (ends - best_start).clamp(max=k), 0)
        kk = int(lengths.max())
        if kk == 0:
            return out.new_empty(B, 0), None, lengths
        idx = best_start.clamp(min=0)[:, None] + torch.arange(kk, device=dev)
        draft = hist.gather(1, idx.clamp(max=L - 1))
        return draft, None, lengths


class ModelDrafter(Drafter):
    """Drafts with a smaller causal LM on its own croppable cache; its slots mirror the target's, so the
    target's mask and positions serve it too, and a rollback is one crop.

    Args:
        draft: the draft model (same tokenizer as the target).
        draft_cost: its one-token forward time relative to the target's (for the adaptive draft length).
        confidence: a row stops drafting after a token the draft gives less than this probability (0: never);
            the verification rule does not depend on it, so the output is unchanged, only fewer drafts wasted.
        prior_acceptance: the acceptance rate the adaptive draft length assumes before any round is verified.
    """

    def __init__(self, draft: nn.Module, draft_cost: float = 0.3, confidence: float = 0.4,
                 prior_acceptance: float = 0.7):
        self.draft = draft
        self.draft_cost = draft_cost
        self.prior_acceptance = prior_acceptance
        self.confidence = confidence
        self.cache = None
        self.forward: Forward | None = None
        self.length = 0  # slots the draft cache holds

    def begin(self, state, decoder=None) -> None:
        """Open the draft's cache (the target's cache kind where it can: static beside static) and its forward
        (compiled beside a compiled target)."""
        B, S = state.slot_ids.shape
        if decoder is not None:
            self.cache = decoder.cache_for(self.draft, B, S)
            self.forward = decoder.forward_for(self.draft)
        else:
            self.cache, self.forward = full_length_dynamic_cache(self.draft.config), Forward(self.draft)
        if not croppable(self.cache):
            self.cache = full_length_dynamic_cache(self.draft.config)
        self.length = 0

    def _forward(self, state, ids, positions, end):
        k = ids.shape[1]
        mask = state.slot_mask if state.use_mask else None
        if k == end:  # the first pass over the prompt: a prefill (its width changes from call to call)
            return self.forward.prefill(ids, positions, mask[:, :end] if mask is not None else None,
                                        self.cache)[:, -1].float()
        cache_position = torch.arange(end - k, end, device=ids.device)
        return self.forward.step(ids, positions, cache_position, mask, self.cache)[:, -1]  # [B, V_draft] fp32

    def propose(self, state, k):
        B = state.out.shape[0]
        C = state.length
        # catch up on target slots the draft has not seen, then the pending token (slot C)
        ids = torch.cat([state.slot_ids[:, self.length:C], state.pending[:, None]], dim=1)
        pos = torch.cat([state.slot_pos[:, self.length:C], state.next_pos[:, None]], dim=1)
        state.slot_ids[:, C] = state.pending
        state.slot_pos[:, C] = state.next_pos
        state.slot_mask[:, C] = 1
        V = state.vocab
        tokens, probs = [], []
        lengths = torch.full((B,), k, dtype=torch.long, device=state.out.device)
        going = torch.ones(B, dtype=torch.bool, device=state.out.device)  # rows still drafting
        end = C + 1
        for j in range(k):
            scores = self._forward(state, ids, pos, end)[:, :V]
            state.mask_eos(scores, j)
            if state.warp is None:
                tok = scores.argmax(dim=-1)
                conf = scores.softmax(dim=-1).gather(1, tok[:, None]).squeeze(1) if self.confidence else None
            else:
                q = state.warp.filter(scores).softmax(dim=-1)
                tok = torch.multinomial(q, 1).squeeze(-1)
                probs.append(q)
                conf = q.gather(1, tok[:, None]).squeeze(1) if self.confidence else None
            tokens.append(tok)
            if conf is not None and j + 1 < k:
                # a row stops after a token its draft is unsure of: what follows it is likely rejected
                low = going & (conf < self.confidence)
                lengths = torch.where(low, j + 1, lengths)
                going &= ~low
                if not bool(going.any()):
                    break
            if j + 1 < k:
                ids, pos = tok[:, None], pos[:, -1:] + 1
                state.slot_ids[:, end] = tok
                state.slot_pos[:, end] = pos[:, 0]
                state.slot_mask[:, end] = 1
                end += 1
        if k > 0:
            self.length = end  # slots C .. end - 1 hold the pending token and the drafts fed back
        draft = torch.stack(tokens, dim=1) if tokens else state.out.new_empty(B, 0)
        q = torch.stack(probs, dim=1) if probs else None
        return draft, q, lengths.clamp(max=draft.shape[1])

    def rollback(self, state) -> None:
        if self.length > state.length:
            rollback(self.cache, self.length - state.length)
            self.length = state.length

    def end(self) -> None:
        self.cache = None
