"""The speculative decode loop: draft, verify all drafted tokens in one target forward, keep the agreeing part.

Per round each row sends ``[pending, d_1 .. d_k]`` through the target at once; greedy keeps the longest
prefix the target's argmax agrees with plus the target's own next token (so the output is the target's
greedy output, token for token), sampling applies the rejection rule of :func:`~.sampling.verify_sample`.
The cache is then cut back to the longest kept prefix of the batch; rows that kept fewer tokens mark the
extra slots as holes in the attention mask (positions come from the row's own count, as with left padding),
so every row of a batch keeps its own accept length. The draft length adapts to the running acceptance
rate and the drafter's relative cost (:class:`Controller`); at 0 the round is a plain decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..generate import Forward, GenerateCall, Unsupported, positions_of, rollback
from .drafters import Drafter
from .sampling import Warp, verify_greedy, verify_sample

__all__ = ["warp_of", "State", "Controller", "SpecStats", "speculative_decode"]


def warp_of(call: GenerateCall) -> Warp | None:
    """The sampling warp of a call (None: greedy).

    Raises:
        Unsupported: settings the speculative loop does not sample with (``min_p``, ``temperature <= 0``,
            ``stop_strings``, the penalties of :data:`~infopt.generate.call.PENALTIES`).
    """
    if call.stop_strings:
        raise Unsupported("stop_strings")
    if call.penalties:
        raise Unsupported(call.penalties[0])
    if not call.do_sample:
        return None
    if call.min_p is not None:
        raise Unsupported(f"min_p={call.min_p}")
    if call.temperature <= 0:
        raise Unsupported(f"temperature={call.temperature}")
    call.warpers()  # refuses what transformers would warp with and this loop would not (top_h)
    return Warp(temperature=call.temperature, top_k=call.top_k, top_p=call.top_p)


@dataclass
class SpecStats:
    """Running counts over every call served (reported on ``model.infopt``)."""

    calls: int = 0
    rounds: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    target_forwards: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counts plus ``acceptance_rate`` (accepted / drafted), ``mean_accepted_length`` (accepted drafted
        tokens per row and round that drafted) and ``target_forwards_per_token``."""
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["mean_accepted_length"] = self.accepted / self.draft_rounds if self.draft_rounds else 0.0
        d["target_forwards_per_token"] = self.target_forwards / self.tokens if self.tokens else 0.0
        return d


class Controller:
    """Picks each round's draft length: fixed, or adaptive from the running acceptance rate.

    Adaptive: with per-token acceptance ``a`` a round drafting ``k`` yields ``(1 - a^(k+1)) / (1 - a)``
    tokens per row and costs ``draft_cost k + verify(k)`` plain decode steps, where ``verify(k)`` is the
    target's ``k + 1``-token forward: ``1 + verify_cost k`` by default, or ``verify_costs[k]`` where the forward
    was timed (a compile step's warm-up times its graphs: on a CPU a 2..16-token verify costs about the
    same, well above one token). It picks the ``k`` in ``0..cap`` with the most tokens per cost, 0 (a plain
    decode step) when drafting does not pay. Acceptance runs in streaks (a passage being copied, a stretch of
    boilerplate), so ``a`` is tracked separately after rounds whose drafts were all accepted and after rounds
    with a rejection. While at 0 it probes with a one-token draft after ``probe_every`` plain rounds, doubling
    the wait (up to 8x) while probes fail. Costs are fixed for a decode call, never timed per round: a loaded
    machine's timing noise would steer the choice, and the same inputs give the same draft lengths (the
    defaults were measured once per drafter kind with ``benchmarks/studies/speculative_profile.py``).

    Args:
        fixed: a fixed draft length, or None for adaptive.
        cap: the largest draft length adaptive may pick.
        draft_cost: cost of drafting one token, in target decode steps.
        verify_cost: extra cost of verifying one more token in the target forward, in decode steps.
        prior_acceptance: ``a`` before any round was verified.
        probe_every: plain rounds between probes.
        shrink: weight (in tokens) of the overall acceptance in the after-accept / after-reject estimates; small
            for drafters whose acceptance comes in long streaks (prompt lookup).
        verify_costs: ``cap + 1`` costs of a verify with ``0..cap`` drafts, in decode steps (``verify_costs[0]``
            is 1); None: ``1 + verify_cost k``.
    """

    MIN_EVIDENCE = 4
    """Rounds verified before the controller may fall back to plain decoding."""

    def __init__(self, fixed: int | None, cap: int, draft_cost: float, verify_cost: float = 0.06,
                 prior_acceptance: float = 0.7, probe_every: int = 16, shrink: float = 4.0,
                 verify_costs: list[float] | None = None):
        self.fixed, self.cap = fixed, cap
        if verify_costs is None:
            verify_costs = [1.0 + verify_cost * k for k in range(cap + 1)]
        if len(verify_costs) < cap + 1:
            raise ValueError(f"verify_costs has {len(verify_costs)} entries; {cap + 1} needed (0..cap drafts)")
        self.round_cost = [draft_cost * k + verify_costs[k] for k in range(cap + 1)]  # in decode steps
        # decayed counts of accepted tokens and of accepted + rejected ones: over all rounds (with a prior worth
        # four rounds), and split by the previous round's outcome: after a full accept [0], after a rejection [1]
        self.all_num, self.all_den = 4.0 * prior_acceptance, 4.0
        self.shrink = shrink
        self.num = [0.0, 0.0]
        self.den = [0.0, 0.0]
        self.verified = 0  # rounds verified so far: the first drafts stay short until acceptance is measured
        self.streak = 1  # 0: the last verified round accepted everything it drafted
        self.plain_rounds = 0
        self.probe_every = probe_every
        self.interval = probe_every

    @property
    def acceptance(self) -> float:
        """The per-token acceptance rate expected in the next round."""
        overall = self.all_num / self.all_den
        s = self.streak  # the split estimate, shrunk toward the overall one while it has few rounds behind it
        return (self.num[s] + self.shrink * overall) / (self.den[s] + self.shrink)

    def best_k(self) -> int:
        """The draft length with the most expected tokens per unit of cost (0: plain decoding)."""
        a = min(self.acceptance, 0.98)
        best_k, best = 0, 1.0
        for k in range(1, self.cap + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / self.round_cost[k]
            if rate > best:
                best_k, best = k, rate
        return best_k

    def next_k(self) -> int:
        if self.fixed is not None:
            return self.fixed
        k = self.best_k()
        if self.verified < 2:
            k = min(k, 2)
        if self.verified < self.MIN_EVIDENCE:
            # one unlucky first round must not stop drafting for a whole probe interval: the estimate is still
            # mostly the prior, and where a verify costs well above a decode step (a compiled CPU forward), a
            # single rejection moves it below break-even
            k = max(k, 1)
        if k == 0:
            self.plain_rounds += 1
            if self.plain_rounds >= self.interval:  # acceptance may have changed (a passage to copy begins)
                self.plain_rounds = 0
                self.interval = min(8 * self.probe_every, 2 * self.interval)  # back off while probes fail
                return 1
        else:
            self.plain_rounds = 0
            self.interval = self.probe_every
        return k

    def update(self, k: int, accepted: torch.Tensor, lengths: torch.Tensor) -> None:
        """Record a verified round: ``accepted`` / ``lengths`` ``[B]`` drafted tokens kept / proposed per row."""
        live = lengths > 0
        if k == 0 or not bool(live.any()):
            return
        self.verified += 1
        acc = float(accepted[live].sum())
        rejected = float((accepted[live] < lengths[live]).sum())
        s = self.streak
        self.num[s] = 0.8 * self.num[s] + acc
        self.den[s] = 0.8 * self.den[s] + acc + rejected
        self.all_num = 0.8 * self.all_num + acc
        self.all_den = 0.8 * self.all_den + acc + rejected
        self.streak = 0 if rejected == 0 else 1


@dataclass
class State:
    """Decode state shared with the drafter.

    Attributes:
        out: ``[B, T + N]`` prompt then emitted tokens; ``ends`` ``[B]``: filled length per row.
        slot_ids / slot_pos / slot_mask: ``[B, S]`` token, position and validity of every target cache slot
            (rejected slots of a row are holes: mask 0).
        length: slots the target cache holds; ``pending`` ``[B]``: the last emitted token, not yet in the cache,
            at position ``next_pos`` ``[B]``.
    """

    out: torch.Tensor
    ends: torch.Tensor
    slot_ids: torch.Tensor
    slot_pos: torch.Tensor
    slot_mask: torch.Tensor
    length: int
    pending: torch.Tensor
    next_pos: torch.Tensor
    use_mask: bool
    warp: Warp | None
    vocab: int
    n_out: torch.Tensor
    min_new: int
    eos: torch.Tensor | None
    extra: dict[str, Any] = field(default_factory=dict)

    def mask_eos(self, scores: torch.Tensor, offset) -> None:
        """Forbid EOS (in place) where the emitted-token index is below ``min_new_tokens``; ``scores`` is
        ``[B, V]`` at draft offset ``offset`` (int) or ``[B, J, V]`` for offsets ``0 .. J-1``."""
        if self.eos is None or self.min_new == 0:
            return
        if scores.dim() == 2:
            block = (self.n_out + offset) < self.min_new  # [B]
            if bool(block.any()):
                scores[:, self.eos] = scores[:, self.eos].masked_fill(block[:, None], -float("inf"))
            return
        J = scores.shape[1]
        block = (self.n_out[:, None] + torch.arange(J, device=scores.device)) < self.min_new  # [B, J]
        if bool(block.any()):
            scores[..., self.eos] = scores[..., self.eos].masked_fill(block[..., None], -float("inf"))


def _pick(scores: torch.Tensor, warp: Warp | None) -> torch.Tensor:
    if warp is None:
        return scores.argmax(dim=-1)
    return torch.multinomial(warp.filter(scores).softmax(dim=-1), 1).squeeze(-1)


@torch.no_grad()
def speculative_decode(call: GenerateCall, cache, forward: Forward, drafter: Drafter, controller: Controller,
                       stats: SpecStats, capacity: int | None = None, decoder=None) -> torch.Tensor:
    """Generate for ``call`` with ``drafter`` proposing and ``forward`` (the target's) verifying, on ``cache``
    (empty, croppable).

    Args:
        capacity: cache slots available (a static cache's length); None: unbounded.
        decoder: the model's :class:`~infopt.generate.Decoder`, which a model drafter asks for its forward and
            cache.

    Returns:
        ``[B, T + n]`` token ids as ``generate`` returns them (``n <= max_new_tokens``; shorter when every row
        hit EOS). Greedy output is token-identical to ``generate``'s.
    """
    warp = warp_of(call)
    ids = call.input_ids
    B, T = ids.shape
    N = call.max_new_tokens
    dev = ids.device
    K = controller.cap if controller.fixed is None else controller.fixed
    pad = call.pad_token_id if call.pad_token_id is not None else 0
    S = T + (N if B == 1 else 2 * N) + K + 2
    if capacity is not None:
        S = min(S, capacity)
    out = torch.full((B, T + N + K + 1), pad, dtype=torch.long, device=dev)  # + K + 1: room for a round's writes
    out[:, :T] = ids
    mask = call.attention_mask
    slot_mask = torch.ones(B, S + 1, dtype=torch.long, device=dev)
    slot_ids = torch.zeros(B, S + 1, dtype=torch.long, device=dev)
    slot_pos = torch.zeros(B, S + 1, dtype=torch.long, device=dev)
    slot_ids[:, :T] = ids
    positions = positions_of(call)  # [B, T]
    if mask is not None:
        slot_mask[:, :T] = mask
    slot_pos[:, :T] = positions
    use_mask = call.padded  # no padding: generate drops the mask too
    streamer = call.streamer
    if streamer is not None:
        streamer.put(ids.cpu())
    logits = forward.prefill(ids, positions, slot_mask[:, :T] if use_mask else None, cache)
    vocab = logits.shape[-1]
    state = State(out=out, ends=torch.full((B,), T, dtype=torch.long, device=dev), slot_ids=slot_ids,
                  slot_pos=slot_pos, slot_mask=slot_mask, length=T, pending=ids[:, -1], next_pos=positions[:, -1] + 1,
                  use_mask=use_mask, warp=warp, vocab=vocab, n_out=torch.zeros(B, dtype=torch.long, device=dev),
                  min_new=call.min_new_tokens, eos=call.eos_tensor())
    scores = logits[:, -1].to(torch.float32)
    state.mask_eos(scores, 0)
    tok = _pick(scores, warp)
    out[:, T] = tok
    if streamer is not None:
        streamer.put(tok.cpu())
    eos = call.eos_tensor()
    unfinished = torch.ones(B, dtype=torch.bool, device=dev)
    if eos is not None:
        unfinished &= ~torch.isin(tok, eos)
    state.n_out += 1
    state.ends += 1
    state.pending = tok
    stats.calls += 1
    stats.tokens += B
    stats.target_forwards += 1
    drafter.begin(state, decoder)
    rows = torch.arange(B, device=dev)
    try:
        while True:
            active = unfinished & (state.n_out < N)
            if not bool(active.any()):
                break
            C = state.length
            left = (N - state.n_out).masked_fill(~active, 0)  # [B] tokens each row still needs
            remaining = int(left.masked_fill(~active, N).min())  # the slowest active row's
            # draft no further than the neediest row can use, and leave the slowest row room to finish plainly
            k = min(controller.next_k(), int(left.max()) - 1, S - C - remaining)
            k = max(k, 0)
            if k > 0:
                draft, q, lengths = drafter.propose(state, k)
            else:
                draft, q, lengths = out.new_empty(B, 0), None, torch.zeros(B, dtype=torch.long, device=dev)
            kk = draft.shape[1]
            inp = torch.cat([state.pending[:, None], draft], dim=1)  # [B, kk + 1]
            pos = state.next_pos[:, None] + torch.arange(kk + 1, device=dev)
            slot_ids[:, C:C + kk + 1] = inp
            slot_pos[:, C:C + kk + 1] = pos
            slot_mask[:, C:C + kk + 1] = 1
            scores = forward.step(inp, pos, torch.arange(C, C + kk + 1, device=dev),
                                  slot_mask if state.use_mask else None, cache)  # [B, kk + 1, V] fp32
            state.mask_eos(scores, None)
            if warp is None:
                accepted, targets = verify_greedy(scores, draft, lengths)
                bonus = targets[rows, accepted]
            else:
                p = warp.filter(scores).softmax(dim=-1)
                accepted, bonus = verify_sample(p, q, draft, lengths)
            new = torch.cat([draft, bonus[:, None]], dim=1)
            new[rows, accepted] = bonus
            count = accepted + 1  # [B]
            j = torch.arange(kk + 1, device=dev)
            if eos is not None:
                is_eos = torch.isin(new, eos) & (j[None] < count[:, None])
                first = torch.where(is_eos, j[None], kk + 1).min(dim=-1).values
                count = torch.minimum(count, first + 1)
                count = torch.where(unfinished, count, 0)
                unfinished &= first > kk
            count = torch.minimum(count, N - state.n_out)
            write = j[None] < count[:, None]
            idx = (T + state.n_out)[:, None] + j[None]  # [B, kk + 1]
            out.scatter_(1, idx, torch.where(write, new, out.gather(1, idx)))
            if streamer is not None:
                streamer.put(new[0, :int(count[0])].cpu())
            # cache: row b keeps slots C .. C + accepted_b (pending + accepted drafts); the batch keeps the longest
            kept = accepted + 1
            keep_n = int(kept.max())
            rollback(cache, kk + 1 - keep_n)
            if keep_n > int(kept.min()):
                holes = (j[None, :keep_n] >= kept[:, None])
                slot_mask[:, C:C + keep_n] = (~holes).long()
                state.use_mask = True
            state.length = C + keep_n
            state.next_pos = state.next_pos + kept
            state.pending = bonus
            state.n_out += count
            state.ends += count
            drafter.rollback(state)
            stats.rounds += 1
            stats.target_forwards += 1
            stats.tokens += int(count.sum())
            if kk > 0:
                live = lengths > 0
                stats.draft_rounds += int(live.sum())
                stats.drafted += int(lengths.sum())
                stats.accepted += int(accepted.sum())
            controller.update(kk, accepted, lengths)
    finally:
        drafter.end()
    if streamer is not None:
        streamer.end()
    return out[:, :T + int(state.n_out.max())]
