"""infopt.eval: strided perplexity, KL/top-1 against a reference, reference caching, exact-token checks, CLI."""

from __future__ import annotations

import copy
import doctest
import inspect
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import infopt
from infopt import eval as ev
from infopt.core.errors import IncompatibleModelError
from infopt.eval.windows import window_layout
from infopt.models import tiny_model

TEXT = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
        "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. ") * 12


@pytest.fixture(scope="module")
def tok():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


def perturbed(model, scale=0.5, seed=1):
    """A copy with Gaussian noise added to one weight matrix."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    w = m.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape, generator=g) * scale)
    return m


def without_time(result):
    d = result.to_dict()
    d.pop("seconds")
    return d


# -- KL / top-1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("same_object", [True, False], ids=["same-object", "deepcopy"])
def test_model_against_itself_is_exactly_zero(base, tok, same_object):
    ref = base if same_object else copy.deepcopy(base)
    r = ev.evaluate(base, ref, TEXT, tokenizer=tok, max_tokens=300, window=128, stride=64)
    assert r.windows > 1
    assert r.kl == 0.0 and r.kl_max == 0.0 and r.top1 == 1.0
    assert r.ppl == r.ppl_ref and r.ppl_ratio == 1.0


def test_perturbed_copy_has_positive_kl_and_lower_top1(base, tok):
    r = ev.evaluate(perturbed(base), base, TEXT, tokenizer=tok, max_tokens=300, window=128, stride=64)
    assert r.kl > 0 and r.kl_max >= r.kl and r.top1 < 1.0
    assert 0 <= r.kl_max_pos < r.tokens
    assert isinstance(r.kl_max_context, str) and r.kl_max_context
    assert r.ppl != r.ppl_ref


def test_kl_matches_a_direct_full_computation(base, tok):
    # one window: evaluate's chunked sums equal logit_metrics on full [1, T, V] tensors
    m2 = perturbed(base)
    ids = ev.encode_text(TEXT, tok, max_tokens=200)
    with torch.no_grad():
        full = ev.logit_metrics(m2(ids).logits, base(ids).logits, ids)
    r = ev.evaluate(m2, base, TEXT, tokenizer=tok, max_tokens=200)
    assert r.windows == 1
    for k in ("kl", "kl_max", "top1", "ppl", "ppl_ref"):
        assert getattr(r, k) == pytest.approx(full[k], rel=1e-4), k


def test_kl_of_logits_equal_up_to_rounding_is_never_negative():
    # the sum p * (log p - log q) over a vocabulary, in fp32, goes below 0 at positions whose logits differ by rounding
    # only (a lossless recipe's): figures print 0 there, as evaluate's windows do, never a negative KL
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 64, 4096, generator=g) * 4
    out = ref + 1e-6 * torch.randn(ref.shape, generator=g)
    raw = (F.softmax(ref, -1) * (F.log_softmax(ref, -1) - F.log_softmax(out, -1))).sum(-1)
    assert (raw < 0).any()  # the case the clamp is for
    fig = ev.logit_metrics(out, ref)
    assert 0.0 <= fig["kl"] < 1e-6 and 0.0 <= fig["kl_max"] < 1e-5 and fig["top1"] == 1.0


# -- strided perplexity -----------------------------------------------------------------------

def direct_ppl(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return float(F.cross_entropy(logits, ids[0, 1:]).exp())


def test_window_covering_everything_equals_full_forward(base, tok):
    ids = ev.encode_text(TEXT, tok, max_tokens=400)
    r = ev.evaluate(base, None, TEXT, tokenizer=tok, max_tokens=400)  # window = context 512 >= 400 tokens
    assert (r.windows, r.window, r.tokens) == (1, 400, 400)
    assert r.ppl == pytest.approx(direct_ppl(base, ids), rel=1e-4)
    assert r.reference is None and r.kl is None and r.ppl_ratio is None


def test_strided_matches_an_explicit_window_loop(base, tok):
    # text longer than one window: 400 tokens, windows of 128 every 48; an independent loop with plain forwards
    ids = ev.encode_text(TEXT, tok, max_tokens=400)
    window, stride = 128, 48
    nll, n, done, begin = 0.0, 0, 0, 0
    with torch.no_grad():
        while True:
            end = min(begin + window, 400)
            lp = F.log_softmax(base(ids[:, begin:end]).logits[0].double(), -1)  # [end-begin, V]
            for p in range(done, end):
                if p + 1 < 400:
                    nll -= float(lp[p - begin, ids[0, p + 1]])
                    n += 1
            if end == 400:
                break
            done, begin = end, begin + stride
    r = ev.evaluate(base, None, TEXT, tokenizer=tok, max_tokens=400, window=window, stride=stride)
    assert r.windows == 7 and n == 399
    assert r.ppl == pytest.approx(float(torch.tensor(nll / n).exp()), rel=1e-4)
    # a window holding everything gives the full-context figure, which differs from the strided one
    assert ev.evaluate(base, None, TEXT, tokenizer=tok, max_tokens=400).ppl != r.ppl


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), window=st.integers(1, 64), data=st.data())
def test_window_layout_scores_each_position_once_with_enough_context(n, window, data):
    stride = data.draw(st.integers(1, window))
    layout = window_layout(n, window, stride)
    scored = [p for w in layout for p in range(w.first, w.end)]
    assert scored == list(range(n))
    for w in layout:
        assert w.end - w.begin <= window and w.begin <= w.first < w.end
        if w.first > 0:
            assert w.first - w.begin >= window - stride  # context before the first scored position


# -- stored references ------------------------------------------------------------------------

def test_stored_reference_self_kl_is_zero_and_close_to_exact(base, tok):
    m2 = perturbed(base)
    exact = ev.evaluate(m2, base, TEXT, tokenizer=tok, max_tokens=300, window=128, stride=64)
    ref = ev.make_reference(base, TEXT, tokenizer=tok, max_tokens=300, window=128, stride=64)
    assert ref.logits.dtype == torch.float16 and ref.logits.shape == (1, 300, 49152)
    own = ev.evaluate(base, ref)
    assert own.kl == 0.0 and own.top1 == 1.0 and own.ppl == own.ppl_ref
    r = ev.evaluate(m2, ref)
    assert (r.windows, r.window, r.stride) == (exact.windows, 128, 64)
    assert r.kl == pytest.approx(exact.kl, rel=1e-3)
    assert r.ppl_ref == exact.ppl_ref and r.ppl == exact.ppl  # both exact fp32
    assert ev.compare(m2, ref)["kl"] == r.kl


def test_save_load_round_trip_gives_identical_metrics(base, tok, tmp_path):
    m2 = perturbed(base)
    ref = ev.make_reference(base, TEXT, tokenizer=tok, max_tokens=260, window=128, stride=96)
    path = ev.save_reference(ref, tmp_path / "sub" / "ref.safetensors")
    back = ev.load_reference(path)
    assert torch.equal(back.logits, ref.logits) and torch.equal(back.input_ids, ref.input_ids)
    assert (back.window, back.stride, back.meta) == (ref.window, ref.stride, ref.meta)
    a = without_time(ev.evaluate(m2, ref))
    assert without_time(ev.evaluate(m2, back)) == a
    assert without_time(ev.evaluate(m2, str(path))) == a  # a path works too
    head = ev.reference_meta(path)
    assert head["meta"]["max_tokens"] == 260 and head["tokens"] == 260 and head["dtype"] == "float16"
    assert len(head["meta"]["text_sha256"]) == 64 and head["meta"]["tokenizer"]


def test_legacy_reference_logits_round_trip(base, tok, tmp_path):
    ref = ev.reference_logits(base, TEXT, tok, max_tokens=100)
    back = ev.load_reference(ev.save_reference(ref, tmp_path / "r.safetensors"))
    assert back.window is None and back.logits.dtype == torch.float32
    assert ev.compare(perturbed(base), back) == ev.compare(perturbed(base), ref)


def test_reference_for_computes_once_then_loads(base, tok, tmp_path, monkeypatch):
    path = tmp_path / "ref.safetensors"
    a = ev.reference_for(base, path, TEXT, tokenizer=tok, max_tokens=150)
    m = copy.deepcopy(base)
    infopt.optimize(m, [infopt.quantize.Int8WeightOnly()])
    from infopt.eval import quality

    def no_build(*args, **kwargs):
        raise AssertionError("recomputed although the cache matches")

    monkeypatch.setattr(quality, "_build", no_build)
    b = ev.reference_for(m, path, TEXT, tokenizer=tok, max_tokens=150)  # optimized model: loads, never computes
    assert torch.equal(a.logits, b.logits) and a.meta == b.meta
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"max_tokens \(150 != 120\)"):
        c = ev.reference_for(base, path, TEXT, tokenizer=tok, max_tokens=120)
    assert c.tokens == 120 and ev.load_reference(path).tokens == 120
    with pytest.warns(UserWarning, match="text_sha256"), pytest.raises(IncompatibleModelError, match="already optimized"):
        ev.reference_for(m, path, "other text " * 30, tokenizer=tok, max_tokens=120)


def test_non_reference_file_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not an infopt reference"):
        ev.load_reference(tmp_path / "x.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        ev.reference_meta(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        ev.load_reference(tmp_path / "missing.safetensors")


# -- the existing API and the gate ------------------------------------------------------------

def test_compare_and_gate_keep_working(base, tok):
    ref = ev.reference_logits(base, TEXT, tok, max_tokens=128)
    assert ev.compare(base, ref)["kl"] == 0.0
    figs = ev.compare(perturbed(base), ref)
    assert set(figs) == {"kl", "kl_max", "top1", "ppl", "ppl_ref", "tokens"} and figs["kl"] > 0
    r = ev.evaluate(perturbed(base), ref)
    assert r.kl == figs["kl"] and r.top1 == figs["top1"]
    assert ev.gate_failures(r.to_dict(), {"max_kl": 0.0})[0].startswith("KL ")
    assert ev.gate_failures(r.to_dict(), {"max_kl": 10.0, "max_ppl_ratio": 10.0}) == []


def test_optimize_gate_still_measures_through_eval():
    # infopt.optimize's gate calls reference_logits/compare/gate_failures; int8 on a random model misses a zero limit
    m = tiny_model("llama")
    infopt.optimize(m, [infopt.attention.Attention("eager")], gate={"max_kl": 1e-6, "min_top1": 0.999})
    assert m.infopt.gate["kl"] < 1e-6 and m.infopt.gate["tokens"] == 512
    infopt.undo(m)
    with pytest.raises(infopt.QualityGateError, match="KL .* > max_kl 0.0"):
        infopt.optimize(m, [infopt.quantize.Int8WeightOnly()], gate={"max_kl": 0.0})
    infopt.undo(m)


def test_optimize_gate_holds_along_the_decode_path_too(monkeypatch):
    # the whole-sequence forward compare() runs is the prompt path; a decode step that computes otherwise (here the
    # static cache's step with its logits nudged, as a step compiled another way might) misses max_kl through the
    # decode-path figures, which the report keeps beside the others
    from infopt.generate import Forward, decoder_for
    from infopt.kvcache import Static

    m = tiny_model("llama")
    infopt.optimize(m, [Static()], gate={"max_kl": 1e-6, "min_top1": 0.999})
    path = m.infopt.gate["decode_path"]
    assert path["kl"] < 1e-6 and path["top1"] == 1.0 and path["tokens"] == ev.DECODE_PATH_TOKENS
    assert "decode_path.kl=" in str(m.infopt) and "decode_path.tokens=32" in str(m.infopt)
    infopt.undo(m)

    step = Forward.step

    def nudged(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        return out + torch.linspace(0, 4, out.shape[-1]) if decoder_for(self.model) is not None else out

    monkeypatch.setattr(Forward, "step", nudged)
    with pytest.raises(infopt.QualityGateError, match=r"decode-path KL \S+ > max_kl 0.001") as e:
        infopt.optimize(m, [Static()], gate={"max_kl": 1e-3})
    assert e.value.figures["kl"] < 1e-6 and e.value.figures["decode_path"]["kl"] > 1e-3  # the prompt path passed
    infopt.undo(m)
    monkeypatch.undo()
    # a static cache too short for the 16 + 32 tokens: the stretch its decode path serves (16 + 16), and none at all
    infopt.optimize(m, [Static(max_length=32)], gate={"max_kl": 1e-6})
    assert m.infopt.gate["decode_path"]["tokens"] == 16 and m.infopt.gate["decode_path"]["kl"] < 1e-6
    infopt.undo(m)
    infopt.optimize(m, [Static(max_length=16)], gate={"max_kl": 1e-6})
    assert m.infopt.gate["decode_path"] == {"tokens": 0} and "decode_path.tokens=0" in str(m.infopt)
    infopt.undo(m)
    # a gate without max_kl or min_top1 does not run the decode path
    infopt.optimize(m, [Static()], gate={"max_ppl_ratio": 1.01})
    assert "decode_path" not in m.infopt.gate
    infopt.undo(m)


def test_text_from_file_and_path(base, tok, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    a = ev.evaluate(base, text=TEXT, tokenizer=tok, max_tokens=64)
    assert ev.evaluate(base, text=f, tokenizer=tok, max_tokens=64).ppl == a.ppl
    assert ev.evaluate(base, text=str(f), tokenizer=tok, max_tokens=64).ppl == a.ppl
    assert ev.resolve_text(None) == ev.default_text()


# -- bad inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"text": ""}, "empty"),
        ({"text": "   \n "}, "empty"),
        ({"max_tokens": 0}, "max_tokens=0 must be a positive integer"),
        ({"max_tokens": -5}, "max_tokens=-5"),
        ({"stride": 0}, "stride=0 must be a positive integer"),
        ({"window": 0}, "window=0"),
        ({"window": 32, "stride": 64}, "stride=64 is larger than the window"),
        ({"window": 4096}, "exceeds the model's context"),
        ({"text": "x"}, "at least 2 tokens"),
    ],
    ids=["empty-text", "blank-text", "max-tokens-0", "max-tokens-neg", "stride-0", "window-0", "stride-gt-window",
         "window-gt-context", "one-token"],
)
def test_bad_inputs_raise_value_error(base, tok, kwargs, match):
    kwargs = {"text": TEXT, **kwargs}
    with pytest.raises(ValueError, match=match):
        ev.evaluate(base, None, tokenizer=tok, **kwargs)


def test_mismatched_vocab_raises_value_error(base, tok):
    small = tiny_model("llama", vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocabulary \(1000\) differs"):
        ev.evaluate(base, small, TEXT, tokenizer=tok, max_tokens=32)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the default tokenizer's ids do not fit
        ev.evaluate(small, None, TEXT, tokenizer=tok, max_tokens=32)
    ref = ev.make_reference(base, TEXT, tokenizer=tok, max_tokens=32)
    with pytest.raises(ValueError, match="logits over 49152 tokens"):
        ev.evaluate(small, ref)
    with pytest.raises(ValueError, match="logits over 49152 tokens"):
        ev.compare(small, ref)


def test_reference_misuse_raises(base, tok, tmp_path):
    ref = ev.make_reference(base, TEXT, tokenizer=tok, max_tokens=200, window=128, stride=64)
    with pytest.raises(ValueError, match="brings its own tokens"):
        ev.evaluate(base, ref, TEXT)
    with pytest.raises(ValueError, match="places its windows differently"):
        ev.evaluate(base, ref, stride=32)
    assert ev.evaluate(base, ref, window=128, stride=64).kl == 0.0  # the same layout spelled out is fine
    with pytest.raises(ValueError, match="dtype"):
        ev.make_reference(base, TEXT, tokenizer=tok, dtype="int8")
    with pytest.raises(FileNotFoundError, match="text="):
        ev.evaluate(base, str(tmp_path / "nope.safetensors"))
    m = copy.deepcopy(base)
    infopt.optimize(m, [infopt.quantize.Int8WeightOnly()])
    with pytest.raises(IncompatibleModelError, match="already optimized"):
        ev.make_reference(m, TEXT, tokenizer=tok, max_tokens=16)


# -- exact tokens -----------------------------------------------------------------------------

PROMPTS = ["def add(a, b):", [1, 17, 400, 23, 9], torch.tensor([[5, 6, 7], [8, 9, 10]])]


def test_token_identical_passes_for_identical_models(base, tok):
    ev.assert_token_identical(base, copy.deepcopy(base), PROMPTS, max_new_tokens=12, tokenizer=tok)
    out = ev.greedy_outputs(base, PROMPTS, 12, tokenizer=tok)
    assert len(out) == 4 and all(isinstance(t, int) for seq in out for t in seq)


def test_token_identical_catches_one_changed_token(base, tok):
    other = copy.deepcopy(base)
    original = other.generate

    def generate(input_ids, **kwargs):  # flip the 4th generated token of the second prompt
        seq = original(input_ids, **kwargs).clone()
        if input_ids[0, -1].item() == 9:
            p = input_ids.shape[1] + 3
            seq[0, p] = (seq[0, p] + 1) % 49152
        return seq

    other.generate = generate
    with pytest.raises(AssertionError) as e:
        ev.assert_token_identical(base, other, PROMPTS, max_new_tokens=10, tokenizer=tok)
    msg = str(e.value)
    assert "prompt 1 at generated token 3 (sequence position 8)" in msg
    assert "model_a:" in msg and "model_b:" in msg and "'" in msg  # decoded continuations
    with pytest.raises(AssertionError, match=r"model_a: \[\d+"):  # ids without a tokenizer
        ev.assert_token_identical(base, other, PROMPTS[1:], max_new_tokens=10)


@pytest.mark.slow
def test_record_before_compare_after_on_one_object(tok):
    m = tiny_model("llama")
    before = ev.greedy_outputs(m, PROMPTS, 16, tokenizer=tok)
    infopt.optimize(m, "cpu-lossless")
    try:
        ev.assert_same_tokens(before, ev.greedy_outputs(m, PROMPTS, 16, tokenizer=tok), tokenizer=tok)
    finally:
        infopt.undo(m)
    with pytest.raises(AssertionError, match="generated token 2: expected has 7, actual ended after 2 tokens"):
        ev.assert_same_tokens([[5, 6, 7]], [[5, 6]])
    with pytest.raises(ValueError, match="1 prompt"):
        ev.assert_same_tokens([[5]], [[5], [6]])


@pytest.mark.parametrize("prompts, match", [("hi", "pass tokenizer"), ([[]], "empty"), ([1.5], "pass a string"),
                                            (torch.zeros(1, 1, 3, dtype=torch.long), "shape")],
                         ids=["str-no-tokenizer", "empty", "float", "3d"])
def test_bad_prompts(base, prompts, match):
    with pytest.raises(ValueError, match=match):
        ev.greedy_outputs(base, prompts, 4)


# -- CLI --------------------------------------------------------------------------------------

def test_cli_eval_writes_json(tmp_path, capsys):
    from infopt.cli import main

    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    recipe = tmp_path / "r.yaml"
    recipe.write_text('steps:\n  - quantize: {method: int8}\n')
    out = tmp_path / "out" / "eval.json"
    args = ["eval", "--recipe", str(recipe), "--model", str(src), "--max-tokens", "300", "--window", "128",
            "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "KL mean (nats/token)" in text and "top-1 agreement" in text and "perplexity" in text
    data = json.loads(out.read_text())
    res = data["result"]
    assert res["tokens"] == 300 and res["windows"] == 4 and res["kl"] > 0 and 0 < res["top1"] <= 1
    assert res["ppl_ratio"] == pytest.approx(res["ppl"] / res["ppl_ref"])
    assert data["recipe"]["steps"][0]["quantize"]["method"] == "int8"
    assert data["report"]["steps"][0]["key"] == "quantize:int8"

    # the recipe's gate is checked on the evaluation: exit 1 when it fails; the reference cache is reused
    recipe.write_text('steps:\n  - quantize: {method: int8}\ngate: {max_kl: 0.0}\n')
    cache = tmp_path / "ref.safetensors"
    args = ["eval", "--recipe", str(recipe), "--model", str(src), "--max-tokens", "64", "--reference", str(cache)]
    assert main(args) == 1
    assert "quality gate FAILED: KL" in capsys.readouterr().out and cache.is_file()
    assert main(args) == 1
    assert ev.reference_meta(cache)["tokens"] == 64

    assert main(["eval", "--recipe", str(recipe), "--model", str(src), "--max-tokens", "0"]) == 2
    assert "--max-tokens=0 must be a positive integer" in capsys.readouterr().err


# -- API hygiene ------------------------------------------------------------------------------

def test_public_names_documented():
    for name in ev.__all__:
        obj = getattr(ev, name)
        if inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            for section in ("Args:", "Returns:", "Example:"):
                assert section in doc, f"{name} lacks {section}"


def test_eval_modules_do_not_import_optimize_at_module_level():
    # eval sits below optimize/recipe in the staircase; the CLI imports them inside its function only
    import ast
    from pathlib import Path

    above = ("optimize", "recipe", "io", "demo", "cli", "bench")
    for path in Path(ev.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not (node.level >= 2 and any(n.split(".")[0] in above for n in names)), (path.name, names)
                assert not (node.module or "").startswith(tuple(f"infopt.{a}" for a in above)), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("infopt.") and a.name.split(".")[1] in above for a in node.names)


@pytest.mark.parametrize("module", ["windows", "metrics", "store", "quality", "tokens"])
def test_docstring_examples_run(module):
    import importlib

    mod = importlib.import_module(f"infopt.eval.{module}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0  # no example found would pass vacuously


# -- the real default model -------------------------------------------------------------------

@pytest.mark.real_model
def test_default_model_cpu_fast_within_its_gate_and_undone_exactly(default_model, tmp_path):
    # the eval API on the real model: a reference file, evaluate() of the lossy preset, and of the model undone
    # (cpu-lossless's tokens on this model: test_real_model_golden.py)
    model, tok = default_model
    ref = ev.reference_for(model, tmp_path / "ref.safetensors", tokenizer=tok, max_tokens=512)
    try:
        infopt.optimize(model, "cpu-fast")
        r = ev.evaluate(model, ref, tokenizer=tok)
        assert 0 < r.kl < 0.02 and r.top1 > 0.9 and r.ppl_ratio < 1.05  # measured ~0.003 / 0.97
    finally:
        infopt.undo(model)
    assert ev.evaluate(model, ref).kl == 0.0


def test_decode_path_logits_run_the_compiled_step_and_match_plain_decoding():
    # the logits of an optimized model's own decode path (static cache + compiled step), teacher-forced along
    # plain generate's greedy output: the same argmax at every step, the same values to fp32 rounding, and every
    # step but the prompt's through the compiled graph
    from infopt.compile import compile_stats
    from infopt.eval import decode_path_logits

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}, {"compile": {"mode": "default"}}])
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    out = ref.generate(ids, max_new_tokens=12, do_sample=False)[0, 5:]
    plain = decode_path_logits(ref, ids, out)
    calls = compile_stats(m).calls
    fast = decode_path_logits(m, ids, out)
    assert compile_stats(m).calls - calls == 11
    assert plain.shape == fast.shape == (12, ref.config.vocab_size)
    assert torch.equal(plain.argmax(-1), out) and torch.equal(fast.argmax(-1), out)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    # and they are the logits a whole-sequence forward gives
    full = ref(torch.cat([ids[0], out])[None]).logits[0, 4:-1].float()
    torch.testing.assert_close(plain, full, rtol=1e-4, atol=1e-4)


def test_decode_path_logits_copy_each_row_of_a_step_that_reuses_its_output_buffer(monkeypatch):
    # a step replayed as a CUDA graph returns the same output tensor every time, overwritten by the next replay
    from infopt.eval import decode_path_logits
    from infopt.generate import decoder_for

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}])
    fwd = decoder_for(m).forward_for()
    step, buffer = fwd.step, []

    def replayed(*args, **kwargs):
        out = step(*args, **kwargs)
        if not buffer:
            buffer.append(torch.empty_like(out))
        return buffer[0].copy_(out)

    monkeypatch.setattr(fwd, "step", replayed)
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    out = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, 5:]
    fast = decode_path_logits(m, ids, out)
    assert len(buffer) == 1 and torch.equal(fast.argmax(-1), out)
    torch.testing.assert_close(fast, decode_path_logits(ref, ids, out), rtol=1e-4, atol=1e-4)


def test_decode_path_logits_refuse_a_batch():
    from infopt.eval import decode_path_logits

    with pytest.raises(ValueError, match=r"one prompt, input_ids \[1, T\]"):
        decode_path_logits(tiny_model(), torch.tensor([[1, 2], [3, 4]]), torch.tensor([5]))
