"""The batching engine's decode steps over fixed buffers, one bucket per batch size and block-table width: CUDA graphs
on a GPU, and their CPU twin (``cuda_graphs="replay"``: the same buffers, padding rows and buckets, the forward called
again), which checks the layout a GPU replays."""

import pytest
import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.batching.graphs import DecodeBuckets
from infopt.kvcache import Paged, PagedCache
from infopt.kvcache.decode_buffers import DecodeBuffers
from infopt.kvcache.pool import KVBlockPool
from infopt.models import tiny_model

from ..devices import DEVICES


def _plain(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt's greedy tokens from plain ``generate``, alone (``new`` of them, EOS not ending it early)."""
    return [model.generate(torch.tensor([p], device=model.device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]


def test_buckets_cover_the_engine_and_pick_the_smallest():
    buckets = DecodeBuckets.for_engine(max_seqs=64, max_blocks=512, block_size=16)
    assert buckets.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets.widths == (16, 64, 256, 512)
    assert buckets.pick(1, 1) == (1, 16) and buckets.pick(17, 65) == (24, 256) and buckets.pick(64, 512) == (64, 512)
    assert buckets.pick(65, 1) is None and buckets.pick(1, 513) is None
    assert DecodeBuckets.for_engine(3, 2, 16, batch_sizes=[2, 8]).batch_sizes == (2, 3)
    with pytest.raises(ValueError, match="graph batch sizes .* allowed: positive integers"):
        DecodeBuckets.for_engine(8, 8, 16, batch_sizes=[0, 4])


def test_buffers_keep_their_addresses_and_park_padding_on_the_scratch_block():
    buffers = DecodeBuffers(4, 3, block_size=4, scratch_block=7, device="cpu")
    fields = (buffers.input_ids, buffers.positions, buffers.slots, buffers.kv_lens, buffers.table(4, 3))
    before = [t.data_ptr() for t in fields]
    meta = buffers.meta(4, 2)
    buffers.stage([11, 12], [5, 0], [[2, 3], [4]], b=4, w=2)
    assert buffers.input_ids.tolist() == [11, 12, 0, 0] and buffers.positions.tolist() == [5, 0, 0, 0]
    assert buffers.slots.tolist() == [3 * 4 + 1, 4 * 4, 7 * 4, 7 * 4] and buffers.kv_lens.tolist() == [6, 1, 1, 1]
    assert buffers.table(4, 2).tolist() == [[2, 3], [4, 7], [7, 7], [7, 7]] and buffers.table(4, 2).is_contiguous()
    buffers.stage([9], [1], [[5]], b=1, w=1)
    assert [t.data_ptr() for t in fields] == before and buffers.meta(4, 2) is meta
    assert meta.decode and meta.max_kv == 8 and meta.block_table.data_ptr() == buffers.table(4, 3).data_ptr()
    assert meta.block_table.is_contiguous() and buffers.meta(1, 1).block_table.tolist() == [[5]]
    with pytest.raises(ValueError, match="row 0 needs 2 blocks; the bucket has 1"):
        buffers.stage([1], [6], [[1, 2]], b=1, w=1)
    with pytest.raises(ValueError, match="cannot run in bucket"):
        buffers.stage([1, 2], [0, 0], [[1], [2]], b=1, w=1)


def test_scratch_block_is_outside_the_allocator():
    pool = KVBlockPool(1, 4, 2, scratch_blocks=1)
    assert pool.scratch_block == 4
    k, v = pool.storage(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    assert k.shape[0] == v.shape[0] == 5
    assert sorted(pool.allocator.allocate_many(4)) == [0, 1, 2, 3]  # every block the allocator has; the scratch is not
    assert pool.allocator.num_available == 0
    with pytest.raises(ValueError, match="cannot grow"):
        pool.grow(2)
    with pytest.raises(ValueError, match="cannot be growable"):
        KVBlockPool(1, 4, 2, scratch_blocks=1, growable=True)


def test_layout_decode_lays_out_what_layout_step_does():
    model = infopt.attention.set_backend_(tiny_model(), "paged")
    cache = PagedCache.for_model(model, num_blocks=16, block_size=4, scratch_blocks=1)
    entries = [("a", list(range(1, 7))), ("b", [3, 4, 5])]
    for sid, toks in entries:
        cache.add_sequence(sid, toks)
    with torch.no_grad():
        cache.step(model, entries)  # the prompts
    step = [("a", [9]), ("b", [8])]
    starts = cache.blocks.allocate(step)
    ref = cache.layout_step(step, starts)
    ref_meta, ref_slots = cache._meta, cache._slots
    cache.abort_step()
    buffers = DecodeBuffers(4, 8, block_size=4, scratch_block=cache.pool.scratch_block, device="cpu")
    batch = cache.layout_decode(step, starts, buffers, 4, 8)
    assert batch.input_ids[0, :2].tolist() == ref.input_ids[0].tolist()
    assert batch.position_ids[0, :2].tolist() == ref.position_ids[0].tolist()
    assert buffers.slots[:2].tolist() == ref_slots.tolist()
    assert buffers.kv_lens[:2].tolist() == ref_meta.kv_lens.tolist() == [7, 4]
    for row, kv_len in enumerate([7, 4]):  # the blocks a row reads (past them, padding: block 0 there, scratch here)
        used = -(-kv_len // 4)
        assert buffers.table(4, 8)[row, :used].tolist() == ref_meta.block_table[row, :used].tolist()
    table = buffers.table(4, 8)
    assert table[1, 1:].eq(cache.pool.scratch_block).all() and table[2:4].eq(16).all()
    assert cache._meta is buffers.meta(4, 8) and batch.logits_indices.tolist() == [0, 1, 2, 3]
    cache.abort_step()
    with pytest.raises(ValueError, match="one new token per sequence"):
        cache.layout_decode([("a", [1, 2])], [7], buffers, 4, 8)


def test_engine_decode_steps_in_buckets_same_tokens(device):
    """Decode steps of 1-5 sequences (padded to buckets of 1, 2, 4 and 5 rows) through the fixed buffers: the same
    greedy tokens as the engine without them and as plain generate; the buckets were used and padded."""
    arg, backend = DEVICES[device].engine_graphs
    model = tiny_model("llama", max_positions=1024).to(device)
    prompts = [[(5 * i + 3 * j) % 200 + 1 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    kv = Paged(num_blocks=64, block_size=8)  # 512 tokens: block-table widths of 32 and 64 blocks
    plain_engine = Engine(model, max_batch_tokens=64, max_seqs=5, kv=kv, cuda_graphs=False)
    assert plain_engine.core.graphs is None and "cuda_graphs" not in plain_engine.metrics()
    expected = [o.token_ids for o in plain_engine.generate(prompts, params)]
    engine = Engine(model, max_batch_tokens=64, max_seqs=5, kv=kv, cuda_graphs=arg)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    stats = engine.metrics()["cuda_graphs"]
    assert stats["buckets"] == ["1x32", "1x64", "2x32", "2x64", "4x32", "4x64", "5x32", "5x64"]
    # a narrower table than the widest served every step (its own layout); a CUDA engine captured every bucket up
    # front, the CPU twin only those it used
    assert stats["served"] and all(c.endswith("x32") for c in stats["served"]), stats
    assert sum(stats["served"].values()) == stats["replays"]
    assert set(stats["captured"]) == (set(stats["buckets"]) if backend == "cuda" else set(stats["served"]))
    infopt.undo(model)
    plain = _plain(model, prompts, 10)
    assert got == expected == plain
    assert stats["backend"] == backend and stats["replays"] > 0 and stats["padded_rows"] > 0, stats
    assert stats["disabled"] is None and stats["recaptures"] == 0 and stats["captured"], stats


def test_moved_weights_recapture():
    model = tiny_model("llama", max_positions=128)
    engine = Engine(model, max_batch_tokens=32, max_seqs=2, kv=Paged(num_blocks=32, block_size=8),
                    cuda_graphs="replay")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = [o.token_ids for o in engine.generate([[1, 2, 3], [4, 5]], params)]
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # same values, new address
    again = [o.token_ids for o in engine.generate([[1, 2, 3], [4, 5]], params)]
    assert again == first and engine.metrics()["cuda_graphs"]["recaptures"] == 1


def test_cuda_graphs_argument_checked_model_untouched():
    model = tiny_model()
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
        Engine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs='always' is invalid; allowed: 'auto', True, False or 'replay'"):
        Engine(model, cuda_graphs="always")
    assert model.config._attn_implementation == "sdpa"
    assert Engine(model, kv=Paged(num_blocks=8)).core.graphs is None  # "auto" on a CPU: no graphs
    infopt.undo(model)


def test_a_failed_capture_turns_graphs_off_and_the_step_still_runs(monkeypatch):
    from infopt.batching import graphs

    model = tiny_model("llama", max_positions=128)
    engine = Engine(model, max_batch_tokens=32, max_seqs=2, kv=Paged(num_blocks=32, block_size=8),
                    cuda_graphs="replay")

    def broken(self, key):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.DecodeGraphs, "_capture", broken)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    out = [o.token_ids for o in engine.generate([[1, 2, 3], [4, 5]], params)]
    stats = engine.metrics()["cuda_graphs"]
    infopt.undo(model)
    plain = _plain(model, [[1, 2, 3], [4, 5]], 4)
    assert out == plain and "capture failed: RuntimeError" in stats["disabled"] and stats["replays"] == 0


def test_recipe_field_checked_model_untouched():
    from infopt.batching import Batching
    from infopt.core.errors import IncompatibleModelError, RecipeError

    from ..conftest import assert_state_equal, state_snapshot

    with pytest.raises(RecipeError, match="cuda_graphs.*allowed: auto, true or false"):
        Batching(cuda_graphs="replay-ish")
    model = tiny_model()
    snap = state_snapshot(model)
    with pytest.raises(IncompatibleModelError, match="cuda_graphs: true needs a model on a CUDA device"):
        infopt.optimize(model, [Batching(num_blocks=16, cuda_graphs=True)])
    assert_state_equal(model, snap)
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__
    infopt.optimize(model, [Batching(num_blocks=16, cuda_graphs=False)])
    from infopt.batching import batching_engine

    assert batching_engine(model).core.graphs is None
    infopt.undo(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_decode_body_reads_nothing_back_while_a_stream_captures(arch, monkeypatch):
    """What a CUDA capture needs, checked on CPU: the forward a decode graph captures, over the buffers, with
    transformers told a stream is capturing (it then skips its own checks) and every read of a tensor's value
    refused. A read (``.item()``, ``.tolist()``, ``bool(t)``) inside would fail the capture on a GPU."""
    import transformers.utils.import_utils as hf_import_utils

    from infopt.attention.paged import set_cpu_kernel

    model = tiny_model(arch, max_positions=128)
    previous = set_cpu_kernel(False)  # the reference kernel: what a GPU without flash-attn runs
    try:
        engine = Engine(model, max_batch_tokens=32, max_seqs=4, kv=Paged(num_blocks=32, block_size=8),
                        cuda_graphs="replay")
        engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))  # allocates the pools
        graphs = engine.core.graphs
        w = graphs.buckets.widths[-1]
        graphs.buffers.stage([], [], [], b=4, w=w)

        def refuse(*a, **kw):
            raise AssertionError("the decode graph's body read a tensor's value back to the host")

        monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)
        for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        with torch.inference_mode():
            out = graphs._body(4, w)
        monkeypatch.undo()
    finally:
        set_cpu_kernel(previous)
        infopt.undo(model)
    assert out.shape[:2] == (1, 4)


def test_capture_every_bucket_up_front_then_serve():
    """``capture()`` (what ``warmup()`` runs on CUDA) takes every bucket, largest first, over an all-padding step that
    writes only the scratch block; serving afterwards captures nothing more and gives ``generate``'s tokens."""
    model = tiny_model("llama", max_positions=1024)
    engine = Engine(model, max_batch_tokens=64, max_seqs=3, kv=Paged(num_blocks=64, block_size=8),
                    cuda_graphs="replay")
    graphs = engine.core.graphs
    with pytest.raises(RuntimeError, match="after the first step has allocated the KV pools"):
        graphs.capture()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1, ignore_eos=True))  # allocates the pools
    pool = engine.cache.pool
    before = [t.clone() for t in pool.keys]
    graphs.capture()
    stats = graphs.stats
    assert stats.captured == ["3x64", "3x32", "2x64", "2x32", "1x64", "1x32"]
    for old, new in zip(before, pool.keys, strict=True):  # only the scratch block was written
        assert torch.equal(old[:pool.num_blocks], new[:pool.num_blocks])
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert stats.captured == ["3x64", "3x32", "2x64", "2x32", "1x64", "1x32"] and stats.replays > 0
    infopt.undo(model)
    plain = _plain(model, prompts, 6)
    assert got == plain
