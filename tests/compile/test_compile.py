import warnings

import pytest
import torch

import infopt
from infopt.compile import Compile, compile_stats, warmup
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.generate import decoder_for, routing_stats
from infopt.kvcache import Static
from infopt.models import tiny_model


def test_compile_requires_static_cache(llama):
    with pytest.raises(RecipeError, match="requires kvcache:static"):
        infopt.optimize(llama, [Compile()])


def test_reduce_overhead_needs_cuda(llama):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    with pytest.raises(IncompatibleModelError, match="CUDA graphs"):
        infopt.optimize(llama, [Static(max_length=64), Compile(mode="reduce-overhead")])
    assert decoder_for(llama) is None and "generate" not in llama.__dict__
    assert all(torch.equal(v, before[k]) for k, v in llama.state_dict().items())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"mode": "fast"}, "mode"), ({"backend": "tvm"}, "backend"), ({"fullgraph": "yes"}, "fullgraph"),
     ({"warmup_lengths": (0,)}, "warmup_lengths"), ({"warmup_batch_sizes": [1]}, "warmup_batch_sizes")],
)
def test_bad_fields(kwargs, match):
    with pytest.raises(RecipeError, match=match):
        Compile(**kwargs)


def test_recipe_spelling_and_lists():
    r = infopt.Recipe.parse({"steps": [{"kvcache": {"kind": "static"}},
                                       {"compile": {"mode": "max-autotune", "warmup_lengths": [256, 512]}}]})
    c = r.steps[-1]
    assert isinstance(c, Compile) and c.mode == "max-autotune" and c.warmup_lengths == (256, 512)


def test_warmup_lengths_capped_at_static_max_length(llama):
    infopt.optimize(llama, [Static(max_length=64), Compile(backend="eager", warmup_lengths=(40, 512))])
    assert compile_stats(llama).shapes == ["batch 1, cache 64, unpadded"]  # both calls land in the one 64 bucket


def test_warmup_batch_must_match_fixed_batch(llama):
    with pytest.raises(IncompatibleModelError, match="batch_size=2"):
        infopt.optimize(llama, [Static(max_length=64, batch_size=2), Compile(backend="eager")])
    assert decoder_for(llama) is None


@pytest.mark.slow
def test_auto_warmup_with_speculative_drafts_at_batch_1_and_decodes_batches_on_their_warmed_graph():
    """``warmup_batch_sizes="auto"`` beside speculative decoding warms the verify widths for batch 1 and the one-token
    step for every batch of 2-32: a batch of rows decodes token by token on that graph (no eager verify, no compile),
    a single row drafts; both keep plain generate's greedy tokens. Listing batch 2 warms its widths, and batches
    draft again."""
    from infopt.speculative import SelfDraft, stats

    ref = tiny_model()
    batch = torch.randint(3, 1000, (3, 7))
    kw = dict(attention_mask=torch.ones_like(batch), max_new_tokens=10, do_sample=False)
    for sizes, batch_loop in (("auto", "lean"), ((1, 2), "speculative")):
        m = tiny_model()
        infopt.optimize(m, [Static(max_length=256), Compile(warmup_batch_sizes=sizes),
                            SelfDraft(quantize="int8", num_tokens=3)])
        cs = compile_stats(m)
        assert "any batch 2-32, any cache length, padded" in cs.shapes
        assert any(s.startswith("any batch 2-32, 4 tokens") for s in cs.shapes) == (sizes != "auto"), cs.shapes
        fwd = decoder_for(m).forward_for()
        assert fwd.drafts(1) and fwd.drafts(3) == (sizes != "auto") and fwd.drafts(32) == fwd.drafts(3)
        assert torch.equal(m.generate(batch, **kw), ref.generate(batch, **kw))
        p = _prompts()[0]
        assert torch.equal(m.generate(p, max_new_tokens=10, do_sample=False),
                           ref.generate(p, max_new_tokens=10, do_sample=False))
        assert routing_stats(m).loops == ({"lean": 1, "speculative": 1} if batch_loop == "lean"
                                          else {"speculative": 2}), routing_stats(m).loops
        assert cs.compiles_after_warmup == 0 and not cs.cold_shapes and cs.eager_calls == 0, cs.as_dict()
        assert stats(m)["rounds"] > 0


def test_warmup_needs_compile_step(llama):
    with pytest.raises(ValueError, match="no compile step"):
        warmup(llama)


@pytest.mark.slow
def test_compile_with_speculative_verifies_and_drafts_through_compiled_graphs():
    """compile + static + speculative: the verify widths and the draft model's steps run compiled graphs (one per
    token bucket, the narrowest verify graph 4 tokens wide), warmed while the recipe is applied; greedy output stays
    plain generate's."""
    from infopt.speculative import SelfDraft, stats

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(backend="eager"), SelfDraft(quantize="int8", num_tokens=3)])
    cs = compile_stats(m)
    assert cs.warmed_up and any("4 tokens" in s for s in cs.shapes), cs.shapes  # verify: pending + 3 drafts
    assert routing_stats(m).infopt == 0  # warm-up calls are not user calls
    calls = cs.calls
    for p in _prompts():
        assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                           ref.generate(p, max_new_tokens=20, do_sample=False))
    assert cs.calls > calls and cs.compiles_after_warmup == 0 and cs.eager_calls == 0
    assert cs.compiles == len(cs.shapes), cs.shapes  # one graph per shape: the warm-up matches the loops' strides
    assert stats(m)["rounds"] > 0 and routing_stats(m).loops == {"speculative": 3}
    # the warm-up timed each verify width and the draft's step; the calls' draft-length choice reads them
    from infopt.speculative.api import _round_costs

    dec = decoder_for(m)
    fwd = dec.forward_for()
    widths = sorted(w for (b, w, n) in fwd.timings if b == 1 and n == 256)
    assert widths == [1, 4] and all(t > 0 for t in fwd.timings.values())  # no 2-token graph: MIN_VERIFY_WIDTH
    assert fwd.width(2) == fwd.width(3) == 4 and fwd.width(1) == 1
    assert fwd.step_seconds(1, 2, 256) == fwd.step_seconds(1, 3, 256) == fwd.timings[(1, 4, 256)]
    draft = dec.forward_for(dec.speculative.drafter.draft)
    assert sorted(w for (b, w, n) in draft.timings) == [1, 2] and draft.width(2) == 2  # its catch-up keeps 2 tokens
    draft_cost, verify = _round_costs(fwd, dec, dec.speculative.drafter, 1, 256, 3)
    one = fwd.timings[(1, 1, 256)]
    assert verify == [1.0] + [fwd.step_seconds(1, k + 1, 256) / one for k in (1, 2, 3)]
    assert draft_cost == dec.forward_for(dec.speculative.drafter.draft).timings[(1, 1, 256)] / one
    assert _round_costs(fwd, dec, dec.speculative.drafter, 1, None, 3) == (dec.speculative.drafter.draft_cost, None)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (1, n), generator=g) for n in (5, 11, 17)]


@pytest.mark.slow
def test_inductor_decode_token_identical_counts_and_undo():
    """The real thing: inductor compiles the decode step once at apply time, keeping the cache length symbolic;
    calls in any 256-token bucket never compile again and stay token-identical to plain generate."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile()])
    stats = compile_stats(m)
    assert stats.compiles == 1 and stats.warmed_up and stats.shapes == ["batch 1, any cache length, unpadded"]
    assert "1 graph(s)" in " ".join(m.infopt.steps[-1].notes)
    for p in _prompts():
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))
    assert stats.compiles_after_warmup == 0 and stats.calls >= 3 * 11
    assert routing_stats(m).infopt == 3 and routing_stats(m).loops == {"lean": 3}  # the warm-up is not a user call

    long = torch.randint(3, 1000, (1, 250))  # 250 + 12 tokens: the 512 bucket, served by the warm-up's graph
    assert torch.equal(m.generate(long, max_new_tokens=12, do_sample=False),
                       ref.generate(long, max_new_tokens=12, do_sample=False))
    assert decoder_for(m).cache.allocation().length == 512
    assert stats.compiles == 1 and stats.compiles_after_warmup == 0 and not stats.eager_shapes

    infopt.undo(m)
    assert decoder_for(m) is None and compile_stats(m) is None
    assert torch.equal(m.generate(_prompts()[0], max_new_tokens=5, do_sample=False),
                       ref.generate(_prompts()[0], max_new_tokens=5, do_sample=False))


def test_one_inductor_graph_serves_every_batch_from_two_rows(caplog):
    """Traced at two rows, the guard-free step keeps the batch symbolic as it keeps the cache length: batches of 2, 3
    and 5, padded or not, in the 256 and 512 buckets, run one graph (equal-length rows go through it on a mask of
    ones), token-identical to plain generate, with no compile after the warm-up (``warmup_batch_sizes="auto"``
    compiles it); 33 rows, past FREE_BATCH, would need a graph of their own: on a CPU that call decodes eagerly
    rather than wait for a compiler, and says so."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(warmup_batch_sizes="auto")])
    stats = compile_stats(m)
    assert stats.compiles == 2 and stats.shapes == ["batch 1, any cache length, unpadded",
                                                    "any batch 2-32, any cache length, padded"]
    g = torch.Generator().manual_seed(0)
    for rows, length, pad in ((3, 6, 2), (5, 9, 0), (2, 260, 3)):
        ids = torch.randint(3, 1000, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :pad] = 0
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw)), (rows, length, pad)
    assert decoder_for(m).cache.allocation().length == 512
    assert stats.compiles == 2 and stats.compiles_after_warmup == 0 and not stats.eager_shapes
    ids = torch.randint(3, 1000, (33, 4), generator=g)  # past FREE_BATCH: a graph of its own batch, any length
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    with caplog.at_level("WARNING", logger="infopt.compile"):
        assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    # (all-ones mask: unpadded; only a batch a free graph serves is routed through the padded one)
    assert stats.cold_shapes == ["batch 33, any cache length, unpadded"] and stats.cold_eager_calls == 2
    assert stats.compiles == 2 and stats.compiles_after_warmup == 0
    said = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    assert len(said) == 1 and "batch 33" in said[0] and "cold_shapes='compile'" in said[0]


@pytest.mark.slow
def test_a_capped_last_bucket_is_warmed_too():
    """A ``max_length`` that is no multiple of 256 caps the last cache bucket at a length one graph cannot share with
    the whole buckets: the warm-up compiles it as well, so a call that reaches it neither compiles nor runs eagerly."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=300), Compile()])
    stats = compile_stats(m)
    assert stats.shapes == ["batch 1, any cache length, unpadded", "batch 1, cache 300, unpadded"], stats.shapes
    ids = torch.randint(3, 1000, (1, 280))
    assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False),
                       ref.generate(ids, max_new_tokens=8, do_sample=False))
    assert decoder_for(m).cache.allocation().length == 300
    assert stats.compiles == 2 and stats.compiles_after_warmup == 0 and not stats.cold_shapes


def test_cold_shapes_compile_makes_the_call_wait_for_its_graph():
    """``cold_shapes="compile"``: a shape the warm-up left out compiles on first use (the call waits), and later calls
    of it run the graph."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(backend="aot_eager", cold_shapes="compile")])
    ids = torch.randint(3, 1000, (3, 5))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    stats = compile_stats(m)
    assert stats.compiles_after_warmup == 1 and not stats.cold_shapes and stats.cold_eager_calls == 0
    calls = stats.calls
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    assert stats.calls == calls + 3 and stats.compiles_after_warmup == 1


def test_cold_shapes_run_eagerly_on_a_cpu_by_default_and_explicit_warmups_still_compile():
    """By default on a CPU a shape the warm-up left out decodes eagerly, token-identical, no compile; an explicit
    :func:`warmup` of that shape afterwards compiles it, and the next call runs the graph."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(backend="aot_eager")])
    assert Compile().cold_shapes == "auto" and decoder_for(m).forward_for(m).cold_eager
    ids = torch.randint(3, 1000, (1, 300))  # the 512 bucket: guarded graphs are one per bucket
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    stats = compile_stats(m)
    assert stats.cold_shapes == ["batch 1, cache 512, unpadded"] and stats.cold_eager_calls == 3
    assert stats.compiles == 1 and stats.compiles_after_warmup == 0
    warmup(m, lengths=(300,))
    assert stats.compiles == 2
    calls = stats.calls
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    assert stats.calls == calls + 3 and stats.cold_eager_calls == 3


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_padded_batches_token_identical(backend):
    """Left-padded batches decode through the step with a fixed-width mask, as generate does."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(backend=backend, warmup_batch_sizes=(2,),
                                                        cold_shapes="compile")])
    ids = torch.tensor([[0, 0, 0, 7, 8, 9], [4, 5, 6, 7, 8, 9]])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    stats = compile_stats(m)
    assert stats.shapes == ["batch 2, cache 256, unpadded", "batch 2, cache 256, padded"]
    assert stats.compiles_after_warmup == 1  # the padded graph was not warmed


@pytest.mark.slow
def test_warmup_function_covers_padded_and_lengths():
    m = tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(backend="eager", warmup_lengths=())])
    stats = compile_stats(m)
    assert stats.compiles == 0 and not stats.warmed_up
    warmup(m, batch_sizes=(1, 2), lengths=(100, 300), padded=True)
    assert stats.compiles == 8 and stats.warmed_up  # backend eager: guarded graphs, one per cache bucket
    assert "batch 2, cache 512, padded" in stats.shapes
    ids = torch.randint(3, 1000, (2, 280))
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert stats.compiles_after_warmup == 0


def test_sampling_calls_decode_through_the_compiled_step():
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64), Compile(backend="aot_eager")])
    calls = compile_stats(m).calls
    p, kw = torch.tensor([[1, 2, 3]]), dict(max_new_tokens=6, do_sample=True, top_k=5, temperature=0.8)
    torch.manual_seed(0)
    out = m.generate(p, **kw)
    torch.manual_seed(0)
    assert torch.equal(out, ref.generate(p, **kw))
    assert compile_stats(m).calls == calls + 5 and compile_stats(m).compiles_after_warmup == 0


def test_fast_mode_token_identical_on_the_device(device):
    """The device's fast compile mode (reduce-overhead, CUDA graphs, on CUDA; inductor's default on CPU) decodes
    plain generate's greedy tokens, with no compile after the warm-up."""
    from tests.devices import DEVICES

    ref = tiny_model().to(device)
    m = tiny_model().to(device)
    infopt.optimize(m, [Static(max_length=256), Compile(mode=DEVICES[device].decode_compile_mode)])
    for p in _prompts():
        p = p.to(device)
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))
    assert compile_stats(m).compiles_after_warmup == 0


def test_inference_mode_calls_reuse_the_warmed_graph():
    """Dynamo guards on global state: a call under the caller's inference_mode must not need a second graph."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64), Compile(backend="eager")])
    p = _prompts()[1]
    with torch.inference_mode():
        out = m.generate(p, max_new_tokens=8, do_sample=False)
    assert not out.is_inference()  # the static cache and the output stay ordinary tensors
    assert torch.equal(out, ref.generate(p, max_new_tokens=8, do_sample=False))
    assert compile_stats(m).compiles_after_warmup == 0
    m.generate(p, max_new_tokens=8, do_sample=False)  # and the cache it allocated is reusable outside


def test_inductor_without_a_cxx_compiler_is_refused_untouched(llama, monkeypatch):
    import infopt.compile.step as cs

    monkeypatch.setattr(cs, "_cxx_compiler", lambda: None)
    with pytest.raises(IncompatibleModelError, match="C\\+\\+ compiler"):
        infopt.optimize(llama, [Static(max_length=64), Compile()])
    assert decoder_for(llama) is None and "generate" not in llama.__dict__
    infopt.optimize(llama, [Static(max_length=64), Compile(backend="eager")])  # eager needs none


def test_without_a_cxx_compiler_a_compile_step_beside_batching_is_not_refused(llama, monkeypatch):
    # the engine's compiled step falls back to eager steps with a warning where compiling fails
    # (tests/batching/test_engine_compile.py), as the throughput preset did before it had a compile step
    import infopt.compile.step as cs
    from infopt.batching import Batching
    from infopt.core.introspect import inspect_model

    monkeypatch.setattr(cs, "_cxx_compiler", lambda: None)
    info = inspect_model(llama)
    assert Compile().check(llama, info, [Compile(), Batching()]) == []
    with pytest.raises(IncompatibleModelError, match="C\\+\\+ compiler"):
        Compile().check(llama, info, [Static(), Compile()])


@pytest.mark.slow
def test_compiled_models_do_not_add_up_against_one_recompile_limit():
    """Each compiled model's graphs sit on a code object of their own: dynamo's process-wide
    ``accumulated_recompile_limit`` (256 graphs per code object) is not shared by every model a process compiles.
    Sharing it sent a test session's later models (and would send a notebook's) to eager steps."""
    ref = tiny_model()
    p = _prompts()[1]
    want = ref.generate(p, max_new_tokens=6, do_sample=False)
    with torch._dynamo.config.patch(accumulated_recompile_limit=3):
        _compile_three_models(p, want)


def _compile_three_models(p, want):
    for _ in range(3):  # 3 models x 2 shapes (the prompt's prefill runs eagerly; decode 1 token and verify)
        m = tiny_model()
        infopt.optimize(m, [Static(max_length=128), Compile(backend="eager", warmup_lengths=())])
        warmup(m, batch_sizes=(1, 2), lengths=(100,), padded=False)
        stats = compile_stats(m)
        assert stats.compiles == 2 and not stats.eager_shapes, stats.eager_shapes
        assert torch.equal(m.generate(p, max_new_tokens=6, do_sample=False), want)


def test_isolated_compile_copies_keep_one_cache_per_copy():
    import infopt.compile.decoder as dec

    counts = {"a": 0, "b": 0}

    def counting(name):
        def backend(gm, example_inputs):
            counts[name] += 1
            return gm.forward
        return backend

    def f(x):
        return x * 2 + 1

    fa = dec.isolated_compile(f, name="f_a", backend=counting("a"))
    fb = dec.isolated_compile(f, name="f_b", backend=counting("b"))
    x = torch.ones(3)
    assert torch.equal(fa(x), f(x)) and torch.equal(fb(x), f(x))
    fa(x), fb(x)
    assert counts == {"a": 1, "b": 1}  # each copy compiled once and reused its own graph


def _graph_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)


@pytest.mark.gpu
def test_gpu_fast_preset_replays_cuda_graphs():
    """gpu-fast decodes through CUDA graphs: each decode token is a graph replay (cudaGraphLaunch in the
    profiler), no graph compiles after the warm-up, and greedy output equals plain generate (fp32)."""
    ref, m = tiny_model().cuda(), tiny_model().cuda()
    infopt.optimize(m, "gpu-fast")
    p = _prompts()[1].cuda()
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    m.generate(p, **kw)  # cudagraph trees record on the first calls, replay after
    out = []
    launches = _graph_launches(lambda: out.append(m.generate(p, **kw)))
    assert launches >= 20, launches  # 23 decode steps; each one graph replay
    assert torch.equal(out[0], ref.generate(p, **kw))
    assert compile_stats(m).compiles_after_warmup == 0


def _default_prompts(tok, device):
    for q in ("What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child."):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        yield tok(text, return_tensors="pt").input_ids.to(device)


@pytest.mark.gpu
@pytest.mark.real_model
def test_gpu_fast_default_model_fp32_token_identical():
    """The lossless claim on CUDA: gpu-fast on the default model in fp32 (TF32 off) is greedy token-identical to
    plain fp32 generate, and decodes through CUDA graph replays."""
    from infopt.models import load_default

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref, tok = load_default(dtype=torch.float32, device="cuda")
        m, _ = load_default(dtype=torch.float32, device="cuda")
        infopt.optimize(m, "gpu-fast")
        kw = dict(max_new_tokens=64, do_sample=False)
        for ids in _default_prompts(tok, "cuda"):
            assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
        assert _graph_launches(lambda: m.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)) >= 12
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.real_model
def test_gpu_fast_default_model_bf16_decode_within_transformers_own_rounding():
    """In bf16, gpu-fast's fused kernels and the static cache's masked attention round differently from plain
    decoding's kernels, so greedy outputs can part at near-ties (the H200 run: from token 11 on some prompts, while
    transformers' own static cache parted near token 55). The claim measured instead: teacher-forced along plain
    generate's tokens, gpu-fast's decode logits differ from plain decoding's no more than transformers' own two
    paths do (a whole-sequence forward against decoding), in KL and top-1 agreement."""
    from infopt.eval import decode_path_logits, logit_metrics
    from infopt.models import load_default

    ref, tok = load_default(dtype=torch.bfloat16, device="cuda")
    m, _ = load_default(dtype=torch.bfloat16, device="cuda")
    infopt.optimize(m, "gpu-fast")
    plain, fast, prefill = [], [], []
    for ids in _default_prompts(tok, "cuda"):
        out = ref.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        plain.append(decode_path_logits(ref, ids, out[0, ids.shape[1]:]))
        fast.append(decode_path_logits(m, ids, out[0, ids.shape[1]:]))
        with torch.no_grad():
            prefill.append(ref(out[:, :-1]).logits[0, ids.shape[1] - 1:].float())
    plain, fast, prefill = torch.cat(plain), torch.cat(fast), torch.cat(prefill)

    got, noise = logit_metrics(fast, plain), logit_metrics(prefill, plain)  # KL(plain || ...), top-1 against plain
    assert got["kl"] <= 2 * noise["kl"] + 1e-4, (got, noise)
    assert got["top1"] >= min(noise["top1"], 0.99) - 0.02, (got, noise)


def test_sliding_window_model_holds_one_graph_per_shape():
    """gemma3 (sliding-window layers, one KV head): the static cache holds its sliding layers at full length (the
    mask applies the window), so the decode step compiles once per shape and holds, past the window too."""
    ref, m = tiny_model("gemma3", num_kv_heads=1), tiny_model("gemma3", num_kv_heads=1)
    assert m.config.sliding_window == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no shape falls back to eager
        infopt.optimize(m, [Static(max_length=512), Compile(backend="eager")])
        for p in (*_prompts(), torch.randint(3, 1000, (1, 90))):  # the last runs past the 64-token window
            assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                               ref.generate(p, max_new_tokens=20, do_sample=False))
    stats = compile_stats(m)
    assert stats.compiles == len(stats.shapes) and not stats.eager_shapes and stats.eager_calls == 0


def test_a_graph_that_cannot_hold_falls_back_to_eager_with_one_warning(monkeypatch):
    """A decode step that recompiles every token (here: transformers' own sliding-window static layers, which guard
    on a Python int that changes every token, as gemma3 did before infopt held them at full length) under a tiny
    dynamo recompile limit: fullgraph=True would turn the limit into a hard error inside the user's call. Instead
    each such shape runs eagerly, the call succeeds with plain generate's tokens, and the model warns once."""
    from transformers import StaticCache

    import infopt.kvcache.static as static

    monkeypatch.setattr(static, "full_length_static_cache",
                        lambda config, length, **_: StaticCache(config=config, max_cache_len=length))
    ref, m = tiny_model("gemma3", num_kv_heads=1), tiny_model("gemma3", num_kv_heads=1)
    batch2 = torch.randint(3, 1000, (2, 12))
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infopt.optimize(m, [Static(max_length=512), Compile(backend="eager", cold_shapes="compile")])
        for p in (*_prompts(), batch2):  # two shapes: batch 1 and batch 2
            assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                               ref.generate(p, max_new_tokens=12, do_sample=False))
    held = [w for w in caught if "could not hold a compiled graph" in str(w.message)]
    assert len(held) == 1 and held[0].category is RuntimeWarning
    stats = compile_stats(m)
    assert len(stats.eager_shapes) == 2 and stats.eager_calls >= 3 * 11
    assert all("recompile limit" in why for why in stats.eager_shapes.values())


@pytest.mark.slow
def test_a_shape_that_recompiles_past_its_budget_runs_eagerly(monkeypatch):
    """Under dynamo's default limit, infopt stops a shape after its second graph (MAX_GRAPHS_PER_SHAPE) rather than
    compiling every token up to the limit."""
    from transformers import StaticCache

    import infopt.kvcache.static as static

    monkeypatch.setattr(static, "full_length_static_cache",
                        lambda config, length, **_: StaticCache(config=config, max_cache_len=length))
    ref, m = tiny_model("gemma3"), tiny_model("gemma3")
    with pytest.warns(RuntimeWarning, match="could not hold a compiled graph") as caught:
        infopt.optimize(m, [Static(max_length=512), Compile(backend="eager")])
        p = _prompts()[0]
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))
    assert sum("could not hold" in str(w.message) for w in caught) == 1
    stats = compile_stats(m)
    assert stats.compiles == 2
    assert list(stats.eager_shapes.values()) == ["_GraphNotHeld: the decode step recompiled 2 times for one shape"]


def test_every_cold_shape_compile_is_announced_the_remedy_once(caplog):
    """Each compile a call waits for after the warm-up is a stall the user sees: each is logged, the first with how
    to avoid it (warm those shapes up)."""
    m = tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(backend="eager", cold_shapes="compile")])
    with caplog.at_level("WARNING", logger="infopt.compile"):
        m.generate(torch.randint(3, 1000, (1, 300)), max_new_tokens=3, do_sample=False)  # the 512 bucket: cold
        m.generate(torch.randint(3, 1000, (2, 20)), max_new_tokens=3, do_sample=False)  # batch 2: cold too
        m.generate(torch.randint(3, 1000, (2, 20)), max_new_tokens=3, do_sample=False)  # warm now: nothing said
    cold = [r.getMessage() for r in caplog.records if "the warm-up did not cover" in r.getMessage()]
    assert len(cold) == 2
    assert "batch 1, cache 512, unpadded" in cold[0] and "warmup_batch_sizes" in cold[0]
    assert "batch 2, cache 256, unpadded" in cold[1] and "warmup_batch_sizes" not in cold[1]
    assert compile_stats(m).compiles_after_warmup == 2


def test_compile_static_and_sampling_draw_generates_tokens_for_a_seed():
    """Sampling calls decode through the compiled step too, drawing the same tokens as plain generate."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(backend="eager")])
    calls = compile_stats(m).calls
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)
    for p in _prompts():
        torch.manual_seed(5)
        a = ref.generate(p, **kw)
        torch.manual_seed(5)
        assert torch.equal(m.generate(p, **kw), a)
    assert compile_stats(m).calls >= calls + 3 * 11 and routing_stats(m).loops == {"lean": 3}


def test_a_data_dependent_trace_falls_back_to_eager_with_one_warning(monkeypatch):
    """A decode step dynamo cannot trace for a reason that is not one of its own exceptions (a data-dependent shape
    raises GuardOnDataDependentSymNode, a RuntimeError) still never fails the call: that shape runs eagerly, with
    one warning, and the tokens are the eager step's. Here: MoE experts traced through their per-expert loop, which
    infopt.quantize.experts normally hides from dynamo in one custom op."""
    from infopt.quantize import Int4WeightOnly
    from infopt.quantize.experts import QuantizedExperts

    monkeypatch.setattr(QuantizedExperts, "forward", QuantizedExperts._dispatch)
    ref, m = tiny_model("mixtral"), tiny_model("mixtral")
    infopt.optimize(ref, [Int4WeightOnly(group_size=32)])
    with pytest.warns(RuntimeWarning, match="could not hold a compiled graph") as caught:
        infopt.optimize(m, [Int4WeightOnly(group_size=32), Static(max_length=256), Compile(backend="eager")])
        for p in _prompts():
            assert torch.equal(m.generate(p, max_new_tokens=10, do_sample=False),
                               ref.generate(p, max_new_tokens=10, do_sample=False))
    assert sum("could not hold" in str(w.message) for w in caught) == 1
    stats = compile_stats(m)
    assert stats.calls == 0 and stats.eager_calls >= 3 * 9
    assert "DataDependent" in next(iter(stats.eager_shapes.values()))


@pytest.mark.slow
@pytest.mark.parametrize("guards", ["per_call", "per_token"])
def test_a_change_dynamo_module_guards_would_catch_is_caught_once_per_call(guards):
    # module_guards="per_call" skips dynamo's per-token guards on the modules; the check before each call's prompt
    # must still see a hook added (or a training flag flipped) after the step was compiled
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default", module_guards=guards)])
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    compiles = compile_stats(m).compiles

    def push_seven(module, args, out):
        out = out.clone()
        out[..., 7] += 1e4
        return out

    handle = m.lm_head.register_forward_hook(push_seven)
    out = m.generate(ids, **kw)
    assert out[0, 5:].tolist() == [7] * 8  # the prompt's token and every compiled decode step
    if guards == "per_call":  # infopt's check dropped the graphs: compiled again for the hooked model
        assert compile_stats(m).compiles > compiles
    handle.remove()
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.slow
def test_saving_a_compiled_model_keeps_its_compiled_steps(tmp_path):
    # save_pretrained writes config.architectures and turns config.dtype into a string on the live config: neither
    # changes a forward, so the next call must not drop the steps and compile inside the user's generate
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default")])
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    compiles = compile_stats(m).compiles
    m.save_pretrained(tmp_path / "saved")
    assert m.config.architectures == ["LlamaForCausalLM"]  # (what the save changed)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    stats = compile_stats(m)
    assert stats.compiles == compiles and stats.compiles_after_warmup == 0, stats.as_dict()


def test_module_guards_bad_value():
    with pytest.raises(RecipeError, match="module_guards"):
        Compile(module_guards="never")


@pytest.mark.parametrize("guards", ["per_call", "per_token"])
def test_cpu_steps_drop_inductors_size_asserts_only_with_the_per_call_check(guards, monkeypatch):
    """The per-call module check (with the op contracts in test_op_contracts.py) stands in for Inductor's per-call
    size asserts on CPU; dynamo's per-token guards keep them, and so does a TORCHINDUCTOR_SIZE_ASSERTS setting."""
    from infopt.compile import decoder

    seen = []
    real = decoder.step_options

    def spy(config, device):
        seen.append(real(config, device))
        return seen[-1]

    monkeypatch.setattr(decoder, "step_options", spy)
    monkeypatch.delenv("TORCHINDUCTOR_SIZE_ASSERTS", raising=False)
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default", module_guards=guards)])
    assert seen and all(p.get("size_asserts", True) is (guards == "per_token") for p in seen)
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))

    monkeypatch.setenv("TORCHINDUCTOR_SIZE_ASSERTS", "0")
    assert "size_asserts" not in real(Compile(module_guards="per_call"), torch.device("cpu"))
    monkeypatch.delenv("TORCHINDUCTOR_SIZE_ASSERTS")
    assert "size_asserts" not in real(Compile(module_guards="per_call"), torch.device("cuda"))


@pytest.mark.slow
def test_cpu_steps_run_guard_free_and_move_to_guards_for_a_cache_they_were_not_compiled_for():
    """On CPU each decode shape is compiled ahead of time without dynamo's guards (GuardFreeStep); a call that
    brings a cache whose tensors differ from those it was compiled for (here the same values in another memory
    layout) is compiled again with guards, and gives the eager step's logits."""
    import copy

    from infopt.compile.guard_free import GuardFreeStep

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default", warmup_batch_sizes=(2,), warmup_lengths=(64,),
                                                        pack_linears=False)])
    dec = decoder_for(m)
    fwd = dec.forward_for(m)
    (key, step), = fwd._fns.items()
    assert isinstance(step, GuardFreeStep) and step.fn is not None and key[0] == 2
    assert compile_stats(m).compiles == 1
    ids = torch.tensor([[1, 17, 400, 23, 9], [4, 8, 15, 16, 23]])
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    assert fwd._fns[key] is step and compile_stats(m).compiles == 1

    with torch.no_grad():
        cache = dec.cache.cache_for(m, 2, key[2])
        tok, pos = torch.tensor([[5], [7]]), torch.tensor([[1], [1]])
        fwd.prefill(tok, torch.zeros_like(tok), None, cache)
        odd, plain = copy.deepcopy(cache), copy.deepcopy(cache)
        for layer in odd.layers:  # [B, H, L, D] views of [B, L, H, D] storage
            layer.keys = layer.keys.transpose(1, 2).contiguous().transpose(1, 2)
            layer.values = layer.values.transpose(1, 2).contiguous().transpose(1, 2)
        got = fwd.step(tok, pos, torch.tensor([1]), None, odd, first=1)
        want = fwd._forward(tok, pos, torch.tensor([1]), None, plain)
    torch.testing.assert_close(got, want)
    assert not isinstance(fwd._fns[key], GuardFreeStep) and compile_stats(m).compiles == 2


def test_a_guard_free_step_steps_aside_under_autocast_and_grad(monkeypatch):
    """Dynamo would compile another graph under autocast or with grad enabled; the guard-free step hands such
    calls to a guarded compile of its shape."""
    from infopt.compile.guard_free import GuardFreeStep

    m = tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default", warmup_lengths=(64,), pack_linears=False)])
    dec = decoder_for(m)
    fwd = dec.forward_for(m)
    (key, step), = fwd._fns.items()
    assert isinstance(step, GuardFreeStep) and step.fn is not None
    handed = []
    monkeypatch.setattr(fwd, "_guarded", lambda k: (lambda *a: handed.append(k) or "guarded"))
    cache = dec.cache.cache_for(m, key[0], key[2])
    tok = torch.ones(key[0], 1, dtype=torch.long)
    args = (tok, tok.clone(), torch.tensor([1]), None, cache)
    with torch.no_grad():
        assert isinstance(step(*args), torch.Tensor) and not handed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert step(*args) == "guarded"
    with torch.enable_grad():
        assert step(*args) == "guarded"
    assert handed == [key, key]


@pytest.mark.slow
def test_a_step_that_fixes_the_cache_length_compiles_a_graph_per_bucket(monkeypatch):
    """A step that branches on the cache length fixes it in its graph: the guards kept on the step's arguments send
    the next bucket to a recompile instead of the graph traced for 256 slots, which the step answers with one graph
    per bucket from then on: the tokens stay the plain model's and nothing falls back to eager."""
    from infopt.compile.decoder import CompiledForward

    plain = CompiledForward._forward

    def branching(self, input_ids, position_ids, cache_position, attention_mask, cache):
        out = plain(self, input_ids, position_ids, cache_position, attention_mask, cache)
        return out + 1.0 if cache.layers[0].keys.shape[2] == 256 else out  # a shift greedy decoding cannot see

    monkeypatch.setattr(CompiledForward, "_forward", branching)
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(cold_shapes="compile")])
    stats = compile_stats(m)
    assert stats.shapes == ["batch 1, any cache length, unpadded"]
    for n in (250, 5):  # the 512 bucket, then the 256 one again
        ids = torch.randint(3, 1000, (1, n))
        assert torch.equal(m.generate(ids, max_new_tokens=12, do_sample=False),
                           ref.generate(ids, max_new_tokens=12, do_sample=False))
    assert not decoder_for(m).forward_for(m).free_length
    assert "batch 1, cache 512, unpadded" in stats.shapes and "batch 1, cache 256, unpadded" in stats.shapes
    assert not stats.eager_shapes and stats.eager_calls == 0
