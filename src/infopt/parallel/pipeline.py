"""Pipeline parallelism in place: each rank keeps a contiguous run of decoder layers and passes activations on.

``torch.distributed.pipelining`` splits a model into stage modules driven by its own schedule,
with fixed shapes and no KV cache, so it cannot drive ``model.generate`` (a growing cache, one
token per step). Here the model's own forward keeps running on every rank; each decoder-layer slot
is replaced by a :class:`_Slot`:

- the first slot of a rank's stage runs all of that rank's layers: it receives the activations
  from the previous rank (``recv``), runs its layers, and sends them on (``isend``). A prefill is
  cut into ``micro_batches`` chunks along the sequence, so rank r+1 works on chunk i while rank r
  computes chunk i+1 (each chunk attends to the earlier ones through the layer's KV cache, as in a
  chunked prefill);
- slots of layers another rank owns pass the activations through and write a one-value-per-token
  placeholder into the KV cache, so ``cache.get_seq_length()`` (read from layer 0) is right on every rank;
- the last slot broadcasts the final hidden states from the last rank, so every rank computes the
  same norm and head (both replicated) and ``generate`` picks the same token everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.compat import cache_from
from ..core.errors import IncompatibleModelError
from ..core.introspect import ModelInfo, inspect_model, text_config
from ..core.patch import set_attr, swap_module
from .dist import local_bytes, require_not_parallel, require_process_group
from .tensor import TP_FAMILIES

__all__ = ["pipeline_parallel_", "check_pipeline", "stage_bounds"]

_SLICEABLE = ("attention_mask", "position_embeddings", "position_ids", "past_key_values", "cache", "use_cache",
              "cache_position")


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` layer ranges per stage, the first stages taking one extra layer when uneven.

    Example:
        >>> stage_bounds(30, 4)
        [(0, 8), (8, 16), (16, 23), (23, 30)]
    """
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _chunk_kwargs(kwargs: dict[str, Any], s: int, e: int, past: int, seq: int, attn_impl: str,
                  device: torch.device) -> dict[str, Any] | None:
    """The layer kwargs for query positions ``[s, e)`` of a ``seq``-token prefill after ``past`` cached tokens,
    or None when they cannot be cut (an unknown tensor argument, a mask type that cannot be sliced)."""
    out = dict(kwargs)
    for k, v in kwargs.items():
        if k not in _SLICEABLE and (torch.is_tensor(v) or isinstance(v, (tuple, list))):
            return None
    pe = kwargs.get("position_embeddings")
    if pe is not None:
        out["position_embeddings"] = tuple(t[:, s:e] for t in pe)  # cos/sin: [B|1, S, D]
    for k in ("position_ids", "cache_position"):
        if torch.is_tensor(kwargs.get(k)):
            out[k] = kwargs[k][..., s:e]
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 4 and mask.shape[-2] == seq:
        # [B, 1, q, kv]: a growing cache returns past + e keys at this chunk; a static one always its full length
        out["attention_mask"] = mask[:, :, s:e, : past + e] if mask.shape[-1] == past + seq else mask[:, :, s:e]
    elif mask is None and attn_impl == "sdpa":
        # sdpa without a mask means "causal from the top-left", wrong for a later chunk: spell it out
        q = torch.arange(past + s, past + e).unsqueeze(1)
        kv = torch.arange(past + e).unsqueeze(0)
        out["attention_mask"] = (kv <= q).to(device)[None, None]  # [1, 1, q, kv], True = attend
    elif mask is not None or attn_impl not in ("flash_attention_2", "flash_attention_3"):
        return None  # flash attention aligns its causal mask bottom-right, which is right for chunks
    return out


class _Slot(nn.Module):
    """What stands at one decoder-layer index on one rank (see the module docstring)."""

    def __init__(self, layer_idx: int, *, stage_layers: list[nn.Module] | None, rank: int, stages: int,
                 last_index: bool, micro_batches: int, attn_impl: str, group=None, attention_type: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.stage_layers = nn.ModuleList(stage_layers) if stage_layers is not None else None
        self.owned = stage_layers is not None
        self.rank = rank
        self.stages = stages
        self.last_index = last_index
        self.micro_batches = micro_batches
        self.attn_impl = attn_impl
        self.group = group
        self.placeholder = False  # set for layers another rank owns
        self.chunks = 0  # chunks the last multi-token call was cut into (for tests and the report)
        if attention_type is not None:
            self.attention_type = attention_type

    def _run_stage(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        seq = hidden.shape[1]
        cache = cache_from(kwargs)
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        # chunks append to a growing cache layer by layer; caches that lay out a step's tokens up front do not chunk
        n = min(self.micro_batches, seq) if cache is None or type(cache).__name__ == "DynamicCache" else 1
        bounds = [(i * seq // n, (i + 1) * seq // n) for i in range(n)]
        pieces = [kwargs] if n == 1 else [_chunk_kwargs(kwargs, s, e, past, seq, self.attn_impl, hidden.device)
                                          for s, e in bounds]
        if any(p is None for p in pieces):
            bounds, pieces = [(0, seq)], [kwargs]
        if seq > 1:
            self.chunks = len(bounds)
        outs, sends = [], []
        for (s, e), kw in zip(bounds, pieces, strict=True):
            if self.rank == 0:
                x = hidden[:, s:e]
            else:
                x = torch.empty_like(hidden[:, s:e].contiguous())  # [B, chunk, H]
                dist.recv(x, src=self.rank - 1, group=self.group)
            for layer in self.stage_layers:
                x = layer(x, **kw)
            if self.rank < self.stages - 1:
                x = x.contiguous()
                sends.append((dist.isend(x, dst=self.rank + 1, group=self.group), x))
            outs.append(x)
        for work, _ in sends:
            work.wait()
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.stage_layers is not None:
            hidden_states = self._run_stage(hidden_states, kwargs)
        elif self.placeholder:
            cache = cache_from(kwargs)
            if cache is not None and kwargs.get("use_cache", True) is not False:
                b, s = hidden_states.shape[:2]
                ph = hidden_states.new_zeros(b, 1, s, 1)  # [B, 1, S, 1]: tokens counted, nothing stored
                cache.update(ph, ph, self.layer_idx)
        if self.last_index and self.stages > 1:
            hidden_states = hidden_states.contiguous()
            dist.broadcast(hidden_states, src=self.stages - 1, group=self.group)
        return hidden_states

    def extra_repr(self) -> str:
        role = "stage" if self.stage_layers is not None else ("placeholder" if self.placeholder else "pass")
        return f"layer_idx={self.layer_idx}, rank={self.rank}, role={role}"


def check_pipeline(model: nn.Module, stages: int, info: ModelInfo | None = None) -> None:
    """Raise :class:`IncompatibleModelError` unless ``model`` can be split into ``stages`` pipeline stages.

    Example:
        >>> from infopt.models import tiny_model
        >>> check_pipeline(tiny_model(num_layers=2), 3)
        Traceback (most recent call last):
        ...
        infopt.core.errors.IncompatibleModelError: pipeline_parallel_: 3 stages for 2 decoder layers; use at most 2
    """
    info = info or inspect_model(model)
    if info.model_type not in TP_FAMILIES:
        raise IncompatibleModelError(
            f"pipeline parallelism supports model types {', '.join(TP_FAMILIES)}; got '{info.model_type}'"
        )
    if stages > info.num_layers:
        raise IncompatibleModelError(
            f"pipeline_parallel_: {stages} stages for {info.num_layers} decoder layers; use at most {info.num_layers}"
        )
    layer_types = set(getattr(text_config(model.config), "layer_types", None) or ())
    if len(layer_types) > 1:
        raise IncompatibleModelError(
            f"pipeline_parallel_ runs a stage's layers with one attention mask, but this model mixes layer types "
            f"{sorted(layer_types)}; use tensor parallelism (infopt.parallel.tensor_parallel_) for it"
        )


def pipeline_parallel_(model: nn.Module, stages: int | None = None, *, micro_batches: int = 4,
                       keep_original: str = "disk", step: str | None = None) -> nn.Module:
    """Split ``model``'s decoder layers across the ranks of the default process group, in place.

    Call it on every rank, then call ``model(...)``/``model.generate(...)`` on every rank with the same
    inputs: each rank runs its layers and all ranks return the same logits and tokens. Embedding,
    final norm and head stay on every rank; the other ranks' layers are freed.

    Args:
        model: a transformers causal LM (:data:`~infopt.parallel.tensor.TP_FAMILIES`) whose decoder layers
            share one attention type.
        stages: number of stages; must equal the world size (None: the world size).
        micro_batches: chunks a prefill is cut into along the sequence so the stages overlap; 1 disables.
        keep_original: ``"disk"`` (default) frees the layers this rank does not run (kept in a temporary
            file for :func:`infopt.undo`); ``"memory"`` keeps them in RAM.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: no process group, ``stages`` not the world size or more than the layers,
            an unsupported architecture or mixed attention types. The model is untouched.

    Example:
        >>> # torchrun --nproc-per-node 2 script.py, after dist.init_process_group("gloo")
        >>> pipeline_parallel_(model, stages=2)  # doctest: +SKIP
        >>> model.generate(ids, max_new_tokens=16, do_sample=False)  # doctest: +SKIP
    """
    require_process_group("pipeline_parallel_")
    require_not_parallel(model, "pipeline_parallel_")
    world, rank = dist.get_world_size(), dist.get_rank()
    stages = world if stages is None else stages
    if not isinstance(stages, int) or isinstance(stages, bool) or stages != world:
        raise IncompatibleModelError(
            f"pipeline_parallel_(stages={stages!r}) must equal the world size {world} (one stage per rank); "
            f"launch {stages} processes (torchrun --nproc-per-node {stages}) or pass stages={world}"
        )
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise IncompatibleModelError(f"pipeline_parallel_(micro_batches={micro_batches!r}) must be a positive integer")
    if keep_original not in ("disk", "memory"):
        raise IncompatibleModelError(f"pipeline_parallel_(keep_original={keep_original!r}); allowed: 'disk', 'memory'")
    info = inspect_model(model)
    check_pipeline(model, stages, info)
    key = step or "parallel"
    bounds = stage_bounds(info.num_layers, stages)
    start, stop = bounds[rank]
    attn_impl = getattr(model.config, "_attn_implementation", None) or "eager"
    slots = []
    for i, fqn in enumerate(info.layer_fqns):
        layer = model.get_submodule(fqn)
        owned = start <= i < stop
        slot = _Slot(i, stage_layers=[model.get_submodule(info.layer_fqns[j]) for j in range(start, stop)]
                     if i == start else None, rank=rank, stages=stages, last_index=i == info.num_layers - 1,
                     micro_batches=micro_batches, attn_impl=attn_impl, attention_type=getattr(layer, "attention_type", None))
        slot.placeholder = not owned
        slots.append((fqn, slot, owned))
    for fqn, slot, owned in slots:
        # layers this rank runs live on inside its stage slot; the others are freed
        swap_module(model, fqn, slot, step=key, keep_original="memory" if owned else keep_original)
    set_attr(model, model, "_infopt_parallel", {"kind": "pipeline", "world": world, "rank": rank,
                                                "layers": (start, stop), "local_bytes": local_bytes(model)}, step=key)
    return model
