"""Expert parallelism in place: each rank keeps a contiguous slice of every MoE block's experts.

Every rank holds the whole model except the experts, and runs it on the same tokens (as with tensor
parallelism). Each block's router and shared expert stay replicated, so every rank routes every token the
same way; only the experts module is replaced, by an :class:`ExpertParallel` that keeps the experts'
contract ``forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, so the block's own
routing and combining code runs unchanged. Its forward, with ``dispatch="all_to_all"`` (the default):

1. rank ``r`` takes the token rows ``[r*P, (r+1)*P)`` of the batch it shares with the others (``P = ceil(T/N)``),
   so no (token, expert) pair is computed twice;
2. its pairs, sorted by expert, are grouped by the rank owning that expert (experts are split in contiguous
   ranges); the per-expert counts go first (one ``all_to_all_single`` of ``E`` integers, read back to the host
   for the split sizes), then the token rows (a second one);
3. the owner runs its experts with their own forward (transformers' experts class, or infopt's
   :class:`~infopt.quantize.QuantizedExperts`), on local expert ids with unit weights;
4. a third ``all_to_all_single`` sends the results back; the sender weights them with the routing weights
   and adds them per token in ascending expert order, as the one-process experts loop does;
5. one all-gather of the ``P``-row slices gives every rank the block's full output.

``dispatch="all_reduce"`` moves no tokens: each rank runs its experts on the pairs routed to them over the
whole (shared) batch and one all-reduce sums the partial outputs. It exchanges ``T x H`` values per block
whatever the routing, where all-to-all exchanges about ``k/N`` of the routed rows twice plus the gather.

The other ranks' experts are freed (kept in a temporary file for :func:`infopt.undo` with
``keep_original="disk"``). Under ``torch.compile`` the exchange is one opaque custom op,
``infopt::expert_parallel``: its sizes are known only once the router has run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.moe import moe_blocks
from ..core.patch import get_handle, set_attr, swap_module
from ..ops.experts import EXPERT_PARALLEL as _LIVE
from ..quantize.experts import QuantizedExperts
from .dist import local_bytes, require_not_parallel, resolve_mesh
from .pipeline import stage_bounds

__all__ = ["expert_parallel_", "plan_expert_parallel", "EPPlan", "ExpertParallel", "DISPATCH"]

DISPATCH: tuple[str, ...] = ("all_to_all", "all_reduce")
"""How :class:`ExpertParallel` brings the tokens to the experts' ranks (see the module docstring)."""

# handle -> the live ExpertParallel it names; a compiled graph holds the handle (custom ops take no modules)


@dataclass(frozen=True)
class EPPlan:
    """What :func:`expert_parallel_` will do, computed without touching the model.

    Attributes:
        world: number of ranks.
        experts_fqns: every MoE block's experts module, in model order (each is split).
        num_experts: experts per block, in the same order.
        ranges: per block, each rank's ``[start, stop)`` experts (contiguous; the first ranks take one more
            when the world size does not divide the experts).
        replicated: routers and shared experts, which every rank keeps whole.
    """

    world: int
    experts_fqns: tuple[str, ...]
    num_experts: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    replicated: tuple[str, ...]

    @property
    def even(self) -> bool:
        """Whether every rank holds the same number of experts in every block."""
        return all(e % self.world == 0 for e in self.num_experts)


def _check_experts(experts: nn.Module, fqn: str, num_experts: int) -> None:
    if isinstance(experts, QuantizedExperts):
        return
    if getattr(experts, "is_infopt_experts", False):
        raise IncompatibleModelError(
            f"expert parallelism cannot split {fqn} ({type(experts).__name__}); it splits transformers' experts "
            "modules (3D weights) and infopt's QuantizedExperts (quantize int8/int4)"
        )
    if getattr(experts, "num_experts", None) != num_experts:
        raise IncompatibleModelError(
            f"expert parallelism cannot split {fqn} ({type(experts).__name__}): it has no num_experts={num_experts} "
            "attribute, which its forward would read to find this rank's experts"
        )
    for name, child in experts.named_children():
        if any(True for _ in child.parameters()) or any(b is not None for b in child.buffers()):
            raise IncompatibleModelError(
                f"expert parallelism cannot split {fqn}: its child {name} ({type(child).__name__}) holds weights "
                "that are not per-expert [E, ...] tensors"
            )
    for name, t in list(experts._parameters.items()) + list(experts._buffers.items()):
        if t is not None and (t.dim() == 0 or t.shape[0] != num_experts):
            raise IncompatibleModelError(
                f"expert parallelism cannot split {fqn}.{name} of shape {tuple(t.shape)}: every tensor of an "
                f"experts module must hold one slice per expert ([{num_experts}, ...])"
            )


def plan_expert_parallel(model: nn.Module, world: int) -> EPPlan:
    """Check that ``model``'s experts can be split over ``world`` ranks and say how; the model is not touched.

    Args:
        model: a transformers mixture-of-experts causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and the families
            built like them, see :func:`infopt.core.moe.moe_blocks`), its experts float or quantized by
            :func:`infopt.quantize.quantize_` (int8/int4).
        world: number of ranks.

    Returns:
        An :class:`EPPlan`.

    Raises:
        IncompatibleModelError: a dense model, more ranks than a block has experts, an experts module whose
            tensors are not all per-expert.

    Example:
        >>> from infopt.models import tiny_model
        >>> plan = plan_expert_parallel(tiny_model("qwen2_moe"), 2)
        >>> plan.ranges[0], plan.replicated[:2]
        (((0, 2), (2, 4)), ('model.layers.0.mlp.gate', 'model.layers.0.mlp.shared_expert'))
        >>> plan_expert_parallel(tiny_model("mixtral"), 3).ranges[0]  # uneven: the first rank takes one more
        ((0, 2), (2, 3), (3, 4))
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise IncompatibleModelError(f"expert parallel size {world!r} must be a positive integer")
    blocks = moe_blocks(model)
    if not blocks:
        mt = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise IncompatibleModelError(
            f"expert parallelism splits the experts of mixture-of-experts blocks, and this model ('{mt}') has none. "
            "For a dense model use tensor parallelism ({parallel: {tensor: N}}) or pipeline parallelism "
            "({parallel: {pipeline: N}})"
        )
    fewest = min(blocks, key=lambda b: b.num_experts)
    if world > fewest.num_experts:
        raise IncompatibleModelError(
            f"expert parallelism over {world} ranks gives every rank at least one expert of each block, but "
            f"{fewest.experts_fqn} has {fewest.num_experts} experts; use at most {fewest.num_experts} ranks"
        )
    for b in blocks:
        _check_experts(model.get_submodule(b.experts_fqn), b.experts_fqn, b.num_experts)
    replicated = []
    for b in blocks:
        replicated += ([b.router_fqn] if b.router_fqn else []) + list(b.shared_fqns)
        replicated += [b.shared_gate_fqn] if b.shared_gate_fqn else []
    return EPPlan(world, tuple(b.experts_fqn for b in blocks), tuple(b.num_experts for b in blocks),
                  tuple(tuple(stage_bounds(b.num_experts, world)) for b in blocks), tuple(replicated))


def _local_experts(experts: nn.Module, start: int, stop: int) -> nn.Module:
    """Experts ``[start, stop)`` of ``experts`` as a module of the same kind, holding copies of only their tensors
    (the original can then be freed) and running the same forward on local expert ids ``0 .. stop-start-1``."""
    if isinstance(experts, QuantizedExperts):
        return QuantizedExperts([copy.deepcopy(m) for m in experts.gate_up_proj[start:stop]],
                                [copy.deepcopy(m) for m in experts.down_proj[start:stop]], experts.act_fn,
                                hidden_dim=experts.hidden_dim, intermediate_dim=experts.intermediate_dim)
    cls = type(experts)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for name, value in vars(experts).items():  # config, flags, sizes; nn.Module's own tables are fresh
        if name not in vars(new):
            new.__dict__[name] = value
    for name, child in experts.named_children():  # activations (checked to hold no tensors)
        new._modules[name] = child
    for name, p in experts._parameters.items():
        new._parameters[name] = None if p is None else nn.Parameter(p.detach()[start:stop].clone(),
                                                                    requires_grad=p.requires_grad)
    for name, b in experts._buffers.items():
        new._buffers[name] = None if b is None else b[start:stop].clone()
    new._non_persistent_buffers_set = set(experts._non_persistent_buffers_set)
    new.num_experts = stop - start
    return new


class ExpertParallel(nn.Module):
    """One MoE block's experts split over a process group: this rank's experts in ``local``, the exchange in
    ``forward`` (see the module docstring).

    ``is_infopt_experts`` keeps the block visible to :func:`infopt.core.moe.moe_blocks` with its full expert count.

    Args:
        local: this rank's experts ``[start, stop)``, a module with the experts' forward contract.
        ranges: every rank's ``[start, stop)``.
        num_experts, hidden_dim, intermediate_dim: the whole block's sizes.
        group: the process group; rank: this rank in it.
        dispatch: one of :data:`DISPATCH`.
    """

    is_infopt_experts = True
    infopt_expert_parallel = True

    def __init__(self, local: nn.Module, ranges: list[tuple[int, int]], *, num_experts: int, hidden_dim: int,
                 intermediate_dim: int, group, rank: int, dispatch: str = "all_to_all"):
        super().__init__()
        if dispatch not in DISPATCH:
            raise IncompatibleModelError(f"ExpertParallel(dispatch={dispatch!r}); allowed: {', '.join(DISPATCH)}")
        self.local = local
        self.ranges = [tuple(r) for r in ranges]
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.group = group
        self.rank = rank
        self.world = len(ranges)
        self.start, self.stop = self.ranges[rank]
        self.dispatch = dispatch
        self._handle = _LIVE.register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._handle = _LIVE.register(self)  # a copy's compiled graphs must reach its own experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        # hidden_states: [T, H]; top_k_index, top_k_weights: [T, k] (global expert ids)
        if torch.compiler.is_compiling():  # data-dependent split sizes: one opaque op (module docstring)
            return torch.ops.infopt.expert_parallel(hidden_states, top_k_index, top_k_weights, self._handle)
        return self._exchange(hidden_states, top_k_index, top_k_weights)

    def _exchange(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                  ) -> torch.Tensor:
        if self.dispatch == "all_reduce":
            return self._all_reduce(hidden_states, top_k_index, top_k_weights)
        return self._all_to_all(hidden_states, top_k_index, top_k_weights)

    def _run_local(self, rows: torch.Tensor, local_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The unweighted outputs of this rank's experts: ``rows [m, H]`` through experts ``local_ids [m]``."""
        if rows.shape[0] == 0:
            return rows.new_zeros(0, self.hidden_dim)
        # top-1 with unit weights: the experts' forward adds y * 1 into zeros, which is y exactly
        return self.local(rows, local_ids.unsqueeze(1), like.new_ones(rows.shape[0], 1))

    def _all_to_all(self, hidden_states, top_k_index, top_k_weights):
        t, k = top_k_index.shape
        h = hidden_states.shape[-1]
        world, group = self.world, self.group
        per = -(-t // world)  # rows each rank sends out (the last ranks may have fewer, or none)
        lo, hi = min(self.rank * per, t), min((self.rank + 1) * per, t)
        ids = top_k_index[lo:hi].reshape(-1)  # [n*k] global expert ids of this rank's (token, slot) pairs
        order = torch.argsort(ids, stable=True)  # pairs grouped by expert, so by owner rank, token order kept
        tokens = order // k  # [n*k] row in this rank's slice
        send_counts = torch.bincount(ids, minlength=self.num_experts)  # [E]
        n_local = [e - s for s, e in self.ranges]
        recv_counts = send_counts.new_empty(world * n_local[self.rank])  # [N * E_local], by source rank
        dist.all_to_all_single(recv_counts, send_counts, [n_local[self.rank]] * world, n_local, group=group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()  # the host sync of this block
        send_sizes = [sum(sc[s:e]) for s, e in self.ranges]
        recv_sizes = [sum(rc[i * n_local[self.rank]:(i + 1) * n_local[self.rank]]) for i in range(world)]
        send = hidden_states[lo:hi][tokens]  # [n*k, H]
        recv = hidden_states.new_empty(sum(recv_sizes), h)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        local_ids = torch.arange(n_local[self.rank], device=recv.device).repeat(world)
        local_ids = local_ids.repeat_interleave(recv_counts)  # [m]: source-major, expert-minor
        y = self._run_local(recv, local_ids, top_k_weights).contiguous()  # [m, H]
        back = y.new_empty(send.shape[0], h)
        dist.all_to_all_single(back, y, send_sizes, recv_sizes, group=group)
        # weights applied on the sender, in the experts' dtype promotion, then summed per token in expert order
        weighted = back * top_k_weights[lo:hi].reshape(-1)[order, None]
        part = hidden_states.new_zeros(per, h)  # padded to `per` rows so every rank gathers the same size
        part.index_add_(0, tokens, weighted.to(part.dtype))
        out = hidden_states.new_empty(world * per, h)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, part, group=group)
        return out[:t]

    def _all_reduce(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        ids = top_k_index.reshape(-1)  # [T*k]
        pairs = ((ids >= self.start) & (ids < self.stop)).nonzero().squeeze(1)  # this rank's (token, slot) pairs
        pairs = pairs[torch.argsort(ids[pairs], stable=True)]  # by expert, token order kept
        tokens = pairs // k
        y = self._run_local(hidden_states[tokens], ids[pairs] - self.start, top_k_weights)
        out = torch.zeros_like(hidden_states)
        out.index_add_(0, tokens, (y * top_k_weights.reshape(-1)[pairs, None]).to(out.dtype))
        dist.all_reduce(out, group=self.group)
        return out

    def extra_repr(self) -> str:
        return (f"experts=[{self.start}, {self.stop}) of {self.num_experts}, rank={self.rank}, world={self.world}, "
                f"dispatch={self.dispatch}")


def expert_parallel_(model: nn.Module, mesh=None, *, dispatch: str = "all_to_all", keep_original: str = "disk",
                     step: str | None = None) -> nn.Module:
    """Split every mixture-of-experts block's experts across the ranks of ``mesh``, in place.

    Call it on every rank with the same model, then call ``model(...)``/``model.generate(...)`` on every rank with
    the same inputs: routers, shared experts, attention, embedding and head run replicated, each rank runs its
    slice of the experts on the tokens routed to them, and every rank returns the same logits and tokens, equal to
    the single-process model's up to float summation order.

    Args:
        model: a transformers MoE causal LM (see :func:`plan_expert_parallel`), float or with experts quantized by
            :func:`infopt.quantize.quantize_` (each rank keeps its experts' quantized layers).
        mesh: a 1-D ``DeviceMesh``, or None for the whole default process group (gloo on CPU, nccl on CUDA).
        dispatch: ``"all_to_all"`` (tokens sent to the experts' ranks and back, then all-gathered) or
            ``"all_reduce"`` (each rank runs its experts over the shared batch; one all-reduce).
        keep_original: ``"disk"`` (default) moves the full experts to a temporary file so each rank really holds
            only its slice while :func:`infopt.undo` can restore them; ``"memory"`` keeps them in RAM.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: no initialized process group (run under ``torchrun``), a dense model, more ranks
            than experts, an already-parallel model, a bad ``dispatch``. The model is untouched.

    Example:
        >>> # torchrun --nproc-per-node 2 script.py, after dist.init_process_group("gloo")
        >>> expert_parallel_(model)  # doctest: +SKIP
        >>> model.generate(ids, max_new_tokens=16, do_sample=False)  # doctest: +SKIP
    """
    if dispatch not in DISPATCH:
        raise IncompatibleModelError(f"expert_parallel_(dispatch={dispatch!r}); allowed: {', '.join(DISPATCH)}")
    if keep_original not in ("disk", "memory"):
        raise IncompatibleModelError(f"expert_parallel_(keep_original={keep_original!r}); allowed: 'disk', 'memory'")
    require_not_parallel(model, "expert_parallel_")
    mesh = resolve_mesh(mesh, model, "expert_parallel_")
    rank, world = mesh.get_local_rank(), mesh.size()
    plan = plan_expert_parallel(model, world)
    key = step or "parallel"
    handle = get_handle(model)
    first = len(handle.records)
    # block by block, so a rank's peak is the full model plus one block's slice (not plus all its experts);
    # a failure part-way reverts the blocks already swapped, leaving the model as it was
    try:
        with torch.no_grad():
            for fqn, e, ranges in zip(plan.experts_fqns, plan.num_experts, plan.ranges, strict=True):
                experts = model.get_submodule(fqn)
                start, stop = ranges[rank]
                hidden = int(getattr(experts, "hidden_dim", 0) or 0)
                inter = int(getattr(experts, "intermediate_dim", 0) or 0)
                if not hidden or not inter:
                    b = next(b for b in moe_blocks(model) if b.experts_fqn == fqn)
                    hidden, inter = b.hidden_size, b.intermediate_size
                new = ExpertParallel(_local_experts(experts, start, stop), list(ranges), num_experts=e,
                                     hidden_dim=hidden, intermediate_dim=inter, group=mesh.get_group(), rank=rank,
                                     dispatch=dispatch)
                swap_module(model, fqn, new, step=key, keep_original=keep_original)
    except BaseException:
        for record in reversed(handle.records[first:]):
            record.revert()
        del handle.records[first:]
        raise
    set_attr(model, model, "_infopt_parallel", {"kind": "expert", "world": world, "rank": rank, "dispatch": dispatch,
                                                "experts": [r[rank] for r in plan.ranges],
                                                "local_bytes": local_bytes(model)}, step=key)
    return model
