import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from infopt.core.errors import InfoptError
from infopt.kvcache.blocks import BlockAllocator, BlockStateError, OutOfBlocks, chain_hashes, hash_block


def test_allocate_fork_free_roundtrip():
    a = BlockAllocator(3, 4)
    b = a.allocate()
    assert a.refcount(b) == 1 and a.num_used == 1
    a.fork(b)
    a.free(b)
    assert a.refcount(b) == 1
    a.free(b)
    assert a.num_free == 3 and a.num_used == 0
    a.check_invariants()


def test_out_of_blocks_is_catchable_and_atomic():
    a = BlockAllocator(2, 4)
    a.allocate()
    with pytest.raises(OutOfBlocks) as err:
        a.allocate_many(2)
    assert err.value.needed == 2 and err.value.available == 1
    assert isinstance(err.value, InfoptError)
    assert a.num_free == 1  # nothing taken
    a.allocate()
    with pytest.raises(OutOfBlocks, match="held by running sequences"):
        a.allocate()


@pytest.mark.parametrize("misuse", ["double_free", "fork_free", "bad_id"])
def test_misuse_raises(misuse):
    a = BlockAllocator(2, 4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(BlockStateError):
        if misuse == "double_free":
            a.free(b)
        elif misuse == "fork_free":
            a.fork(b)
        else:
            a.free(7)


def test_copy_on_write():
    a = BlockAllocator(4, 4)
    copies = []
    b = a.allocate()
    assert a.copy_on_write(b, lambda s, d: copies.append((s, d))) == b and not copies  # sole holder writes in place
    a.fork(b)
    new = a.copy_on_write(b, lambda s, d: copies.append((s, d)))
    assert new != b and copies == [(b, new)]
    assert a.refcount(b) == 1 and a.refcount(new) == 1
    a.check_invariants()


def test_prefix_cache_keeps_released_blocks_and_evicts_lru():
    a = BlockAllocator(3, 2)
    h = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    blocks = [a.allocate() for _ in range(3)]
    for hh, b in zip(h, blocks, strict=True):
        assert a.insert(hh, b) == b
    a.free_many(blocks)  # released in order: block 0 is the least recently released
    assert a.num_evictable == 3 and a.num_free == 0
    hit = a.lookup(h[1])
    assert hit == blocks[1] and a.refcount(hit) == 1 and a.num_evictable == 2
    fresh = a.allocate()  # free list empty: evicts the LRU cached block, never the held one
    assert fresh == blocks[0] and not a.contains(h[0]) and a.contains(h[1])
    a.check_invariants()


def test_insert_dedupes_identical_blocks():
    a = BlockAllocator(4, 2)
    h = hash_block(None, [1, 2])
    first, second = a.allocate(), a.allocate()
    assert a.insert(h, first) == first
    assert a.insert(h, second) == first  # the caller's reference moved to the cached block
    assert a.refcount(first) == 2 and a.refcount(second) == 0 and a.num_free == 3
    a.check_invariants()


def test_hash_chains_on_the_prefix():
    same_block_other_prefix = chain_hashes([9, 9, 1, 2], 2)[1]
    assert chain_hashes([5, 5, 1, 2], 2)[1] != same_block_other_prefix
    assert chain_hashes([1, 2, 3], 2) == [hash_block(None, [1, 2])]


@given(st.lists(st.integers(0, 3), max_size=6))
def test_prefix_caching_off_never_caches(tokens):
    a = BlockAllocator(2, 2, prefix_caching=False)
    b = a.allocate()
    for h in chain_hashes(tokens, 2):
        assert a.insert(h, b) == b and a.lookup(h) is None
    a.free(b)
    assert a.num_free == 2 and a.num_cached == 0


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / fork / free / copy-on-write / prefix insert / lookup sequences against a model of holders."""

    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(6, 2)
        self.held: list[int] = []  # one entry per reference a "sequence" holds
        self.prefixes = [h for seq in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8]) for h in chain_hashes(seq, 2)]

    @rule()
    def allocate(self):
        if self.a.num_available == 0:
            try:
                self.a.allocate()
            except OutOfBlocks:
                return
            raise AssertionError("allocate succeeded with nothing available")
        b = self.a.allocate()
        assert b not in self.held, "handed out a block still in use"
        self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        self.held.append(self.a.fork(self.held[i % len(self.held)]))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.a.free(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def write(self, i):
        k = i % len(self.held)
        old = self.held[k]
        try:
            new = self.a.copy_on_write(old, lambda s, d: None)
        except OutOfBlocks:
            return
        if new != old:
            assert new not in self.held
        self.held[k] = new

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def insert(self, i, j):
        k = i % len(self.held)
        self.held[k] = self.a.insert(self.prefixes[j % len(self.prefixes)], self.held[k])

    @rule(j=st.integers(0, 100))
    def lookup(self, j):
        b = self.a.lookup(self.prefixes[j % len(self.prefixes)])
        if b is not None:
            self.held.append(b)

    @rule()
    def double_free_is_refused(self):
        free = [b for b in range(self.a.num_blocks) if self.a.refcount(b) == 0]
        if free:
            try:
                self.a.free(free[0])
            except BlockStateError:
                return
            raise AssertionError("double free accepted")

    @invariant()
    def consistent(self):
        self.a.check_invariants()  # free + held + cached-unreferenced == num_blocks, maps agree
        for b in range(self.a.num_blocks):
            assert self.a.refcount(b) == self.held.count(b)
        assert self.a.num_used == len(set(self.held))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_try_allocate_answers_none_and_takes_nothing():
    a = BlockAllocator(num_blocks=3, block_size=4)
    held = a.try_allocate(2)
    assert held == [0, 1] and a.num_used == 2
    assert a.try_allocate(2) is None and a.num_used == 2 and a.num_free == 1  # nothing taken
    with pytest.raises(OutOfBlocks, match="2 KV blocks needed, 1 available of 3"):
        a.allocate_many(2)


def test_paged_cache_try_begin_step_is_none_and_changes_nothing():
    import torch

    import infopt
    from infopt.kvcache import PagedCache
    from infopt.models import tiny_model

    model = infopt.attention.set_backend_(tiny_model(), "paged")
    cache = PagedCache.for_model(model, num_blocks=3, block_size=4)
    cache.add_sequence("a", list(range(1, 9)))
    cache.add_sequence("b", list(range(1, 9)))
    with torch.no_grad():
        cache.step(model, [("a", list(range(1, 9)))])  # 2 blocks
    before = (cache.seq_len("a"), cache.seq_len("b"), cache.allocator.num_used)
    assert cache.try_begin_step([("b", list(range(1, 9)))]) is None  # needs 2, 1 free
    assert (cache.seq_len("a"), cache.seq_len("b"), cache.allocator.num_used) == before
    with pytest.raises(OutOfBlocks, match="the step needs 2 KV blocks, 1 available of 3"):
        cache.begin_step([("b", list(range(1, 9)))])
    assert cache.try_begin_step([("b", [1, 2, 3])]) is not None  # one block fits
