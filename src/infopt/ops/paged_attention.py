"""Paged attention's torch kernels: gathering a sequence's keys through its block table, the packed step's attention
(the decoding sequences in one batched SDPA, each prefill chunk alone), and that attention as one operator,
``infopt::paged_attention_sdpa``, with the C++ kernel's contract (:mod:`infopt.ops.cpp`), which a compiled forward
calls where neither the C++ kernel nor flash-attn applies. :mod:`infopt.attention.paged` picks among them.
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's schema from real annotations
import torch
import torch.nn.functional as F

__all__ = ["split_packed", "gather_kv", "in_window", "decode_sdpa", "packed_sdpa", "paged_attention_sdpa"]


def split_packed(new: list[int], kv: list[int], first: list[int], block_size: int, device: torch.device):
    """:meth:`infopt.attention.paged.PagedAttentionMetadata.packed_split` from each sequence's new-token count, kv length and first token."""
    dec = [i for i, n in enumerate(new) if n == 1]
    dec_rows = torch.tensor(dec, dtype=torch.long, device=device)
    dec_tokens = torch.tensor([first[i] for i in dec], dtype=torch.long, device=device)
    dec_blocks = -(-max((kv[i] for i in dec), default=0) // block_size)
    prefills = [(i, first[i], n, kv[i]) for i, n in enumerate(new) if n > 1]
    return dec_rows, dec_tokens, dec_blocks, prefills


def gather_kv(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    # pool: [num_blocks, block_size, H_kv, D]; table: [S, nb] -> [S, H_kv, length, D]
    s, nb = table.shape
    return pool[table].reshape(s, nb * pool.shape[1], pool.shape[2], pool.shape[3])[:, :length].transpose(1, 2)


def in_window(pos: torch.Tensor, length: int, window: int | None) -> torch.Tensor | None:
    """``[..., length]`` bool: key ``j`` is within the sliding window of a query at ``pos`` (``j > pos - window``);
    None without a window. Causality is masked separately.

    Example:
        >>> in_window(torch.tensor([4]), 6, 3).int().tolist()
        [[0, 0, 1, 1, 1, 1]]
        >>> in_window(torch.tensor([4]), 6, None) is None
        True
    """
    if not window:
        return None
    return torch.arange(length, device=pos.device) > (pos[..., None] - window)


def decode_sdpa(query, key_pool, value_pool, block_table, kv_lens, scaling, window=None):
    """Attention of a decode step, one new token per sequence (``query [S, H, D]``, token ``i`` is sequence ``i``'s,
    at position ``kv_lens[i] - 1``) over each sequence's keys through the whole ``block_table [S, nb]`` -> ``[S, H,
    Dv]``. Only shapes reach Python, no value is read back to the host, so the call is the same kernels whatever the
    lengths (what a captured CUDA graph replays). Slots past a sequence's ``kv_len`` are masked; a row whose
    ``kv_len`` is 1 attends to its first slot alone.

    Example:
        >>> pool = torch.randn(4, 2, 1, 8)  # 4 blocks of 2 slots, one KV head
        >>> q, table, lens = torch.randn(2, 1, 8), torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 4])
        >>> decode_sdpa(q, pool, pool, table, lens, 0.35).shape
        torch.Size([2, 1, 8])
    """
    h, h_kv, block_size = query.shape[1], key_pool.shape[2], key_pool.shape[1]
    length = block_table.shape[1] * block_size
    k = gather_kv(key_pool, block_table, length)  # [S, H_kv, L, D]
    v = gather_kv(value_pool, block_table, length)
    mask = torch.arange(length, device=query.device)[None, :] < kv_lens[:, None]  # [S, L]
    near = in_window(kv_lens - 1, length, window)
    mask = (mask if near is None else mask & near)[:, None, None]
    out = F.scaled_dot_product_attention(query[:, :, None], k, v, attn_mask=mask, scale=scaling,
                                         enable_gqa=h != h_kv)  # [S, H, 1, Dv]
    return out[:, :, 0]


def packed_sdpa(flat, key_pool, value_pool, block_table, kv_lens, dec_rows, dec_tokens, dec_blocks, prefills,
                 scaling, window=None):
    """Attention of packed tokens ``flat [N, H, D]`` -> ``[N, H, Dv]``: the decoding sequences (rows ``dec_rows``,
    their tokens at ``dec_tokens``) in one batched SDPA over their first ``dec_blocks`` blocks, each prefill chunk
    ``(row, first token, n, kv_len)`` alone over exactly its keys."""
    n_tok, h, _ = flat.shape
    h_kv, dv, block_size = key_pool.shape[2], value_pool.shape[-1], key_pool.shape[1]
    out = flat.new_empty(n_tok, h, dv)
    if dec_rows.numel():
        table = block_table[dec_rows, :dec_blocks]  # [Sd, nb]: only the blocks decoders use
        length = dec_blocks * block_size
        k = gather_kv(key_pool, table, length)
        v = gather_kv(value_pool, table, length)
        mask = torch.arange(length, device=flat.device)[None, :] < kv_lens[dec_rows][:, None]  # [Sd, L]
        near = in_window(kv_lens[dec_rows] - 1, length, window)  # the decode token sits at kv_len - 1
        mask = (mask if near is None else mask & near)[:, None, None]
        o = F.scaled_dot_product_attention(flat[dec_tokens][:, :, None], k, v, attn_mask=mask, scale=scaling,
                                           enable_gqa=h != h_kv)  # [Sd, H, 1, Dv]
        out[dec_tokens] = o[:, :, 0]
    for row, start, n, kv_len in prefills:
        nb = -(-kv_len // block_size)
        table = block_table[row:row + 1, :nb]
        k = gather_kv(key_pool, table, kv_len)
        v = gather_kv(value_pool, table, kv_len)
        q = flat[start:start + n].transpose(0, 1)[None]  # [1, H, n, D]
        mask = None
        if n != kv_len or window:  # a later chunk (query i sits at position kv_len - n + i), or a sliding window
            pos = torch.arange(kv_len - n, kv_len, device=flat.device)
            mask = torch.arange(kv_len, device=flat.device)[None, :] <= pos[:, None]
            near = in_window(pos, kv_len, window)
            mask = (mask if near is None else mask & near)[None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                           enable_gqa=h != h_kv)  # [1, H, n, Dv]
        out[start:start + n] = o[0].transpose(0, 1)
    return out


@torch.library.custom_op("infopt::paged_attention_sdpa", mutates_args=())
def paged_attention_sdpa(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                          block_table: torch.Tensor, query_start: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                          window: int) -> torch.Tensor:
    """The reference kernel as one operator with the C++ kernel's contract (``query [n, H, D]``: the step's real
    tokens grouped by sequence, ``query_start [S + 1]``; returns ``[n, H, Dv]``). A compiled forward calls it
    where neither C++ kernel nor flash-attn applies (CUDA without flash-attn, C++ kernel off): the reference's
    per-step split is data-dependent Python, which a graph with dynamic shapes cannot trace. A step of one new token
    per sequence (``n == S``: every scheduled sequence has at least one) attends in one batched call over the whole
    block table with no value read back to the host; other steps read their layout back once per layer call."""
    n, s = query.shape[0], block_table.shape[0]
    if n == s:  # decoding only: token i is sequence i's
        return decode_sdpa(query, key_pool, value_pool, block_table, kv_lens, scale, window or None)
    starts = query_start.tolist()
    new = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    split = split_packed(new, kv_lens.tolist(), starts, key_pool.shape[1], query.device)
    return packed_sdpa(query, key_pool, value_pool, block_table, kv_lens, *split, scale, window or None)


@paged_attention_sdpa.register_fake
def _(query, key_pool, value_pool, block_table, query_start, kv_lens, scale, window):
    return query.new_empty(query.shape[0], query.shape[1], value_pool.shape[-1])
