"""Hand-written sharded layers: int8/int4 weight-only shards, row-parallel reduction, vocab-parallel embedding/head.

DTensor's ``ColwiseParallel``/``RowwiseParallel`` shard float ``nn.Linear`` layers; they cannot
express :class:`~infopt.quantize.Int8Linear`/:class:`~infopt.quantize.Int4Linear` (buffers of codes
and scales, custom kernels), so those are sliced here:

- column-parallel: output rows ``[r*o/N, (r+1)*o/N)`` of codes, scales (and zero points), bias; the
  result is an ordinary quantized layer of ``o/N`` outputs and needs no communication.
- row-parallel: input columns ``[r*i/N, (r+1)*i/N)`` of codes and the groups covering them (a
  per-row scale is shared by every slice), wrapped in :class:`RowParallel`, which all-reduces the
  partial outputs and adds the bias once, after the reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.errors import IncompatibleModelError
from ..quantize.formats.int4 import Int4Linear, unpack_int4
from ..quantize.formats.int8 import Int8Linear

__all__ = ["RowParallel", "GatherOutput", "VocabParallelEmbedding", "shard_rows", "shard_cols", "QUANT_LAYERS"]

QUANT_LAYERS = (Int8Linear, Int4Linear)


def _chunk(n: int, rank: int, world: int) -> slice:
    step = n // world
    return slice(rank * step, (rank + 1) * step)


def _int8_from(module: Int8Linear, codes, scales, bias, fqn: str) -> Int8Linear:
    """A shard of ``module``: the same activations, compute dtype and CUDA kernel (the original's choices, not a
    fresh ``"auto"``)."""
    try:
        new = Int8Linear.from_codes(codes.contiguous(), scales.contiguous(), bias=bias, dtype=module.out_dtype,
                                    activations=module.activations)
    except ValueError as e:
        raise IncompatibleModelError(
            f"{fqn or 'Int8Linear'}: its shard ({codes.shape[1]} -> {codes.shape[0]} features) cannot keep the layer's "
            f"int8 activations ({e}). Quantize with activations='float', or use a world size whose shards keep them"
        ) from None
    new.compute_dtype = module.compute_dtype
    new.cuda_kernel = module.cuda_kernel
    return new


def _int4_from(module: Int4Linear, codes, scales, zeros, bias, in_perm, group_size: int, fqn: str) -> Int4Linear:
    """A shard of ``module`` in the same layout when it was chosen (int8 activations' ``a8``, ``gemv``), else the
    fastest layout for its device (or ``plain`` when the shard's shape does not fit the kernel), with a dense copy
    for prompts where the original kept one."""
    layout = None if module._layout_auto else module.layout
    try:
        new = Int4Linear.from_codes(codes, scales, zeros, group_size=group_size, bias=bias, in_perm=in_perm,
                                    dtype=module.out_dtype, layout=layout)
    except ValueError as e:
        raise IncompatibleModelError(
            f"{fqn or 'Int4Linear'}: its shard ({codes.shape[1]} -> {codes.shape[0]} features) cannot keep the "
            f"layer's {module.layout} layout ({e}). Quantize with activations='float', or use a world size whose "
            "shards keep it"
        ) from None
    if module.weight_dense is not None:
        new.enable_dense()
    return new


def shard_rows(module: nn.Module, rank: int, world: int, fqn: str = "") -> nn.Module:
    """This rank's output rows of an Int8Linear/Int4Linear, as a layer of the same type and settings (no
    communication).

    Raises:
        IncompatibleModelError: the layer type is not one this function shards, or the shard cannot keep the
            layer's int8-activation kernel (its outputs not a multiple of 16).
    """
    rows = _chunk(module.out_features, rank, world)
    bias = module.bias.detach()[rows] if module.bias is not None else None
    if isinstance(module, Int8Linear):
        return _int8_from(module, module.codes()[rows], module.weight_scale[rows], bias, fqn)
    if isinstance(module, Int4Linear):
        q, s, z = module._portable()  # q: [out, in/2] packed, s/z: [out, G]
        codes = unpack_int4(q)[rows]
        return _int4_from(module, codes, s[rows], z[rows], bias, module.in_perm, module.group_size, fqn)
    raise IncompatibleModelError(f"cannot shard {type(module).__name__} by rows; supported: Int8Linear, Int4Linear")


def shard_cols(module: nn.Module, rank: int, world: int, fqn: str = "") -> nn.Module:
    """This rank's input columns of an Int8Linear/Int4Linear, without the bias (:class:`RowParallel` adds it).

    Raises:
        IncompatibleModelError: a group that would straddle two ranks, an Int4Linear with an input
            permutation (GPTQ ``act_order``), a shard that cannot keep the layer's int8-activation kernel, or an
            unsupported layer type.
    """
    in_f = module.in_features
    cols = _chunk(in_f, rank, world)
    group = module.group_size
    if group is not None and (in_f // world) % group:
        raise IncompatibleModelError(
            f"{fqn or type(module).__name__}: {world} ranks split its {in_f} input features into slices of "
            f"{in_f // world}, which group_size={group} does not divide; quantize with a group size dividing "
            f"{in_f // world}, or use a world size whose slices it divides"
        )
    groups = slice(cols.start // group, cols.stop // group) if group is not None else None
    if isinstance(module, Int8Linear):
        scales = module.weight_scale if group is None else module.weight_scale[:, groups]
        return _int8_from(module, module.codes()[:, cols], scales, None, fqn)
    if isinstance(module, Int4Linear):
        if module.in_perm is not None:
            raise IncompatibleModelError(
                f"{fqn or 'Int4Linear'} permutes its inputs (GPTQ act_order), so its input columns cannot be split "
                "across ranks; quantize with GPTQ(act_order=False) for tensor parallelism"
            )
        q, s, z = module._portable()
        codes = unpack_int4(q)[:, cols]
        return _int4_from(module, codes, s[:, groups], z[:, groups], None, None, group, fqn)
    raise IncompatibleModelError(f"cannot shard {type(module).__name__} by columns; supported: Int8Linear, Int4Linear")


class RowParallel(nn.Module):
    """Row-parallel linear: ``inner`` holds this rank's input columns; the partial outputs are summed
    across the group (one all-reduce) and the full bias is added once, after the sum.

    Args:
        inner: the column shard (any module mapping ``[..., in/N] -> [..., out]``, without bias).
        bias: the full ``[out]`` bias, or None.
        group: the process group to reduce over.
    """

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.inner = inner
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # [..., out], this rank's partial sum
        dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y


class GatherOutput(nn.Module):
    """Column shard of an output head (``[..., V/N]``), all-gathered to full ``[..., V]`` logits on every rank."""

    def __init__(self, inner: nn.Module, group, world: int) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.world = world

    @property
    def weight(self):  # tied-weight bookkeeping in transformers reads lm_head.weight
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).contiguous()  # [..., V/N]
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[r*V/N, (r+1)*V/N)``: ids outside this rank's slice look up zeros, and one
    all-reduce sums the slices into the full embedding (exact: every id is found on one rank only).

    Args:
        weight: this rank's ``[V/N, D]`` rows (an ``nn.Parameter``; a tied head shares it).
        start: the first vocabulary id of the slice.
        padding_idx: kept for ``repr`` and transformers' checks; lookups do not depend on it.
        group: the process group.
        embed_scale: the factor a scaled embedding (Gemma) multiplies lookups by, or None.
    """

    def __init__(self, weight: nn.Parameter, start: int, num_embeddings: int, padding_idx, group,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        self.group = group
        # Gemma's scaled embedding multiplies lookups by sqrt(hidden); kept as in the original (not saved)
        self.register_buffer("embed_scale", embed_scale.detach().clone() if embed_scale is not None else None,
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [..., D]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out, group=self.group)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.start}, {self.start + self.weight.shape[0]})"
