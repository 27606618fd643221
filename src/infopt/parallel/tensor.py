"""Megatron-style tensor parallelism in place: column-parallel q/k/v and gate/up, row-parallel o and down.

Each decoder layer then does two all-reduces (one after attention, one after the MLP), its
attention heads and KV heads divided between the ranks. Float ``nn.Linear`` layers are sharded with
plain local shards and one ``all_reduce`` per row-parallel layer (the default), or with DTensor
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``, ``dtensor=True``); int8/int4
weight-only layers from :mod:`infopt.quantize` are sliced by hand (:mod:`infopt.parallel.layers`).
Embedding and output head are vocab-parallel when the vocabulary divides evenly, replicated otherwise.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.introspect import FAMILIES, ModelInfo, inspect_model, text_config
from ..core.moe import require_dense
from ..core.patch import set_attr, swap_module
from .dist import divisors, is_bnb_module, local_bytes, require_not_parallel, resolve_mesh
from .layers import QUANT_LAYERS, GatherOutput, RowParallel, VocabParallelEmbedding, shard_cols, shard_rows

__all__ = ["tensor_parallel_", "TPPlan", "plan_tensor_parallel", "AUTO_PLAN", "TP_FAMILIES"]

AUTO_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""The plan ``plan="auto"`` uses: names relative to each decoder layer -> ``colwise`` or ``rowwise``."""

TP_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
"""Model types with separate q/k/v and gate/up projections (GPT-2 and Phi-3 fuse them; not planned yet)."""

_BNB_REASON = (
    "bitsandbytes keeps its weights in its own packed formats (Int8Params, Params4bit) with quantization state that "
    "belongs to the whole tensor, which neither DTensor's ColwiseParallel/RowwiseParallel nor infopt's hand-written "
    "shards can split by rows or columns"
)


@dataclass(frozen=True)
class TPPlan:
    """What :func:`tensor_parallel_` will do, computed without touching the model.

    Attributes:
        world: number of ranks.
        layers: ``(fqn, style)`` for every projection, style ``colwise`` or ``rowwise``.
        vocab_parallel: embedding and head split over the vocabulary (else replicated).
        heads_per_rank, kv_heads_per_rank: attention heads each rank computes.
    """

    world: int
    layers: tuple[tuple[str, str], ...]
    vocab_parallel: bool
    heads_per_rank: int
    kv_heads_per_rank: int


def _splittable_embedding(embed: nn.Module) -> bool:
    """A plain ``nn.Embedding``, or a scaled one (Gemma: lookups times ``embed_scale``), which
    :class:`VocabParallelEmbedding` reproduces."""
    if type(embed) is nn.Embedding:
        return True
    return isinstance(embed, nn.Embedding) and type(embed).__name__.endswith("ScaledWordEmbedding") and \
        torch.is_tensor(getattr(embed, "embed_scale", None))


def _check_layer(model: nn.Module, fqn: str) -> nn.Module:
    mod = model.get_submodule(fqn)
    if is_bnb_module(mod):
        raise IncompatibleModelError(
            f"tensor parallelism cannot shard the bitsandbytes layer {fqn} ({type(mod).__name__}): {_BNB_REASON}. "
            "Fix: quantize with infopt's 'int8' or 'int4' methods instead, which shard with their scales"
        )
    if isinstance(mod, QUANT_LAYERS) or type(mod) is nn.Linear:
        return mod
    raise IncompatibleModelError(
        f"tensor parallelism cannot shard {fqn} ({type(mod).__name__}); supported layers: nn.Linear, Int8Linear, "
        "Int4Linear. Apply parallel before other quantization methods, or use quantize 'int8'/'int4'"
    )


def _resolve_plan(plan: Any) -> dict[str, str]:
    if isinstance(plan, str):
        if plan != "auto":
            raise IncompatibleModelError(f"tensor_parallel_(plan={plan!r}); allowed: 'auto' or a dict like {AUTO_PLAN}")
        return dict(AUTO_PLAN)
    if not isinstance(plan, dict) or not plan:
        raise IncompatibleModelError(f"tensor_parallel_(plan={plan!r}); allowed: 'auto' or a dict like {AUTO_PLAN}")
    bad = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise IncompatibleModelError(f"tensor_parallel_ plan styles {bad} are invalid; allowed: 'colwise', 'rowwise'")
    return dict(plan)


def plan_tensor_parallel(model: nn.Module, world: int, plan: Any = "auto", vocab_parallel: bool | None = None,
                         info: ModelInfo | None = None) -> TPPlan:
    """Check that ``model`` can be split over ``world`` ranks and say how; the model is not touched.

    Args:
        model: a transformers causal LM of a type in :data:`TP_FAMILIES`.
        world: number of ranks.
        plan: ``"auto"`` (:data:`AUTO_PLAN`) or a dict of layer-relative names (globs allowed) to styles.
        vocab_parallel: True/False, or None to split embedding and head when ``world`` divides the vocabulary.
        info: the model's :class:`ModelInfo` if already read.

    Returns:
        A :class:`TPPlan`.

    Raises:
        IncompatibleModelError: unsupported architecture, a world size not dividing the heads, KV heads or MLP
            width (the message lists the sizes that work), a bitsandbytes or unknown layer type.

    Example:
        >>> from infopt.models import tiny_model
        >>> plan_tensor_parallel(tiny_model(), 2).heads_per_rank
        2
    """
    info = info or inspect_model(model)
    require_dense(model, "tensor parallelism", "its plan splits one dense MLP per layer, and the experts' 3D weights "
                  "and the router are not split",
                  instead="expert parallelism ({parallel: {expert: N}}, infopt.parallel.expert_parallel_)")
    if info.model_type not in TP_FAMILIES:
        raise IncompatibleModelError(
            f"tensor parallelism has no plan for model_type '{info.model_type}' (fused projections); supported: "
            f"{', '.join(TP_FAMILIES)}. Use pipeline parallelism (infopt.parallel.pipeline_parallel_) instead"
        )
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise IncompatibleModelError(f"tensor parallel size {world!r} must be a positive integer")
    tc = text_config(model.config)
    inter = int(getattr(tc, "intermediate_size", 0) or 0)
    sizes = {"num_attention_heads": info.num_heads, "num_key_value_heads": info.num_kv_heads}
    if inter:
        sizes["intermediate_size"] = inter
    if any(v % world for v in sizes.values()):
        ok = divisors(*sizes.values())
        raise IncompatibleModelError(
            f"tensor parallelism over {world} ranks splits attention heads, KV heads and the MLP evenly, but "
            + ", ".join(f"{k}={v}" for k, v in sizes.items())
            + f" are not all divisible by {world}. World sizes that work for this model: {', '.join(map(str, ok))}"
        )
    styles = _resolve_plan(plan)
    fam = FAMILIES[info.model_type]
    layers: list[tuple[str, str]] = []
    for lf in info.layer_fqns:
        for rel, style in styles.items():
            hits = [f for f in info.attn_linear_fqns + info.mlp_linear_fqns
                    if f.startswith(lf + ".") and fnmatch.fnmatchcase(f[len(lf) + 1:], rel)]
            if not hits:
                raise IncompatibleModelError(
                    f"tensor_parallel_ plan entry {rel!r} matches no projection in {lf} "
                    f"(it has {', '.join(f[len(lf) + 1:] for f in info.attn_linear_fqns if f.startswith(lf + '.'))}, "
                    f"and the {fam.mlp} projections)"
                )
            layers += [(f, style) for f in hits]
    for fqn, _ in layers:
        _check_layer(model, fqn)
    embed = model.get_submodule(info.embed_fqn)
    if vocab_parallel is None:
        vocab_parallel = info.vocab_size % world == 0 and _splittable_embedding(embed)
    if vocab_parallel:
        if info.vocab_size % world:
            raise IncompatibleModelError(
                f"vocab_parallel=True needs the world size to divide vocab_size={info.vocab_size}; "
                f"{world} does not. Use vocab_parallel=False (replicated embedding and head)"
            )
        if not _splittable_embedding(embed):
            raise IncompatibleModelError(
                f"vocab_parallel=True cannot split {info.embed_fqn} ({type(embed).__name__}, which scales or "
                "transforms its lookups); use vocab_parallel=False"
            )
        head = model.get_submodule(info.lm_head_fqn)
        if not info.tied_embeddings:
            _check_layer(model, info.lm_head_fqn)
        elif type(head) is not nn.Linear:
            raise IncompatibleModelError(f"vocab_parallel=True: tied head {info.lm_head_fqn} is a {type(head).__name__}")
    return TPPlan(world, tuple(layers), bool(vocab_parallel), info.num_heads // world, info.num_kv_heads // world)


def _float_linear_shard(module: nn.Linear, mesh, style: str) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    # share the original storage; distribute_tensor copies out this rank's shard
    new.weight = nn.Parameter(module.weight.detach(), requires_grad=False)
    if module.bias is not None:
        new.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    ps = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    ps.src_data_rank = None  # every rank already holds the full weight: slice locally, no scatter
    return parallelize_module(new, mesh, ps)


def _local_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)  # a copy: the full weight can be freed
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return new


def _shard(module: nn.Module, style: str, mesh, fqn: str, dtensor: bool) -> nn.Module:
    rank, world = mesh.get_local_rank(), mesh.size()
    if type(module) is nn.Linear and dtensor:
        return _float_linear_shard(module, mesh, style)
    if type(module) is nn.Linear:
        w, b = module.weight.detach(), module.bias
        if style == "colwise":
            rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
            return _local_linear(w[rows], b[rows] if b is not None else None)
        cols = slice(rank * w.shape[1] // world, (rank + 1) * w.shape[1] // world)
        return RowParallel(_local_linear(w[:, cols], None), b, mesh.get_group())
    if style == "colwise":
        return shard_rows(module, rank, world, fqn)
    bias = module.bias.detach() if module.bias is not None else None
    return RowParallel(shard_cols(module, rank, world, fqn), bias, mesh.get_group())


def _head_shard(head: nn.Module, mesh, fqn: str) -> nn.Module:
    rank, world = mesh.get_local_rank(), mesh.size()
    if type(head) is nn.Linear:
        rows = slice(rank * head.out_features // world, (rank + 1) * head.out_features // world)
        inner = nn.Linear(head.in_features, head.out_features // world, bias=head.bias is not None, device="meta")
        inner.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
        if head.bias is not None:
            inner.bias = nn.Parameter(head.bias.detach()[rows].clone(), requires_grad=False)
    else:
        inner = shard_rows(head, rank, world, fqn)
    return GatherOutput(inner, mesh.get_group(), world)


def tensor_parallel_(model: nn.Module, mesh=None, plan: Any = "auto", *, vocab_parallel: bool | None = None,
                     dtensor: bool = False, keep_original: str = "disk", step: str | None = None) -> nn.Module:
    """Split ``model``'s weights across the ranks of ``mesh`` in place (Megatron-style tensor parallelism).

    Call it on every rank with the same model and the same inputs afterwards: each rank then computes
    its share of the heads and of the MLP, and ``model(...)``/``model.generate(...)`` return the same
    logits and tokens on every rank, equal to the single-process model's up to float summation order.

    Args:
        model: a transformers causal LM (:data:`TP_FAMILIES`) in fp32/bf16/fp16, possibly with
            :class:`~infopt.quantize.Int8Linear`/:class:`~infopt.quantize.Int4Linear` projections.
        mesh: a 1-D ``DeviceMesh``, or None for the whole default process group (gloo on CPU, nccl on CUDA).
        plan: ``"auto"`` (q/k/v, gate/up column-parallel; o, down row-parallel) or a dict of
            layer-relative names to ``"colwise"``/``"rowwise"``.
        vocab_parallel: split the embedding and output head over the vocabulary (the head's logits are
            all-gathered); None splits them when the world size divides the vocabulary and the embedding is a
            plain ``nn.Embedding``, otherwise keeps them replicated.
        dtensor: shard float ``nn.Linear`` layers with DTensor (``parallelize_module`` with
            ``ColwiseParallel``/``RowwiseParallel``: DTensor parameters, for DTensor-aware tooling) instead of
            plain local shards with one ``all_reduce`` per row-parallel layer (the default). Both compute the
            same numbers; DTensor dispatch costs decode speed on CPU (see ``docs/parallel.md``). Quantized
            layers are always sharded by hand.
        keep_original: ``"disk"`` (default) moves the full weights to a temporary file so each rank
            really holds only its shard, while :func:`infopt.undo` still restores them; ``"memory"`` keeps them.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: no initialized process group, an architecture without a plan, a world size
            that does not divide the heads / KV heads / MLP width (the message lists the ones that work),
            bitsandbytes layers, a quantized group straddling two ranks. The model is untouched.

    Example:
        >>> # torchrun --nproc-per-node 3 script.py
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> dist.init_process_group("gloo")  # doctest: +SKIP
        >>> model, tok = infopt.models.load_default()  # doctest: +SKIP
        >>> tensor_parallel_(model)  # doctest: +SKIP
        >>> model.generate(tok("Hi", return_tensors="pt").input_ids, max_new_tokens=8)  # doctest: +SKIP
    """
    if keep_original not in ("disk", "memory"):
        raise IncompatibleModelError(f"tensor_parallel_(keep_original={keep_original!r}); allowed: 'disk', 'memory'")
    require_not_parallel(model, "tensor_parallel_")
    mesh = resolve_mesh(mesh, model, "tensor_parallel_")
    info = inspect_model(model)
    tp = plan_tensor_parallel(model, mesh.size(), plan, vocab_parallel, info)
    key = step or "parallel"
    rank, world = mesh.get_local_rank(), mesh.size()
    # build every shard first: a failure leaves the model untouched
    with torch.no_grad():
        new = {fqn: _shard(model.get_submodule(fqn), style, mesh, fqn, dtensor) for fqn, style in tp.layers}
        if tp.vocab_parallel:
            embed = model.get_submodule(info.embed_fqn)
            rows = slice(rank * info.vocab_size // world, (rank + 1) * info.vocab_size // world)
            shard = nn.Parameter(embed.weight.detach()[rows].clone(), requires_grad=False)
            new[info.embed_fqn] = VocabParallelEmbedding(shard, rows.start, info.vocab_size, embed.padding_idx,
                                                         mesh.get_group(), getattr(embed, "embed_scale", None))
            head = model.get_submodule(info.lm_head_fqn)
            if info.tied_embeddings:
                inner = nn.Linear(head.in_features, head.out_features // world, bias=False, device="meta")
                inner.weight = shard  # the tie survives: one shard serves lookups and logits
                new[info.lm_head_fqn] = GatherOutput(inner, mesh.get_group(), world)
            else:
                new[info.lm_head_fqn] = _head_shard(head, mesh, info.lm_head_fqn)
    for fqn, mod in new.items():
        swap_module(model, fqn, mod, step=key, keep_original=keep_original)
    for lf in info.layer_fqns:  # families that keep head counts on the attention module (Llama reshapes with -1)
        attn = model.get_submodule(f"{lf}.{FAMILIES[info.model_type].attn}")
        for name, full in (("num_heads", info.num_heads), ("num_key_value_heads", info.num_kv_heads)):
            if isinstance(getattr(attn, name, None), int) and getattr(attn, name) == full:
                set_attr(model, attn, name, full // world, step=key)
    set_attr(model, model, "_infopt_parallel", {"kind": "tensor", "world": world, "rank": rank,
                                                "vocab_parallel": tp.vocab_parallel, "local_bytes": local_bytes(model)},
             step=key)
    return model
