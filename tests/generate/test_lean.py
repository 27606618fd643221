import pytest
import torch
from transformers import DynamicCache, StaticCache

from infopt.generate import Forward, Unsupported, lean_decode, parse_call
from infopt.models import tiny_model


def greedy_decode(m, call, cache, every=None):
    return lean_decode(call, cache, Forward(m), eos_check_every=every)


def _batch():
    # two left-padded rows and one full row
    ids = torch.tensor([[0, 0, 5, 17, 400, 23], [0, 9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(6)[None] >= torch.tensor([[2], [1], [0]])).long()
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("every", [None, 4], ids=["eos-read-each-token", "eos-read-every-4"])
def test_greedy_matches_generate(arch, cache, every):
    m = tiny_model(arch)
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **kwargs)
    # an EOS the model actually produces mid-way, so rows finish at different steps
    eos = int(ref[0, 6 + 3])
    ref = m.generate(ids, eos_token_id=eos, **kwargs)
    call = parse_call(m, (ids,), dict(eos_token_id=eos, **kwargs))
    c = DynamicCache() if cache == "dynamic" else StaticCache(config=m.config, max_cache_len=32)
    out = greedy_decode(m, call, c, every)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("stop_at", [1, 3, 4, 5, 8, 11])
def test_eos_read_every_k_tokens_ends_where_generate_ends(stop_at):
    # the last row to stop does so before, at or after a read; the loop runs past it and cuts the output back
    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    free = m.generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(free[0, 5 + stop_at - 1])
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos)
    ref = m.generate(ids, **kw)
    for every in (1, 4):
        out = greedy_decode(m, parse_call(m, (ids,), kw), StaticCache(config=m.config, max_cache_len=32), every)
        assert torch.equal(out, ref), every


def test_eos_read_every_k_tokens_reads_the_device_k_times_less(monkeypatch):
    # what the GPU path is for: each read of a device value (bool/int of a tensor) waits for the queued kernels
    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=7)
    reads = {"n": 0}
    for name in ("__bool__", "__int__", "item"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            reads["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = {}
    for every in (1, 8):
        call = parse_call(m, (ids,), kw)
        reads["n"] = 0
        greedy_decode(m, call, StaticCache(config=m.config, max_cache_len=64), every)
        counts[every] = reads["n"]
    assert counts[1] >= 32, counts
    assert counts[8] <= counts[1] - 24, counts


def test_min_new_tokens_and_max_length():
    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    eos = int(m.generate(ids, max_new_tokens=3, do_sample=False)[0, 5])
    for kw in (dict(min_new_tokens=6, max_new_tokens=10), dict(max_length=12)):
        kw = dict(kw, eos_token_id=eos, do_sample=False)
        ref = m.generate(ids, **kw)
        assert torch.equal(greedy_decode(m, parse_call(m, (ids,), kw), DynamicCache()), ref)


@pytest.mark.parametrize("kwargs,reason", [
    ({"num_beams": 2}, "num_beams=2"), ({"assistant_model": object()}, "assistant_model"),
    ({"max_new_tokens": 0}, "no new tokens"), ({"use_cache": False}, "use_cache=False"),
    ({"past_key_values": DynamicCache()}, "past_key_values"),
])
def test_calls_no_infopt_path_serves_are_refused_with_the_reason(kwargs, reason):
    m = tiny_model()
    with pytest.raises(Unsupported, match=reason):
        parse_call(m, (torch.tensor([[1, 2, 3]]),), dict(kwargs))


@pytest.mark.parametrize("kwargs,reason", [
    ({"bad_words_ids": [[7]]}, "bad_words_ids"), ({"output_attentions": True, "return_dict_in_generate": True},
                                                   "output_attentions"),
    ({"logits_processor": []}, "logits_processor"),
])
def test_calls_for_transformers_loop_carry_the_reason(kwargs, reason):
    call = parse_call(tiny_model(), (torch.tensor([[1, 2, 3]]),), dict(kwargs))
    assert reason in call.lean_reason


def test_parse_resolves_lengths_padding_and_sampling_once():
    m = tiny_model()
    ids = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    call = parse_call(m, (), dict(input_ids=ids, attention_mask=mask, max_length=10, do_sample=True, top_p=0.9,
                                  eos_token_id=[7, 8], pad_token_id=None))
    assert (call.max_new_tokens, call.total_length, call.left_pads, call.padded) == (6, 10, (2, 0), True)
    assert (call.top_k, call.top_p, call.eos_token_ids, call.pad_token_id) == (50, 0.9, (7, 8), 7)
    right = parse_call(m, (ids,), dict(attention_mask=mask.flip(1), max_new_tokens=2))
    assert right.left_pads is None and right.padded


def test_streamer_sees_what_generate_shows():
    class Rec:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, v):
            self.seen.append(v.tolist())

        def end(self):
            self.ended = True

    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    a, b = Rec(), Rec()
    ref = m.generate(ids, max_new_tokens=5, do_sample=False, streamer=a)
    out = greedy_decode(m, parse_call(m, (ids,), dict(max_new_tokens=5, do_sample=False, streamer=b)), DynamicCache())
    assert torch.equal(out, ref) and a.seen == b.seen and b.ended


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2},
                                       {"repetition_penalty": 0.7, "no_repeat_ngram_size": 3}],
                         ids=["repetition", "ngram", "both"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_penalties_are_served_by_the_lean_loop_with_generates_tokens(arch, penalties, sample):
    """repetition_penalty and no_repeat_ngram_size run in infopt's loop with transformers' own processors: the tokens
    of generate (a seeded sampled call draws the same), left-padded rows, min_new_tokens and an EOS mid-way included."""
    import infopt
    from infopt.generate import routing_stats
    from infopt.kvcache import Static

    ref, m = tiny_model(arch), tiny_model(arch)
    infopt.optimize(m, [Static(max_length=64)])
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=14, min_new_tokens=3, do_sample=sample, pad_token_id=0,
              **penalties)
    torch.manual_seed(3)
    plain = ref.generate(ids, **kw)
    eos = int(plain[1, 6 + 5])  # a token the model produces mid-way: rows stop at different steps
    for e in (None, eos):
        torch.manual_seed(3)
        want = ref.generate(ids, eos_token_id=e, **kw)
        torch.manual_seed(3)
        assert torch.equal(m.generate(ids, eos_token_id=e, **kw), want)
    assert routing_stats(m).loops == {"lean": 2}
    call = parse_call(m, (ids,), dict(kw))
    assert call.lean_reason is None and call.penalties


def test_the_repetition_penalty_changes_the_lean_loops_tokens():
    """A penalty that changes generate's output changes the lean loop's the same way (not silently dropped)."""
    import infopt
    from infopt.kvcache import Static

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    ids = torch.tensor([[5, 17, 400, 23, 9]])
    plain = m.generate(ids, max_new_tokens=20, do_sample=False)
    penalized = m.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=5.0)
    assert not torch.equal(plain, penalized)
    assert torch.equal(penalized, ref.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=5.0))


def test_stop_strings_end_rows_in_the_lean_loop_as_in_generate(default_tokenizer):
    """stop_strings with the tokenizer: transformers' own StopStringCriteria in infopt's loop; a row that ends in
    one stops and is padded after, as generate does, and the call ends when every row has stopped."""
    import infopt
    from infopt.generate import routing_stats
    from infopt.kvcache import Static

    tok = default_tokenizer
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    free = ref.generate(ids, **kw)
    text = tok.decode(free[0, 6 + 4])  # a token row 0 produces at step 5
    assert text.strip(), text
    for stop in ([text], [text, "zzzz-never"]):
        want = ref.generate(ids, stop_strings=stop, tokenizer=tok, **kw)
        assert want.shape[1] < free.shape[1] or not torch.equal(want, free)  # the stop string acted
        assert torch.equal(m.generate(ids, stop_strings=stop, tokenizer=tok, **kw), want)
    assert routing_stats(m).loops == {"lean": 2}
    with pytest.raises(ValueError):  # without the tokenizer: transformers' own error, as without infopt
        m.generate(ids, stop_strings=[text], **kw)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("fields", [{"output_scores": True}, {"output_logits": True},
                                    {"output_scores": True, "output_logits": True}, {}],
                         ids=["scores", "logits", "both", "sequences-only"])
def test_return_dict_calls_are_served_by_the_lean_loop_as_generate_returns_them(sample, fields):
    """return_dict_in_generate with output_scores / output_logits: generate's GenerateDecoderOnlyOutput from infopt's
    loop (the processed scores: penalty, min_new_tokens mask, warpers; the raw fp32 logits), so asking for scores
    does not move a call off the loop that serves the same call without them (its tokens stay those)."""
    import infopt
    from infopt.generate import routing_stats
    from infopt.kvcache import Static

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=2, do_sample=sample, pad_token_id=0,
              repetition_penalty=1.2, return_dict_in_generate=True, **fields)
    torch.manual_seed(1)
    eos = int(ref.generate(ids, **kw).sequences[2, 6 + 4])  # rows stop at different steps
    torch.manual_seed(1)
    want = ref.generate(ids, eos_token_id=eos, **kw)
    torch.manual_seed(1)
    out = m.generate(ids, eos_token_id=eos, **kw)
    assert type(out) is type(want) and torch.equal(out.sequences, want.sequences)
    for name in ("scores", "logits"):
        a, b = getattr(out, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert len(a) == len(b) == want.sequences.shape[1] - 6
            assert all(torch.allclose(x, y, atol=1e-5, rtol=0) for x, y in zip(a, b, strict=True)), name
    assert out.attentions is None and out.hidden_states is None
    torch.manual_seed(1)
    assert torch.equal(m.generate(ids, eos_token_id=eos, **{k: v for k, v in kw.items() if k not in (
        "return_dict_in_generate", *fields)}), want.sequences)
    assert routing_stats(m).loops == {"lean": 2}


def test_output_fields_count_only_with_return_dict_in_generate():
    """output_scores without return_dict_in_generate: generate returns the tokens alone, so the call asks nothing
    of a loop beyond them (a speculative model still drafts it)."""
    m, ids = tiny_model(), torch.tensor([[1, 2, 3]])
    assert parse_call(m, (ids,), {"output_scores": True}).outputs == frozenset()
    assert parse_call(m, (ids,), {"output_scores": True, "return_dict_in_generate": True}).outputs == {
        "output_scores", "return_dict_in_generate"}
