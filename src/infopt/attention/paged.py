"""The ``paged`` attention backend: each query attends to its own sequence's K/V, read through a block table.

transformers calls an attention function as ``fn(module, query, key, value, attention_mask, **kwargs)``
right after the layer's ``past_key_values.update(key, value, layer_idx)``. A paged KV cache
(:class:`infopt.kvcache.PagedCache`) writes the new K/V into its block pool in ``update``, returns the
layer's pools as ``key``/``value`` and :func:`bind` s the step's :class:`PagedAttentionMetadata`;
:func:`paged_attention_forward` finds that binding (matched by the pool tensor's identity) and computes
attention through the block tables. Called with anything else (a plain forward, a ``DynamicCache`` for a
``generate`` call the paged cache does not serve), it is transformers' SDPA attention, so a model on this
backend keeps working everywhere.

Kernels:

- ``cpu``: infopt's C++ kernel (``infopt/ops/csrc/paged_attention.cpp``, :mod:`infopt.ops.cpp`) for fp32 and
  bf16 on CPU: reads K/V in place through the block tables (no gather, no repeat of K/V heads: each KV head is
  read once for its query group), splits the work over threads by sequence, KV head and query chunk (and by key
  range when few sequences decode long contexts, except inside :class:`fixed_key_order`), online softmax in fp32.
- ``flash_attn``: on CUDA with fp16/bf16 and ``flash-attn`` installed, flash-attn's variable-length kernel
  reading the block table directly (its paged mode needs a block size that is a multiple of 256).
- ``triton``: on CUDA, for decode-only steps (one new token per sequence), infopt's Triton kernel
  (:mod:`infopt.ops.triton_paged`): the block tables and lengths read on the device, split-K over long contexts.
- ``triton_prefill``: on CUDA, for the other packed steps of several sequences (prompt chunks beside decode
  tokens), infopt's Triton kernel for them: every token of the step in one launch per layer, blocks of 16 tokens of
  a sequence per program, its programs made from the host's lengths (the reference splits the step by sequence and
  attends to each prompt chunk alone: launches per layer grow with the sequences in the step).
  :func:`set_triton_decode` turns both Triton kernels off. The engine's compiled step on CUDA calls both as one
  operator, ``infopt::paged_attention_triton`` (``PagedAttentionMetadata.triton``, set outside the graph).
- ``reference``: torch on any device (gather each sequence's blocks, SDPA); the oracle in tests, and what runs
  where neither kernel applies (or the C++ kernel cannot be built: no compiler). A compiled forward (the engine's
  ``compile=True``) calls it as one operator, ``infopt::paged_attention_sdpa``.

:func:`kernel_calls` counts which kernel each layer call ran; :func:`set_cpu_kernel` turns the C++ kernel off.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.availability import is_available
from ..core.errors import IncompatibleModelError
from ..ops import cpp, triton_paged
from ..ops.paged_attention import decode_sdpa, gather_kv, in_window, packed_sdpa, split_packed
from .registry import register_attention

__all__ = ["PAGED_IMPL", "PagedAttentionMetadata", "PagedStep", "bind", "load_cpu_kernel", "paged_attention_forward",
           "register_paged_attention", "kernel_calls", "set_cpu_kernel", "set_triton_decode", "fixed_key_order"]

PAGED_IMPL = "infopt_paged"
"""The name the backend is registered under in transformers' ``AttentionInterface`` (``config._attn_implementation``)."""

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2 reads a paged KV cache only in pages of a multiple of 256 tokens

KERNELS = ("cpu", "flash_attn", "triton", "triton_prefill", "reference", "sdpa")
_CALLS = dict.fromkeys(KERNELS, 0)  # layer calls per kernel since import (a diagnostic: unlocked, += under the GIL)


def kernel_calls() -> dict[str, int]:
    """Layer calls of the ``paged`` backend per kernel since import: ``cpu`` (infopt's C++ kernel),
    ``flash_attn`` (flash-attn's paged varlen kernel), ``triton`` and ``triton_prefill`` (infopt's Triton kernels,
    :mod:`infopt.ops.triton_paged`: decode-only steps, and the packed steps holding prompt tokens), ``reference``
    (the torch gather + SDPA kernel) and ``sdpa`` (calls no paged cache served).

    Take the difference of two snapshots to see which kernel a piece of work ran.

    Example:
        >>> before = kernel_calls()
        >>> sorted(before)
        ['cpu', 'flash_attn', 'reference', 'sdpa', 'triton', 'triton_prefill']
    """
    return dict(_CALLS)


_USE_CPU_KERNEL = [True]
_USE_TRITON = [True]


class _KeySplit(threading.local):
    on: bool = True  # the C++ kernel may split long key ranges over threads (flash-decoding)


_KEY_SPLIT = _KeySplit()


class fixed_key_order:
    """Within this context (this thread), the C++ kernel sums every query row's keys in one order, never splitting a
    row's keys into parts merged afterwards, and a decode row in the same order as a prefill row (not in the
    three passes it takes otherwise). The split depends on how many sequences share the call, and a token is
    decoded once and recomputed in a prefill chunk after a preemption, so without this a request's attention could
    round differently beside others or when recomputed (:mod:`infopt.batching.invariant`).

    Example:
        >>> with fixed_key_order():
        ...     pass
    """

    def __enter__(self):
        self._previous, _KEY_SPLIT.on = _KEY_SPLIT.on, False
        return self

    def __exit__(self, *exc):
        _KEY_SPLIT.on = self._previous


def set_cpu_kernel(enabled: bool) -> bool:
    """Use infopt's C++ CPU kernel where it applies (the default) or the torch reference kernel; returns the
    previous setting. The reference gives the same results within float rounding (a tool for comparisons).

    Example:
        >>> previous = set_cpu_kernel(False)
        >>> set_cpu_kernel(previous)
        False
    """
    previous, _USE_CPU_KERNEL[0] = _USE_CPU_KERNEL[0], bool(enabled)
    return previous


def triton_enabled() -> bool:
    """Whether infopt's Triton kernels are on (:func:`set_triton_decode`; they run only where they apply)."""
    return _USE_TRITON[0]


def set_triton_decode(enabled: bool) -> bool:
    """Use infopt's Triton kernels (decode-only steps and the other packed steps) on CUDA where they apply (the
    default) or the torch reference kernel; returns the previous setting (a tool for comparisons).

    Example:
        >>> previous = set_triton_decode(False)
        >>> set_triton_decode(previous)
        False
    """
    previous, _USE_TRITON[0] = _USE_TRITON[0], bool(enabled)
    return previous


@dataclass
class PagedAttentionMetadata:
    """One forward's layout, shared by every layer (built by the paged cache before layer 0 attends).

    Queries are arranged on a grid ``[S, Q]``: one row per sequence in the step, its new tokens
    left-aligned. K/V pools are ``[num_blocks, block_size, kv_heads, head_dim]``.

    Attributes:
        block_size: token slots per block.
        block_table: ``[S, max_blocks]`` block ids of each sequence (rows padded with any valid id).
        kv_lens: ``[S]`` tokens each sequence holds after this step's writes.
        query_pos: ``[S, Q]`` position of each grid query in its sequence (0 on grid padding).
        mask: ``[S, 1, Q, max_blocks * block_size]`` bool, True where query may attend: slot ``j <= query_pos``;
            None for packed steps of several sequences (their kernel builds exact per-sequence masks).
        gather: ``[S, Q]`` index of each grid query in the forward's flattened tokens (``B * q``), or None
            when the grid is the forward's own ``[B, q]`` layout (a padded ``generate`` batch).
        scatter: ``[N]`` index into the flattened grid ``S * Q`` of each of the forward's tokens, or None
            with ``gather``.
        token_index: ``[n]`` flat indices (into ``B * q``) of the tokens that are real, grouped by sequence in
            position order; None when all are (packed steps). Padding tokens of a padded batch are neither
            stored nor attended to.
        new_lens: ``[S]`` real new tokens per sequence in this step.
        single: ``(new tokens, kv length)`` when the step is one sequence with no padding (batch-1 prefill
            and decode), so the reference kernel can attend over exactly its tokens with SDPA's causal fast
            path instead of a materialized mask; None otherwise.
        decode: a packed step of several sequences with one new token each (token ``i`` is sequence ``i``'s):
            the reference kernel attends in one batched call (:func:`~infopt.ops.paged_attention.decode_sdpa`)
            without reading the layout back to the host.
        max_new, max_kv: the largest ``new_lens`` and ``kv_lens``, known on the host when the layout was built
            (flash-attn takes them as ints; reading them from device tensors would wait on the device); None
            where the builder did not say.
        host_lens: for packed steps, ``(new_lens, kv_lens, first token of each sequence)`` as the host's ints, from
            the builder: the per-step split and the Triton kernel's programs are made from them without reading
            the device tensors back; None where the builder did not give them.
        triton: a compiled forward calls the Triton kernels' operator (``infopt::paged_attention_triton``) instead of
            the reference one: set outside the graph where they apply (the engine's compiled step on CUDA), with the
            programs built (:meth:`prefill_tiles`).
    """

    block_size: int
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    query_pos: torch.Tensor
    mask: torch.Tensor | None
    gather: torch.Tensor | None
    scatter: torch.Tensor | None
    token_index: torch.Tensor | None
    new_lens: torch.Tensor
    single: tuple[int, int] | None = None
    decode: bool = False
    max_new: int | None = None
    max_kv: int | None = None
    host_lens: tuple[list[int], list[int], list[int]] | None = None
    triton: bool = False
    _flash: tuple | None = None
    _tiles: torch.Tensor | None = None
    _split: tuple | None = None
    _starts: torch.Tensor | None = None

    def query_start(self) -> torch.Tensor:
        """``[S + 1]`` int64: sequence ``s`` owns rows ``[start[s], start[s + 1])`` of the step's real tokens."""
        if self._starts is None:
            self._starts = torch.cat([self.new_lens.new_zeros(1), self.new_lens.cumsum(0)])
        return self._starts

    def packed_split(self):
        """For packed steps: ``(decode_rows, decode_tokens, decode_blocks, prefills)`` built once per step.

        Decoding sequences (one new token) attend in one batched call over just the blocks they use;
        each sequence with several new tokens (a prefill chunk) attends alone over exactly its keys, so no
        query is padded to the longest chunk of the step.
        """
        if self._split is None:  # gather[:, 0]: the offset of each sequence's first new token
            news, lens, firsts = self.host_lens or (self.new_lens.tolist(), self.kv_lens.tolist(),
                                                    self.gather[:, 0].tolist())
            self._split = split_packed(news, lens, firsts, self.block_size, self.kv_lens.device)
        return self._split

    def prefill_tiles(self) -> torch.Tensor:
        """``[T, 2]`` int32 on the step's device: the programs of :func:`infopt.ops.triton_paged.paged_prefill`, built
        once per step from the host's lengths (``host_lens``; read back from the device where not given)."""
        if self._tiles is None:
            news = self.host_lens[0] if self.host_lens is not None else self.new_lens.tolist()
            self._tiles = torch.tensor(triton_paged.prefill_tiles(news), dtype=torch.int32).reshape(-1, 2).to(
                self.kv_lens.device)
        return self._tiles

    def flash_args(self):
        """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)`` for flash-attn, built once."""
        if self._flash is None:
            dev = self.kv_lens.device
            zero = torch.zeros(1, dtype=torch.int32, device=dev)
            cu_q = torch.cat([zero, self.new_lens.cumsum(0).to(torch.int32)])
            cu_k = torch.cat([zero, self.kv_lens.cumsum(0).to(torch.int32)])
            max_q = self.max_new if self.max_new is not None else int(self.new_lens.max())
            max_k = self.max_kv if self.max_kv is not None else int(self.kv_lens.max())
            self._flash = (cu_q, cu_k, max_q, max_k, self.block_table.to(torch.int32))
        return self._flash


class _Binding(threading.local):
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    meta: PagedAttentionMetadata | None = None


_BOUND = _Binding()


def bind(key_pool: torch.Tensor, value_pool: torch.Tensor, meta: PagedAttentionMetadata) -> None:
    """Announce that the next attention call receiving ``key_pool`` reads it through ``meta`` (called by the
    paged cache's ``update``, in the same thread, just before the layer attends)."""
    _BOUND.key, _BOUND.value, _BOUND.meta = key_pool, value_pool, meta


def _take(key: torch.Tensor) -> PagedAttentionMetadata | None:
    if _BOUND.key is not key:
        return None
    meta = _BOUND.meta
    _BOUND.key = _BOUND.value = _BOUND.meta = None  # one binding per layer call; holds no pool afterwards
    return meta


def _reference_packed(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None):
    # query: [1, H, N, D], the step's tokens flattened; each sequence's new tokens are contiguous
    flat = query[0].transpose(0, 1)  # [N, H, D]
    dec_rows, dec_tokens, dec_blocks, prefills = meta.packed_split()
    return packed_sdpa(flat, key_pool, value_pool, meta.block_table, meta.kv_lens, dec_rows, dec_tokens, dec_blocks,
                       prefills, scaling, window)[None]  # [1, N, H, Dv]


def _reference_op(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None):
    # the compiled form of `_reference`: attention in one opaque operator
    return _flat_op(torch.ops.infopt.paged_attention_sdpa, query, key_pool, value_pool, meta, scaling, window)


def _reference(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None):
    # query: [B, H, q, D]; pools: [num_blocks, block_size, H_kv, D]
    if meta.decode and meta.single is None and query.shape[0] == 1:  # [1, H, S, D]: one token per sequence
        return decode_sdpa(query[0].transpose(0, 1), key_pool, value_pool, meta.block_table, meta.kv_lens, scaling,
                           window)[None]  # [1, S, H, Dv]
    if meta.gather is not None and meta.single is None and query.shape[0] == 1:
        return _reference_packed(query, key_pool, value_pool, meta, scaling, window)
    b, h, q, d = query.shape
    s, nb = meta.block_table.shape
    h_kv = key_pool.shape[2]
    if meta.gather is None:
        qg = query  # grid == the forward's [B, q]
    else:
        qg = query.transpose(1, 2).reshape(b * q, h, d)[meta.gather].permute(0, 2, 1, 3)  # [S, H, Q, D]
    length = nb * meta.block_size
    k = gather_kv(key_pool, meta.block_table, length)  # [S, H_kv, L, D]
    v = gather_kv(value_pool, meta.block_table, length)
    mask, causal = meta.mask, False
    if meta.single is not None:  # one sequence: attend over exactly its kv_len tokens
        n, kv_len = meta.single
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        if window and n == 1:  # one decode token: the window is the last `window` keys
            k, v = k[:, :, max(0, kv_len - window):], v[:, :, max(0, kv_len - window):]
            mask = None
        elif window:
            mask = mask[..., :kv_len] & in_window(meta.query_pos[:, None, :], kv_len, window)
        else:
            mask = None if n in (1, kv_len) else mask[..., :kv_len]
            causal = n == kv_len > 1  # a fresh prefill: SDPA's causal kernel, no mask materialized
    elif window:  # query_pos: [S, Q] -> [S, 1, Q, L]
        mask = mask & in_window(meta.query_pos[:, None, :], mask.shape[-1], window)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, is_causal=causal, scale=scaling,
                                         enable_gqa=h != h_kv)
    out = out.transpose(1, 2)  # [S, Q, H, D]
    if meta.gather is None:
        return out.contiguous()
    return out.reshape(-1, h, out.shape[-1])[meta.scatter].reshape(b, q, h, out.shape[-1])


_CPU_DTYPES = (torch.float32, torch.bfloat16)


def load_cpu_kernel() -> bool:
    """Load the C++ paged-attention kernel now (building it on first use); True if it is available.

    The engine calls this when it starts on a CPU model: the first attention call would load it otherwise, and a
    ``torch.compile``-d forward cannot do that while tracing (dynamo cannot enter the loader's lock)."""
    return cpp.load("paged_attention")


def _cpu_ok(query: torch.Tensor, key_pool: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    return (_USE_CPU_KERNEL[0] and query.device.type == "cpu" and query.dtype in _CPU_DTYPES
            and key_pool.dtype in _CPU_DTYPES and cpp.load("paged_attention"))


def _cpu(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None):
    return _flat_op(torch.ops.infopt.paged_attention, query, key_pool, value_pool, meta, scaling, window,
                    split_keys=_KEY_SPLIT.on)


def _flat_op(op, query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None, **extra):
    # an operator taking the step's real tokens [n, H, D] grouped by sequence (the C++ kernel's contract)
    b, h, q, d = query.shape
    flat = query.transpose(1, 2).reshape(b * q, h, d)  # a view for packed steps ([1, H, N, D] from a transpose)
    if meta.token_index is not None:
        flat = flat[meta.token_index]
    scale = scaling if scaling is not None else d ** -0.5
    out = op(flat, key_pool, value_pool, meta.block_table, meta.query_start(), meta.kv_lens, float(scale),
             int(window or 0), **extra)  # [n, H, Dv]
    if meta.token_index is not None:
        full = out.new_zeros(b * q, h, out.shape[-1])
        full[meta.token_index] = out
        out = full
    return out.view(b, q, h, out.shape[-1])


def _triton_eager(query: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    # a packed step of several sequences, eager (a compiled forward takes the operator: meta.triton), on CUDA or the
    # interpreter; is_compiling first: a compiled forward never reads meta.decode (a guard would recompile per kind)
    return (not torch.compiler.is_compiling() and _USE_TRITON[0] and meta.single is None and query.shape[0] == 1
            and triton_paged.available(query))


def _triton_ok(query: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    return _triton_eager(query, meta) and meta.decode  # decode-only steps


def _triton_packed_ok(query: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    # the other packed steps (prompt chunks beside decode tokens), every token real
    return _triton_eager(query, meta) and meta.gather is not None and meta.token_index is None


def _flash_ok(query: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and meta.block_size % FLASH_PAGE_MULTIPLE == 0 and is_available("flash_attn"))


def _flash(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window=None):
    from flash_attn import flash_attn_varlen_func

    b, h, q, d = query.shape
    flat = query.transpose(1, 2).reshape(b * q, h, d)  # [B*q, H, D]
    if meta.token_index is not None:
        flat = flat[meta.token_index]
    cu_q, cu_k, max_q, max_k, table = meta.flash_args()
    # causal masks align to the end of each sequence's keys: query i of n sees keys up to kv_len - n + i
    # a sliding window: the query itself and the window - 1 keys before it
    out = flash_attn_varlen_func(flat.contiguous(), key_pool, value_pool, cu_q, cu_k, max_q, max_k,
                                 softmax_scale=scaling, causal=True, block_table=table,
                                 window_size=(window - 1, 0) if window else (-1, -1))
    if meta.token_index is not None:
        full = out.new_zeros(b * q, h, out.shape[-1])
        full[meta.token_index] = out
        out = full
    return out.reshape(b, q, h, out.shape[-1])


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of the ``paged`` backend.

    Args:
        module: the attention module (``num_key_value_groups`` and ``layer_idx`` are read by the fallback).
        query: ``[B, H, q, D]``.
        key, value: the layer's block pools ``[num_blocks, block_size, H_kv, D]`` when a paged cache bound
            them; otherwise ordinary ``[B, H_kv, kv, D]`` states, served by SDPA.
        attention_mask: unused on the paged path (the block layout defines what each query sees).
        scaling: softmax scale.

    Returns:
        ``(attn_output [B, q, H, D], None)``.

    A sliding-window layer (the ``sliding_window`` keyword, as Gemma 3 and Mistral pass it) sees the last
    ``sliding_window`` keys of its sequence, itself included.

    Raises:
        IncompatibleModelError: the layer uses logit soft-capping, which the paged kernels do not implement.
    """
    step = kwargs.pop("paged_step", None)
    meta = step.meta if step is not None else _take(key)
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _count("sdpa")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("softcap") is not None:
        raise IncompatibleModelError(
            f"{type(module).__name__} uses logit soft-capping, which the paged attention backend does not "
            "implement; use kvcache static or the default cache for this model"
        )
    if step is not None:  # the new K/V arrive here, not through a cache's update: write them into the blocks
        key, value = step.write(module.layer_idx, key, value)
    return _attend(query, key, value, meta, scaling, kwargs.get("sliding_window")), None


def _count(kernel: str) -> None:
    if not torch.compiler.is_compiling():  # a compiled forward would guard on the count and recompile each call
        _CALLS[kernel] += 1


def _attend(query, key_pool, value_pool, meta: PagedAttentionMetadata, scaling, window: int | None = None
            ) -> torch.Tensor:
    # window: the layer's sliding window in keys (None: every earlier key)
    if _flash_ok(query, meta):
        _count("flash_attn")
        return _flash(query, key_pool, value_pool, meta, scaling, window)
    if _cpu_ok(query, key_pool, meta):
        _count("cpu")
        return _cpu(query, key_pool, value_pool, meta, scaling, window)
    if _triton_ok(query, meta):
        _count("triton")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return triton_paged.paged_decode(query[0].transpose(0, 1), key_pool, value_pool, meta.block_table,
                                         meta.kv_lens, scale, window)[None]  # [1, S, H, Dv]
    if _triton_packed_ok(query, meta):
        _count("triton_prefill")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return triton_paged.paged_prefill(query[0].transpose(0, 1), key_pool, value_pool, meta.block_table,
                                          meta.kv_lens, meta.new_lens, meta.gather[:, 0], meta.prefill_tiles(),
                                          scale, window)[None]  # [1, N, H, Dv]
    if torch.compiler.is_compiling() and meta.triton and meta.token_index is None:
        _count("triton")
        return _flat_op(torch.ops.infopt.paged_attention_triton, query, key_pool, value_pool, meta, scaling, window,
                        tiles=meta.prefill_tiles())
    _count("reference")
    if torch.compiler.is_compiling():
        return _reference_op(query, key_pool, value_pool, meta, scaling, window)
    return _reference(query, key_pool, value_pool, meta, scaling, window)


@dataclass
class PagedStep:
    """One packed forward's layout, handed to the model as the ``paged_step`` keyword argument (transformers
    passes it down to every attention call): no cache object in the forward, no binding between a cache's
    ``update`` and the attention call. Each layer writes its new K/V into the pool's blocks at ``slots`` and
    attends through ``meta``. Built by :meth:`infopt.kvcache.PagedCache.step_inputs`.

    Attributes:
        pool: the :class:`~infopt.kvcache.pool.KVBlockPool` (its per-layer K/V tensors).
        meta: the step's :class:`PagedAttentionMetadata`.
        slots: ``[n]`` pool slot (block * block_size + offset) of each real new token.
    """

    pool: object
    meta: PagedAttentionMetadata
    slots: torch.Tensor

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the layer's new ``[B, H_kv, q, D]`` K/V at ``slots``; return its K/V pools."""
        b, h_kv, q, d = key.shape
        k_pool, v_pool = self.pool.storage(layer_idx, key, value)
        k_new = key.transpose(1, 2).reshape(b * q, h_kv, d)
        v_new = value.transpose(1, 2).reshape(b * q, h_kv, value.shape[-1])
        if self.meta.token_index is not None:  # a padded batch: only real tokens are stored
            k_new, v_new = k_new[self.meta.token_index], v_new[self.meta.token_index]
        # pools viewed as [num_blocks * block_size, H_kv, D]: one row per token slot
        k_pool.view(-1, h_kv, d).index_copy_(0, self.slots, k_new.to(k_pool.dtype))
        v_pool.view(-1, h_kv, v_pool.shape[-1]).index_copy_(0, self.slots, v_new.to(v_pool.dtype))
        return k_pool, v_pool


def register_paged_attention() -> str:
    """Register the backend with transformers (idempotent) and return its name, :data:`PAGED_IMPL`.

    Registers the attention function in ``AttentionInterface`` and SDPA's mask builder in
    ``AttentionMaskInterface`` under the same name (so calls the paged cache does not serve get
    the padding-aware masks SDPA needs). The registration is global and stays after
    :func:`infopt.undo`; it changes nothing for models not set to this backend.

    Example:
        >>> register_paged_attention()
        'infopt_paged'
    """
    return register_attention(PAGED_IMPL, paged_attention_forward)
