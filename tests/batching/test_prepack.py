"""bf16 and fp32 weights prepacked for the engine's steps: used only inside them, never stale, undone."""

import contextlib

import pytest
import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.batching.prepack import packed_forwards, prepack_linears_, supported
from infopt.models import tiny_model

DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not supported(tiny_model("llama", dtype=torch.bfloat16)),
                                                          reason="this CPU's oneDNN does not run bf16 matmuls")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not supported(tiny_model("llama")),
                                                         reason="this torch build has no oneDNN prepacked linear")),
]
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _linears(m):
    return [mod for mod in m.modules() if type(mod) is torch.nn.Linear]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_forward_matches_plain_and_only_inside_the_block(dtype):
    m = tiny_model("llama", dtype=dtype)
    lin = _linears(m)[0]
    x = torch.randn(5, 7, lin.in_features, dtype=dtype)
    plain = lin(x)
    assert prepack_linears_(m) == len(_linears(m))
    assert torch.equal(lin(x), plain)  # outside packed_forwards: the original forward
    with packed_forwards():
        packed = lin(x)
    assert packed.shape == plain.shape and packed.dtype == dtype
    torch.testing.assert_close(packed.float(), plain.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert prepack_linears_(m) == 0  # already packed: not wrapped twice


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_changed_in_place_falls_back_to_the_plain_weight(dtype):
    m = tiny_model("llama", dtype=dtype)
    lin = _linears(m)[0]
    prepack_linears_(m)
    with torch.no_grad():
        lin.weight.mul_(2)  # e.g. load_state_dict or an optimizer step
    x = torch.randn(3, lin.in_features, dtype=dtype)
    with packed_forwards():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_prepacks_and_undo_restores(dtype):
    m = tiny_model("llama", dtype=dtype)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    engine = Engine(m, max_batch_tokens=64, max_seqs=4)
    assert engine.prepacked == len(_linears(m))
    outs = engine.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    infopt.undo(m)
    assert all("forward" not in mod.__dict__ for mod in _linears(m))
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_logits_on_packed_weights_match_the_plain_ones(dtype):
    """One engine step's forward on packed weights against the same forward outside the packed block."""
    m = tiny_model("llama", dtype=dtype)
    ids = torch.tensor([[3, 9, 27, 81, 243, 5, 7]])
    with torch.no_grad():
        want = m(ids).logits
        prepack_linears_(m)
        with packed_forwards():
            got = m(ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5 * TOL[dtype], rtol=5 * TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prepack_false_runs_the_plain_weights_even_after_an_earlier_engine_packed_them(dtype, monkeypatch):
    import infopt.batching.core as eng

    m = tiny_model("llama", dtype=dtype)
    Engine(m, max_batch_tokens=64, max_seqs=4)  # packs
    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(1)
        with packed_forwards():
            yield

    monkeypatch.setattr(eng, "packed_forwards", spy)
    plain = Engine(m, max_batch_tokens=64, max_seqs=4, prepack=False)
    plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert not entered
    auto = Engine(m, max_batch_tokens=64, max_seqs=4)
    assert auto.prepacked == 0  # the earlier engine's packed copies serve it
    auto.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert entered


def test_prepack_refused_clearly_where_oneDNN_cannot_pack_the_dtype():
    m = tiny_model("llama", dtype=torch.float16)
    assert not supported(m)
    with pytest.raises(ValueError, match="prepack=True needs an fp32 model, or a bf16 one"):
        Engine(m, max_batch_tokens=64, max_seqs=4, prepack=True)
    assert not infopt.core.patch.has_patches(m) and m.config._attn_implementation == "sdpa"  # left untouched
