"""The forward every decode loop calls: prompt, one-token decode, k-token verify and the batching engine's packed
step go through one object.

:class:`Forward` runs the model eagerly. The ``compile`` step supplies a subclass that runs the fixed-shape
calls (decode and verify over a static cache) through compiled graphs, and the engine's packed step through one
graph with dynamic shapes; the loops do not know which they got.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from ..core.compat import CACHE_KWARG
from ..ops.scope import in_packed_call, packed_call

__all__ = ["Forward", "takes_logits_to_keep", "static_length", "croppable", "rollback", "full_length_dynamic_cache",
           "packed_call", "in_packed_call", "head_rows", "mlps_in_slices", "MLP_ROWS"]

_TAKES: dict[type, bool] = {}


def head_rows(keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (the token indices whose logits are due) as the head should compute them: on a CPU, 2 or 3 rows get
    the last one repeated to make 4 (fp32 CPU matmuls take a slow path for 2-3 rows: 3 rows of the default model's
    head cost 2.3x 4 rows, ``benchmarks/studies/small_m_matmul.py``); the caller reads the first ``len(keep)`` rows.

    Example:
        >>> head_rows(torch.tensor([5, 9])).tolist()
        [5, 9, 9, 9]
    """
    if keep.numel() in (2, 3) and keep.device.type == "cpu":
        return torch.cat([keep, keep[-1:].expand(4 - keep.numel())])
    return keep


MLP_ROWS = 512
"""Tokens an MLP takes at once in a long prompt's forward on a CPU (:func:`mlps_in_slices`)."""

_NO_MLPS: tuple = ()
_MLPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_wise_mlps(model: nn.Module) -> tuple[nn.Module, ...]:
    """The decoder layers' ``mlp`` modules that compute each token alone (dense MLPs: no experts, whose routing
    may weigh tokens together), found once per model."""
    found = _MLPS.get(model)
    if found is None:
        layers = getattr(getattr(model, "model", model), "layers", None)
        mlps = [getattr(layer, "mlp", None) for layer in (layers if isinstance(layers, nn.ModuleList) else ())]
        ok = all(isinstance(m, nn.Module) and not hasattr(m, "experts") and not hasattr(m, "router") for m in mlps)
        found = tuple(mlps) if mlps and ok else _NO_MLPS
        _MLPS[model] = found
    return found


@contextlib.contextmanager
def mlps_in_slices(model: nn.Module, tokens: int, rows: int | None = None):
    """Within the block, a forward of more than ``rows`` tokens (default :data:`MLP_ROWS`) on a CPU runs each dense
    MLP on slices of ``rows`` tokens (the last one ``rows`` to ``2 * rows - 1``) and joins the outputs. An MLP
    computes each token alone, so the logits are the same bit for bit (the kernels' per-row results do not depend on
    the rows beside them, and no slice is short enough for a layer to pick another kernel than for the whole call:
    tested); only its
    intermediate activations shrink, from ``tokens x intermediate_size`` to ``rows x intermediate_size`` (a 4k
    prompt on a 0.5B model: peak RSS 1.46 -> 1.13 GB, and the prompt 15% faster, the slices staying in cache).
    Patches the MLP instances for the block only."""
    rows = rows or MLP_ROWS
    mlps = _token_wise_mlps(model) if tokens > rows else _NO_MLPS
    first = next(iter([*mlps[0].parameters(), *mlps[0].buffers()]), None) if mlps else None  # int4: buffers
    if first is None or first.device.type != "cpu":
        yield
        return
    saved = [m.__dict__.get("forward") for m in mlps]

    def sliced(forward):
        def run(x, *args, **kwargs):
            n = x.shape[-2] if x.dim() >= 2 else 0
            if n <= rows:
                return forward(x, *args, **kwargs)
            # slices of `rows` tokens, the last one taking the rest (rows to 2 * rows - 1 tokens): none is shorter
            # than `rows`, so a layer that picks its kernel by a call's rows (int4's dense and prompt paths start
            # at 8 to 64) picks for every slice what it picks for the whole call
            starts = list(range(0, n, rows))
            if n - starts[-1] < rows:
                starts.pop()
            ends = [*starts[1:], n]
            return torch.cat([forward(x[..., a:b, :], *args, **kwargs) for a, b in zip(starts, ends, strict=True)],
                             dim=-2)
        return run

    for m in mlps:
        m.forward = sliced(m.forward)
    try:
        yield
    finally:
        for m, prior in zip(mlps, saved, strict=True):
            if prior is None:
                del m.forward
            else:
                m.forward = prior


def takes_logits_to_keep(model: nn.Module) -> bool:
    """True when ``model.forward`` accepts ``logits_to_keep`` (so only the needed positions reach the head)."""
    t = type(model)
    if t not in _TAKES:
        _TAKES[t] = "logits_to_keep" in inspect.signature(t.forward).parameters
    return _TAKES[t]


def static_length(cache) -> int | None:
    """The fixed length of a cache whose layers are all static (what a compiled step needs), else None."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, StaticLayer) for layer in layers):
        return None
    return int(cache.get_max_length())


class Forward:
    """Eager forwards of ``model`` for the decode loops.

    Args:
        model: a transformers causal LM.
        packed_weights: the engine's :meth:`packed` step uses the linears prepacked for it (a scoped
            ``infopt.compile.packed.pack_linears_``); False: the plain weights.
    """

    compiled = False

    def __init__(self, model: nn.Module, *, packed_weights: bool = True):
        self.model = model
        self.keeps = takes_logits_to_keep(model)
        self.packed_weights = packed_weights

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, keep: int = 1) -> torch.Tensor:
        """The prompt's forward: fp32-castable logits ``[B, keep, V]`` of its last ``keep`` positions."""
        kw = {"logits_to_keep": keep} if self.keeps else {}
        with mlps_in_slices(self.model, input_ids.shape[-1]):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **{CACHE_KWARG: cache}, **kw).logits
        return logits[:, -keep:]

    def drafts(self, batch: int) -> bool:
        """Whether a speculative call of ``batch`` rows should draft through this forward (a compiled forward
        answers no where its verify widths for that batch were not compiled and would run eagerly)."""
        return True

    def step_seconds(self, batch: int, k: int, length: int) -> float | None:
        """The measured time of a ``k``-token :meth:`step` of ``batch`` rows on a cache of ``length`` slots, or None
        where it was not measured (eager forwards are not; a compile step's warm-up times its graphs)."""
        return None

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
             attention_mask: torch.Tensor | None, cache, first: int | None = None) -> torch.Tensor:
        """``k`` new tokens per row after the cached ones: fp32 logits ``[B, k, V]``.

        Args:
            input_ids, position_ids: ``[B, k]``.
            cache_position: ``[k]`` cache slots the tokens take.
            attention_mask: ``[B, W]`` over the cache slots (``W`` at least the filled length plus ``k``; a static
                cache's full length for a fixed shape), or None when no row has padding or holes.
            cache: the transformers ``Cache``.
            first: ``cache_position[0]`` as a Python int, when the caller keeps it on the host: reading it from a
                GPU tensor waits for the GPU to finish every queued kernel, once per token.
        """
        k = input_ids.shape[1]
        kw = {"logits_to_keep": k} if self.keeps else {}
        if attention_mask is not None:  # eager: the mask up to the last new slot, as generate passes it
            end = first + k if first is not None else int(cache_position[-1]) + 1
            attention_mask = attention_mask[:, :end]
        # the model derives the cache slots itself, as in generate (an evicting cache maps them its own way)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, **{CACHE_KWARG: cache}, **kw)
        return out.logits[:, -k:].float()

    def packed_scope(self):
        """The context an eager :meth:`packed` step runs in: :func:`packed_call` (the engine's prepacked weights), or
        none without ``packed_weights``."""
        return packed_call() if self.packed_weights else contextlib.nullcontext()

    def packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None, paged_step, *,
               eager: bool = False) -> torch.Tensor:
        """The batching engine's step: every scheduled sequence's new tokens packed into one row over a paged cache.

        Args:
            input_ids, position_ids: ``[1, T]``, the step's tokens and their positions.
            keep: the token indices whose logits are due (``logits_to_keep``), or None for every position (a model
                whose forward does not take ``logits_to_keep``).
            paged_step: the paged cache's ``step_inputs()``: each attention layer writes its new K/V and attends.
            eager: run this step eagerly whatever the forward (the engine's first step allocates the KV pools,
                which a compiled graph cannot do); the eager forward ignores it.

        Returns:
            The logits as the model returns them, ``[1, rows, V]``: the first ``len(keep)`` rows are ``keep``'s
            (:func:`head_rows` may add copies after them).
        """
        kw = {"logits_to_keep": head_rows(keep)} if self.keeps and keep is not None else {}
        with self.packed_scope():
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              paged_step=paged_step, **kw).logits


def croppable(cache) -> bool:
    """True when every layer of ``cache`` can drop its newest tokens (dynamic or static full-attention layers)."""
    return all(type(layer) is DynamicLayer or _full_static(layer) for layer in cache.layers)


def _full_static(layer) -> bool:
    """A static layer holding every slot at a fixed address (transformers' own, or a subclass such as
    :class:`infopt.kvcache.static.SizedStaticLayer`), not a rolling sliding-window one."""
    return isinstance(layer, StaticLayer) and not isinstance(layer, StaticSlidingWindowLayer)


def full_length_dynamic_cache(config):
    """A ``DynamicCache`` for ``config`` whose sliding-window layers keep every token, so it can roll back.

    transformers' dynamic sliding-window layer drops keys that leave the window, and a dropped key cannot come
    back when speculative decoding rejects draft tokens. A full layer keeps them; the model's sliding-window mask
    (built over cache positions for every layer) still keeps each query to its window, so the attention result is
    the same (Gemma 3, Mistral with a window), at the memory of the keys past the window.

    Example:
        >>> from infopt.models import tiny_model
        >>> cache = full_length_dynamic_cache(tiny_model("gemma3").config)
        >>> [type(layer).__name__ for layer in cache.layers], croppable(cache)
        (['DynamicLayer', 'DynamicLayer'], True)
    """
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def rollback(cache, n: int) -> None:
    """Drop the newest ``n`` tokens of ``cache``: a dynamic layer slices its tensors, a static layer moves its
    write position back (stale slots past it are masked as the future and overwritten next).

    transformers' own ``StaticCache`` has no ``crop`` (and ``generate`` refuses assisted decoding with it,
    transformers issue #32946); moving the fill counter back is all a rollback needs there.
    """
    if n <= 0:
        return
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        if _full_static(layer):
            layer.cumulative_length.sub_(n)
        else:
            layer.crop(-n)
