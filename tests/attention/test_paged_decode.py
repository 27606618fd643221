"""The reference paged attention's decode steps (one new token per sequence): one batched SDPA over the block table
that reads nothing back to the host, bit for bit what the per-step split computed."""

import pytest
import torch

import infopt
from infopt.attention import paged
from infopt.attention.paged import PagedAttentionMetadata, set_cpu_kernel
from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged
from infopt.models import tiny_model
from infopt.ops.paged_attention import decode_sdpa, packed_sdpa, split_packed


def _decode_layout(kv_lens, block_size, h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(nbs) + 2
    k = torch.randn(num_blocks, block_size, h_kv, d, generator=g)
    v = torch.randn(num_blocks, block_size, h_kv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(kv_lens), max(nbs), dtype=torch.long)
    used = 0
    for s, nb in enumerate(nbs):  # blocks scattered over the pool, rows padded with block 0 (as the cache lays out)
        table[s, :nb] = perm[used:used + nb]
        used += nb
    return k, v, table


@pytest.mark.parametrize("window", [None, 1, 5], ids=["full", "window1", "window5"])
@pytest.mark.parametrize("kv_lens", [[1], [3, 17, 1, 40], [16, 16, 33]], ids=["one", "mixed", "edges"])
def test_decode_sdpa_equals_the_split_path(kv_lens, window):
    k, v, table = _decode_layout(kv_lens, 16, 2, 32, seed=len(kv_lens))
    q = torch.randn(len(kv_lens), 4, 32)
    lens = torch.tensor(kv_lens)
    ones = [1] * len(kv_lens)
    split = split_packed(ones, kv_lens, list(range(len(kv_lens))), 16, q.device)
    assert split[2] == table.shape[1]  # the split's decode blocks: the table's width when every row decodes
    ref = packed_sdpa(q, k, v, table, lens, *split, 0.2, window)
    out = decode_sdpa(q, k, v, table, lens, 0.2, window)
    assert torch.equal(out, ref)
    # and the operator a compiled forward calls takes the same branch
    starts = torch.arange(len(kv_lens) + 1)
    assert torch.equal(torch.ops.infopt.paged_attention_sdpa(q, k, v, table, starts, lens, 0.2, window or 0), ref)


def test_decode_sdpa_reads_nothing_back(monkeypatch):
    """Every value stays on the device: a read back (``tolist``, ``item``, ``int(t)``) would fail here."""
    k, v, table = _decode_layout([3, 17, 40], 16, 2, 32, seed=0)
    q, lens = torch.randn(3, 4, 32), torch.tensor([3, 17, 40])
    expected = decode_sdpa(q, k, v, table, lens, 0.2, 5)

    def refuse(*a, **kw):
        raise AssertionError("decode_sdpa read a tensor's value back to the host")

    for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = decode_sdpa(q, k, v, table, lens, 0.2, 5)
    monkeypatch.undo()
    assert torch.equal(out, expected)


def test_engine_decode_steps_skip_the_split(monkeypatch):
    """Through the engine on the reference kernel: decode-only steps of several sequences go to ``decode_sdpa``
    and never build the per-step split (which reads the layout back); prefill steps still do; tokens as generate."""
    model = tiny_model("llama", max_positions=256)
    prompts = [[(5 * i + 3 * j) % 200 + 1 for j in range(4 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    seen = {"split_decode": 0, "split_other": 0, "decode": 0}
    split = PagedAttentionMetadata.packed_split

    def counting_split(meta):
        seen["split_decode" if meta.decode else "split_other"] += 1
        return split(meta)

    def counting_decode(*a, **kw):
        seen["decode"] += 1
        return decode_sdpa(*a, **kw)

    monkeypatch.setattr(PagedAttentionMetadata, "packed_split", counting_split)
    monkeypatch.setattr(paged, "decode_sdpa", counting_decode)
    previous = set_cpu_kernel(False)
    try:
        engine = Engine(model, max_batch_tokens=64, max_seqs=3, kv=Paged(num_blocks=64, block_size=8))
        out = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        set_cpu_kernel(previous)
    infopt.undo(model)
    plain = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
             .tolist() for p in prompts]
    assert out == plain
    assert seen["decode"] > 0 and seen["split_decode"] == 0 and seen["split_other"] > 0, seen


def test_flash_args_take_the_host_bounds():
    """flash-attn's maximum lengths come from the layout's host integers, not a read of the device tensors."""
    lens, new = torch.tensor([3, 9]), torch.tensor([1, 1])
    meta = PagedAttentionMetadata(block_size=16, block_table=torch.zeros(2, 1, dtype=torch.long), kv_lens=lens,
                                  query_pos=torch.zeros(2, 1, dtype=torch.long), mask=None,
                                  gather=torch.arange(2)[:, None], scatter=None, token_index=None, new_lens=new,
                                  decode=True, max_new=1, max_kv=9)
    cu_q, cu_k, max_q, max_k, _ = meta.flash_args()
    assert (max_q, max_k) == (1, 9) and cu_k.tolist() == [0, 3, 12] and cu_q.tolist() == [0, 1, 2]
