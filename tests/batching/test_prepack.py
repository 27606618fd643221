"""bf16 and fp32 weights prepacked for the engine's steps (``infopt.compile.packed``, scoped): used only inside them,
never stale, undone."""

import pytest
import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.compile.packed import can_pack_model, pack_linears_, unpack_linears_
from infopt.models import tiny_model
from infopt.ops import packed_linear as op
from infopt.ops.scope import packed_call

DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not can_pack_model(tiny_model("llama", dtype=torch.bfloat16)),
                                                          reason="this CPU's oneDNN does not run bf16 matmuls")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not can_pack_model(tiny_model("llama")),
                                                         reason="this torch build has no oneDNN prepacked linear")),
]
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _linears(m):
    return [mod for mod in m.modules() if type(mod) is torch.nn.Linear]


def _calls():
    return op.kernel_calls()["packed_linear"]


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()  # the operator has no backward: a packed layer takes F.linear where a gradient is wanted
def test_scoped_layers_use_the_packed_weight_only_inside_a_packed_call(dtype):
    m = tiny_model("llama", dtype=dtype)
    lin = _linears(m)[0]
    x = torch.randn(5, 7, lin.in_features, dtype=dtype)
    plain = lin(x)
    layers = pack_linears_(m, min_elements=0, dtypes=(dtype,), rows=64, scoped=True)
    assert len(layers) == len(_linears(m))
    before = _calls()
    assert torch.equal(lin(x), plain) and _calls() == before  # outside a packed call: the original forward
    with packed_call():
        got = lin(x)
    assert _calls() == before + 1
    assert got.shape == plain.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), plain.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert pack_linears_(m, min_elements=0, dtypes=(dtype,), scoped=True) == []  # already packed: not twice
    unpack_linears_(layers)
    with packed_call():
        assert torch.equal(lin(x), plain) and _calls() == before + 1


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_weight_changed_in_place_is_packed_again_never_stale(dtype):
    m = tiny_model("llama", dtype=dtype)
    lin = _linears(m)[0]
    pack_linears_(m, min_elements=0, dtypes=(dtype,), rows=64, scoped=True)
    x = torch.randn(3, lin.in_features, dtype=dtype)
    lin.weight.mul_(2)  # e.g. load_state_dict or an optimizer step
    with packed_call():
        got = lin(x)
    want = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.allclose(got.float(), (want / 2).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_prepacks_and_undo_restores(dtype):
    m = tiny_model("llama", dtype=dtype)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    engine = Engine(m, max_batch_tokens=64, max_seqs=4)
    assert engine.prepacked == len(_linears(m))
    before = _calls()
    outs = engine.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert _calls() > before  # the engine's steps ran on the packed weights
    infopt.undo(m)
    assert all("forward" not in mod.__dict__ for mod in _linears(m))
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_logits_on_packed_weights_match_the_plain_ones(dtype):
    """A packed call's forward against the same forward outside it, on the same model."""
    m = tiny_model("llama", dtype=dtype)
    ids = torch.tensor([[3, 9, 27, 81, 243, 5, 7]])
    with torch.no_grad():
        want = m(ids).logits
        pack_linears_(m, min_elements=0, dtypes=(dtype,), rows=64, scoped=True)
        assert torch.equal(m(ids).logits, want)  # other calls keep the plain weights
        with packed_call():
            got = m(ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5 * TOL[dtype], rtol=5 * TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prepack_false_runs_the_plain_weights_even_after_an_earlier_engine_packed_them(dtype):
    m = tiny_model("llama", dtype=dtype)
    Engine(m, max_batch_tokens=64, max_seqs=4)  # packs
    before = _calls()
    plain = Engine(m, max_batch_tokens=64, max_seqs=4, prepack=False)
    plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert _calls() == before  # the earlier engine's packed copies stayed unused
    auto = Engine(m, max_batch_tokens=64, max_seqs=4)
    assert auto.prepacked == 0  # the earlier engine's packed copies serve it
    auto.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert _calls() > before


def test_prepack_refused_clearly_where_oneDNN_cannot_pack_the_dtype():
    m = tiny_model("llama", dtype=torch.float16)
    assert not can_pack_model(m)
    with pytest.raises(ValueError, match="prepack=True needs an fp32 model, or a bf16 one"):
        Engine(m, max_batch_tokens=64, max_seqs=4, prepack=True)
    assert not infopt.core.patch.has_patches(m) and m.config._attn_implementation == "sdpa"  # left untouched
