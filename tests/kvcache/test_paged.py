import pytest
import torch

import infopt
from infopt.attention import PAGED_IMPL, set_backend_
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.generate import routing_stats
from infopt.kvcache import OutOfBlocks, Paged, PagedCache, paged_pool, use_, use_paged_
from infopt.models import tiny_model
from infopt.recipe import Recipe

SYSTEM = [(7 * i + 3) % 3000 + 10 for i in range(40)]  # a 40-token shared "system prompt"


def padded(rows, pad=0):
    """Left-padded ``(input_ids, attention_mask)`` of token lists."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def count_tokens(model):
    """Count tokens through the input embedding (what the model really ran on)."""
    seen = []
    emb = model.get_input_embeddings()
    handle = emb.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel()))
    return seen, handle


@pytest.mark.parametrize("arch, block_size", [("llama", 4), ("llama", 16), ("qwen2", 16), ("gemma", 4), ("gpt2", 16)],
                         ids=["llama-bs4", "llama-bs16", "qwen2-bs16", "gemma-bs4", "gpt2-bs16"])
def test_greedy_token_identical_left_padded(arch, block_size):
    m = tiny_model(arch)
    ids, mask = padded([[1, 5, 9, 300, 7, 2000, 11], [4, 4, 8, 15, 16, 23, 42, 108, 3, 9, 17, 33], [77, 78]])
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    use_paged_(m, Paged(block_size=block_size))
    out = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    for row in range(3):  # each prompt alone, the second time with its prefix cached
        alone = ids[row:row + 1, mask[row].argmax():]
        ref1 = ref[row:row + 1, mask[row].argmax():]
        assert torch.equal(m.generate(alone, max_new_tokens=32, do_sample=False), ref1)
    assert routing_stats(m).infopt == 4 and routing_stats(m).original == 0


@pytest.mark.parametrize("arch, device", [("llama", "cpu"), ("qwen2", "cpu"), ("gemma", "cpu"),
                                          pytest.param("llama", "cuda", marks=pytest.mark.gpu)])
def test_prefix_hit_runs_only_the_suffix(arch, device):
    m = tiny_model(arch).to(device)
    first = torch.tensor([SYSTEM + [101, 102, 103]], device=device)
    second = torch.tensor([SYSTEM + [201, 202, 203, 204, 205]], device=device)
    ref1 = m.generate(first, max_new_tokens=32, do_sample=False)
    ref2 = m.generate(second, max_new_tokens=32, do_sample=False)
    use_paged_(m, Paged(block_size=16))
    seen, h = count_tokens(m)
    try:
        assert torch.equal(m.generate(first, max_new_tokens=32, do_sample=False), ref1)
        cold = list(seen)
        seen.clear()
        assert torch.equal(m.generate(second, max_new_tokens=32, do_sample=False), ref2)
        warm = list(seen)
    finally:
        h.remove()
    assert cold[0] == first.shape[1]  # no prefix cached yet: the whole prompt runs
    assert warm[0] == second.shape[1] - 32  # two full 16-token blocks of the system prompt were reused
    assert sum(warm) == sum(cold) - 32 + 2  # then one token per decode step, as before
    assert paged_pool(m).allocator.hits >= 2


def test_batch_with_prefix_hits_and_padding():
    m = tiny_model("llama")
    rows = [SYSTEM + [5, 6], SYSTEM[:20] + [9], SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    ids, mask = padded(rows)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    use_paged_(m, Paged(block_size=8))
    warm_up = torch.tensor([SYSTEM + [100]])
    m.generate(warm_up, max_new_tokens=2, do_sample=False)  # caches the system prompt's full blocks
    seen, h = count_tokens(m)
    try:
        out = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    finally:
        h.remove()
    assert torch.equal(out, ref)
    # every row hits, but the cached columns are the minimum over rows of padding + cached tokens: the unpadded
    # row has 40 (5 blocks); the others then reuse a partial block (copy-on-write) and recompute past column 40
    assert ids.shape[1] == 51 and seen[0] == 3 * (51 - 40)


def test_multi_turn_reuses_the_answer():
    m = tiny_model("llama")
    turn1 = torch.tensor([SYSTEM])
    use_paged_(m, Paged(block_size=8))
    out1 = m.generate(turn1, max_new_tokens=24, do_sample=False)
    turn2 = torch.cat([out1, torch.tensor([[11, 12, 13]])], dim=1)  # the answer is part of the next prompt
    seen, h = count_tokens(m)
    try:
        m.generate(turn2, max_new_tokens=4, do_sample=False)
    finally:
        h.remove()
    assert seen[0] == turn2.shape[1] - 56  # 7 blocks of prompt + answer (63 tokens stored) were cached


def test_blocks_released_after_each_call(llama, prompt):
    use_paged_(llama, Paged(block_size=4))
    pool = None
    for _ in range(3):
        llama.generate(prompt, max_new_tokens=9, do_sample=False)
        pool = paged_pool(llama)
        a = pool.allocator
        a.check_invariants()
        assert a.num_used == 0  # nothing held once generate returned
        assert a.num_evictable == a.num_cached == 3  # 15 tokens stored: 3 full blocks stay as prefix cache
    assert pool.num_blocks == 4  # auto-sized: the call needs 4 blocks, repeated calls reuse them


def test_blocks_released_when_generate_fails(llama, prompt):
    use_paged_(llama, Paged(block_size=4))

    def boom(*a, **k):
        raise RuntimeError("boom")

    h = llama.lm_head.register_forward_hook(lambda *a: boom())
    with pytest.raises(RuntimeError, match="boom"):
        llama.generate(prompt, max_new_tokens=5, do_sample=False)
    h.remove()
    a = paged_pool(llama).allocator
    assert a.num_used == 0 and a.num_cached == 0  # the failed forward's blocks were not cached
    a.check_invariants()


def test_fixed_pool_too_small_falls_back(llama, prompt):
    ref = llama.generate(prompt, max_new_tokens=20, do_sample=False)
    use_paged_(llama, Paged(block_size=4, num_blocks=3))
    assert torch.equal(llama.generate(prompt, max_new_tokens=20, do_sample=False), ref)
    stats = routing_stats(llama)
    assert stats.original == 1 and any("pool too small" in r for r in stats.reasons)
    assert paged_pool(llama).allocator.num_used == 0


def test_fixed_pool_evicts_cached_prefixes(llama):
    """Evicting cached prefixes changes no output: each call's logits are plain generate's, and so are those of a
    prompt asked again after its blocks were evicted and reused by others (a stale block would show here: the tiny
    model's greedy tokens barely depend on the context, its logits do), which runs its whole prompt again, while the
    latest prompt's blocks still serve its repeat."""
    prompts = {start: torch.tensor([list(range(start, start + 15))]) for start in (100, 200, 300)}
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def same(out, want):
        return torch.equal(out.sequences, want.sequences) and all(
            torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(out.logits, want.logits, strict=True))

    ref = {start: llama.generate(p, **kw) for start, p in prompts.items()}
    use_paged_(llama, Paged(block_size=4, num_blocks=6))
    for start, p in prompts.items():  # each call caches 4 blocks; a 6-block pool must evict older ones
        assert same(llama.generate(p, **kw), ref[start]), start
    a = paged_pool(llama).allocator
    assert a.evictions > 0 and a.num_used == 0
    a.check_invariants()
    seen, h = count_tokens(llama)
    try:
        again = {start: llama.generate(prompts[start], **kw) for start in (300, 100)}
    finally:
        h.remove()
    assert all(same(again[start], ref[start]) for start in again)
    # the last prompt's blocks are still cached: its 3 full prompt blocks (12 tokens) are reused, 3 tokens run; the
    # first prompt's blocks were evicted: all 15 of its tokens run again
    assert (seen[0], seen[4]) == (3, 15), seen
    assert routing_stats(llama).original == 0  # every call ran on the paged cache
    a.check_invariants()


def test_unsupported_calls_fall_back(llama, prompt):
    ref_beam = llama.generate(prompt, max_new_tokens=5, num_beams=2, do_sample=False)
    ids, mask = padded([[5, 6, 7], [8, 9]])
    mask_right = mask.flip(1)  # right padding
    ref_right = llama.generate(ids.flip(1), attention_mask=mask_right, max_new_tokens=3, do_sample=False)
    use_paged_(llama, Paged())
    assert torch.equal(llama.generate(prompt, max_new_tokens=5, num_beams=2, do_sample=False), ref_beam)
    assert torch.equal(llama.generate(ids.flip(1), attention_mask=mask_right, max_new_tokens=3, do_sample=False),
                       ref_right)
    stats = routing_stats(llama)
    assert stats.original == 2 and any("left padding" in r for r in stats.reasons)


def test_sampling_is_served(llama, prompt):
    torch.manual_seed(0)
    ref = llama.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5)
    use_paged_(llama, Paged())
    torch.manual_seed(0)
    assert torch.equal(llama.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5), ref)
    assert routing_stats(llama).infopt == 1


def test_generate_under_inference_mode_then_outside(llama, prompt):
    use_paged_(llama, Paged())
    with torch.inference_mode():
        a = llama.generate(prompt, max_new_tokens=6, do_sample=False)
    b = llama.generate(prompt, max_new_tokens=6, do_sample=False)  # the pool must stay writable
    assert torch.equal(a, b)


def test_kvcache_use_dispatches_and_switches_backend(llama, prompt):
    ref = llama.generate(prompt, max_new_tokens=8, do_sample=False)
    use_(llama, Paged())
    assert llama.config._attn_implementation == PAGED_IMPL
    assert "generate" in llama.__dict__
    assert torch.equal(llama.generate(prompt, max_new_tokens=8, do_sample=False), ref)
    infopt.undo(llama)
    assert llama.config._attn_implementation == "sdpa"
    assert "generate" not in llama.__dict__ and paged_pool(llama) is None
    assert torch.equal(llama.generate(prompt, max_new_tokens=8, do_sample=False), ref)


def test_recipe_spelling_through_optimize(prompt):
    m = tiny_model("llama")
    ref = m.generate(prompt, max_new_tokens=8, do_sample=False)
    recipe = {"steps": [{"kvcache": {"kind": "paged", "block_size": 16}}, {"attention": {"backend": "paged"}}]}
    assert Recipe.parse(recipe).describe() == "attention -> kvcache:paged"
    infopt.optimize(m, recipe)
    assert torch.equal(m.generate(prompt, max_new_tokens=8, do_sample=False), ref)
    notes = " ".join(n for s in m.infopt.steps for n in s.notes)
    assert "16-token blocks" in notes and "switched" not in notes  # the attention step already chose paged
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_paged_alone_in_a_recipe_notes_the_switch(prompt):
    m = infopt.optimize(tiny_model("llama"), {"kvcache": {"kind": "paged"}})
    assert m.config._attn_implementation == PAGED_IMPL
    assert any("switched sdpa -> paged" in n for n in m.infopt.steps[0].notes)


@pytest.mark.parametrize("fields, match", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_blocks": -3}, "num_blocks"),
    ({"num_blocks": 2.5}, "num_blocks"),
    ({"prefix_caching": "yes"}, "prefix_caching"),
    ({"blocks": 4}, "no field"),
], ids=["bs0", "bs-bool", "nb-neg", "nb-float", "prefix-str", "unknown"])
def test_bad_fields_refused_before_mutation(fields, match):
    m = tiny_model("llama")
    with pytest.raises(RecipeError, match=match):
        infopt.optimize(m, {"kvcache": {"kind": "paged", **fields}})
    assert m.config._attn_implementation == "sdpa" and "generate" not in m.__dict__


@pytest.mark.parametrize("other, match", [
    ({"attention": {"backend": "sdpa"}}, "paged attention kernel"),
    ({"compile": {"mode": "default"}}, "block tables"),
])
def test_conflicting_recipes_refused(other, match):
    m = tiny_model("llama")
    with pytest.raises(RecipeError, match=match):
        infopt.optimize(m, [{"kvcache": {"kind": "paged"}}, other])
    assert m.config._attn_implementation == "sdpa" and "generate" not in m.__dict__


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "reference"])
def test_sliding_window_model_token_identical_past_the_window(cpu_kernel):
    """gemma3 (window 64): each sliding layer's query sees the last 64 keys of its sequence, as in plain generate,
    for a prompt and a left-padded batch running past the window, on either CPU kernel."""
    from infopt.attention.paged import set_cpu_kernel

    ref, m = tiny_model("gemma3"), tiny_model("gemma3")
    infopt.optimize(m, [Paged()])
    g = torch.Generator().manual_seed(0)
    one = torch.randint(3, 1000, (1, 90), generator=g)
    two = torch.randint(3, 1000, (2, 80), generator=g)
    mask = torch.ones_like(two)
    mask[0, :5] = 0
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=2)
    previous = set_cpu_kernel(cpu_kernel)
    try:
        assert torch.equal(m.generate(one, **kw), ref.generate(one, **kw))
        assert torch.equal(m.generate(two, attention_mask=mask, **kw), ref.generate(two, attention_mask=mask, **kw))
    finally:
        set_cpu_kernel(previous)


# -- the packed step API (what a batching engine drives) -------------------------------------------
def _alone_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_packed_step_matches_each_sequence_alone(arch):
    m = tiny_model(arch)
    seqs = {"a": list(range(5, 28)), "b": [7, 8, 9], "c": list(range(100, 141))}
    full = {k: v + [3, 4] for k, v in seqs.items()}  # two decode tokens after each prompt
    ref = {k: _alone_logits(m, v) for k, v in full.items()}
    set_backend_(m, "paged")
    cache = PagedCache.for_model(m, num_blocks=64, block_size=4)
    for k in seqs:
        assert cache.add_sequence(k) == 0
    with torch.no_grad():
        # step 1: three prefills of different lengths (c chunked); step 2: a finishes prefill, c continues;
        # steps 3-4: decode tokens, with c's last chunk mixed in
        l1 = cache.step(m, [("a", seqs["a"][:10]), ("b", seqs["b"]), ("c", seqs["c"][:7])])
        l2 = cache.step(m, [("c", seqs["c"][7:30]), ("a", seqs["a"][10:]), ("b", [3])])
        l3 = cache.step(m, [("b", [4]), ("a", [3]), ("c", seqs["c"][30:])])
        l4 = cache.step(m, [("a", [4]), ("c", [3])])
        l5 = cache.step(m, [("c", [4])])
    pairs = [(l1[0], ref["a"][9]), (l1[1], ref["b"][2]), (l1[2], ref["c"][6]), (l2[0], ref["c"][29]),
             (l2[1], ref["a"][22]), (l2[2], ref["b"][3]), (l3[0], ref["b"][4]), (l3[1], ref["a"][23]),
             (l3[2], ref["c"][40]), (l4[0], ref["a"][24]), (l4[1], ref["c"][41]), (l5[0], ref["c"][42])]
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert [cache.seq_len(k) for k in "abc"] == [25, 5, 43]


def test_packed_batch_layout():
    m = set_backend_(tiny_model("llama"), "paged")
    cache = PagedCache.for_model(m, num_blocks=8, block_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    batch = cache.begin_step([(0, [5, 6, 7]), (1, [8, 9])])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.logits_indices.tolist() == [2, 4] and batch.new_tokens == [3, 2]
    with torch.no_grad():
        out = m(input_ids=batch.input_ids, position_ids=batch.position_ids, past_key_values=cache,
                logits_to_keep=batch.logits_indices)
    cache.end_step()
    assert out.logits.shape[:2] == (1, 2)
    with pytest.raises(Exception, match="begin_step"):
        with torch.no_grad():
            m(input_ids=batch.input_ids, position_ids=batch.position_ids, past_key_values=cache)


def test_packed_prefix_cache_and_release():
    m = set_backend_(tiny_model("llama"), "paged")
    cache = PagedCache.for_model(m, num_blocks=16, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    cache.add_sequence("x", prompt)
    with torch.no_grad():
        ref = cache.step(m, [("x", prompt)])
    cache.release("x")
    assert cache.allocator.num_used == 0 and cache.allocator.num_evictable == 3
    assert cache.add_sequence("y", prompt) == 12  # 3 cached blocks; the last token is left to compute
    with torch.no_grad():
        got = cache.step(m, [("y", prompt[12:])])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_fork_copies_on_write():
    m = set_backend_(tiny_model("llama"), "paged")
    cache = PagedCache.for_model(m, num_blocks=16, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10]
    cache.add_sequence("p", prompt)
    with torch.no_grad():
        cache.step(m, [("p", prompt)])
        cache.fork_sequence("p", "q")
        shared = cache.block_table("p")
        assert cache.block_table("q") == shared and cache.allocator.refcount(shared[-1]) == 2
        lp, lq = cache.step(m, [("p", [11]), ("q", [12])])  # both write into the shared last block
    assert cache.block_table("p")[0] == cache.block_table("q")[0]  # the full first block stays shared
    assert cache.block_table("p")[1] != cache.block_table("q")[1]  # the partial one was copied
    torch.testing.assert_close(lp, _alone_logits(m, prompt + [11])[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(lq, _alone_logits(m, prompt + [12])[-1], atol=1e-5, rtol=0)
    cache.allocator.check_invariants()


def test_out_of_blocks_leaves_the_cache_unchanged():
    m = set_backend_(tiny_model("llama"), "paged")
    cache = PagedCache.for_model(m, num_blocks=3, block_size=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    with pytest.raises(OutOfBlocks) as err:
        cache.begin_step([("a", list(range(8))), ("b", list(range(8)))])
    assert err.value.needed == 4 and err.value.available == 3
    assert cache.seq_len("a") == cache.seq_len("b") == 0 and cache.allocator.num_used == 0
    with torch.no_grad():
        cache.step(m, [("a", list(range(8)))])  # the engine preempts b and carries on
    assert cache.seq_len("a") == 8


def test_memory_stats():
    m = set_backend_(tiny_model("llama"), "paged")  # 2 layers, 2 kv heads x 16 dims, fp32
    cache = PagedCache.for_model(m, num_blocks=10, block_size=4)
    cache.add_sequence("a")
    with torch.no_grad():
        cache.step(m, [("a", [1, 2, 3, 4, 5, 6])])
    s = cache.memory_stats()
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K,V x layers x slots x heads x dims x bytes
    assert s["block_bytes"] == block_bytes and s["bytes_allocated"] == 10 * block_bytes
    assert s["blocks_used"] == 2 and s["bytes_used"] == 2 * block_bytes
    assert s["utilization"] == pytest.approx(6 / 8) and s["tokens"] == 6


def test_backend_switched_away_is_refused():
    m = tiny_model("llama")
    cache = PagedCache.for_model(m, num_blocks=4)
    cache.add_sequence(0)
    with pytest.raises(IncompatibleModelError, match="set_backend_"):
        cache.begin_step([(0, [1, 2])])
