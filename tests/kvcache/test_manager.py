"""KVBlockManager: the pure-Python half of the paged cache (block tables, prefix reuse, step allocation)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import infopt
from infopt.kvcache.blocks import BlockAllocator
from infopt.kvcache.manager import KVBlockManager


def _kv(num_blocks=4, block_size=4, prefix_caching=True):
    return KVBlockManager(BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching), block_size)


def test_allocate_answers_none_and_changes_nothing_when_the_pool_is_short():
    kv = _kv()
    kv.add_sequence("a", [1, 2, 3])
    kv.add_sequence("b", [4, 5])
    assert kv.allocate([("a", [1, 2, 3]), ("b", [4, 5])]) == [0, 0]
    kv.complete(["a", "b"])
    before = (kv.block_table("a"), kv.block_table("b"), kv.seq_len("a"), kv.allocator.num_available)
    assert kv.allocate([("a", list(range(10))), ("b", [6])]) is None  # a needs 3 more blocks, 2 are left
    assert (kv.block_table("a"), kv.block_table("b"), kv.seq_len("a"), kv.allocator.num_available) == before
    assert kv.allocate([("a", [9]), ("b", [6])]) == [3, 2]


def test_completed_full_blocks_are_reused_by_a_later_sequence_and_abort_rolls_back():
    kv = _kv(8, 4)
    kv.add_sequence("a", list(range(10)))
    kv.allocate([("a", list(range(10)))])
    kv.complete(["a"])
    kv.release("a")
    assert kv.add_sequence("b", list(range(10)) + [99]) == 8  # two full blocks found in the prefix cache
    start = kv.allocate([("b", [8, 9, 99])])
    assert start == [8] and kv.seq_len("b") == 11
    kv.abort(["b"])
    assert kv.seq_len("b") == 8 and len(kv.block_table("b")) == 2
    kv.allocator.check_invariants()


@pytest.mark.parametrize("entries,error", [([], ValueError), ([("a", [1]), ("a", [2])], ValueError),
                                            ([("a", [])], ValueError), ([("zz", [1])], KeyError)])
def test_misuse_is_an_error_not_a_none(entries, error):
    kv = _kv()
    kv.add_sequence("a", [1])
    with pytest.raises(error):
        kv.allocate(entries)


def test_the_scheduler_and_the_manager_import_no_torch():
    """The bookkeeping boundary: scheduling and block management are plain Python (the layout is the cache's)."""
    src = Path(infopt.__file__).parent
    for rel in ("batching/scheduler.py", "kvcache/manager.py", "kvcache/blocks.py", "batching/params.py"):
        tree = ast.parse((src / rel).read_text())
        runtime = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]  # not under TYPE_CHECKING
        names = [a.name for n in runtime if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in runtime if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] == "torch"], (rel, names)


def test_packed_and_padded_adapters_refuse_each_others_calls():
    """One pool and block manager, two transformers-Cache adapters: packed engine steps (PagedCache) and one
    padded generate call (PaddedPagedCache); each refuses the other's API with a clear error."""
    import torch

    from infopt.attention import set_backend_
    from infopt.kvcache.blocks import BlockStateError
    from infopt.kvcache.paged_cache import PaddedPagedCache, PagedCache
    from infopt.models import tiny_model

    model = set_backend_(tiny_model(), "paged")
    packed = PagedCache.for_model(model, num_blocks=16)
    padded = PaddedPagedCache(packed.pool, config=model.config)
    padded.start_padded([[1, 2, 3], [4, 5]], [0, 1], max_new_tokens=2)
    assert padded.get_seq_length() == 0 and padded.blocks.seq_len(0) == 0
    with pytest.raises(BlockStateError, match="padded generate call"):
        padded.try_begin_step([(0, [1, 2, 3])])
    with pytest.raises(NotImplementedError, match="truncate"):
        packed.crop(1)
    with pytest.raises(BlockStateError, match="begin_step"):
        packed.update(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), 0)
    padded.finish_padded(None)
    assert packed.allocator.num_used == 0
