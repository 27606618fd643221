"""fp32 linears on oneDNN prepacked weights: same values as F.linear (within fp32 reordering), never stale, undone."""

import copy

import pytest
import torch
from torch import nn

import infopt
from infopt.compile import Compile
from infopt.compile.packed import pack_linears_, unpack_linears_
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.kvcache import Static
from infopt.models import tiny_model
from infopt.ops import packed_linear as op
from infopt.ops.packed_linear import can_pack, is_packed
from tests.conftest import assert_state_equal, state_snapshot

needs_onednn = pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN prepacked linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 40])
def test_packed_linear_matches_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=rows % 2 == 0)
    x = torch.randn(2, rows, 96)
    want = lin(x)
    layers = pack_linears_(lin, min_elements=0)
    assert layers == [lin] and "forward" in lin.__dict__
    before = op.kernel_calls()
    with torch.no_grad():  # inference: the weight's requires_grad would otherwise want a gradient
        got = lin(x)
    assert op.kernel_calls()["packed_linear"] == before["packed_linear"] + 1  # F.linear gives the same numbers
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # the operator has no backward: a call that wants a gradient takes F.linear
    assert torch.equal(lin(x), want)
    assert op.kernel_calls() == {"packed_linear": before["packed_linear"] + 1, "linear": before["linear"] + 1}
    unpack_linears_(layers)
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), want)
    assert op.kernel_calls()["packed_linear"] == before["packed_linear"] + 1


@needs_onednn
def test_a_weight_written_after_packing_is_repacked():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(4, 64)
    pack_linears_(lin, min_elements=0)
    before = op.kernel_calls()["packed_linear"]
    with torch.no_grad():  # inference, where the operator serves (a call wanting a gradient takes F.linear)
        lin.weight.mul_(2.0)  # in place: the version counter moves
        assert torch.allclose(lin(x), x @ lin.weight.t(), atol=1e-5)
        twin = copy.deepcopy(lin)  # a copy names the same handle with another weight: it packs its own
        twin.weight.add_(1.0)
        assert torch.allclose(twin(x), x @ twin.weight.t(), atol=1e-5)
        assert torch.allclose(lin(x), x @ lin.weight.t(), atol=1e-5)
    assert op.kernel_calls()["packed_linear"] == before + 3


@needs_onednn
def test_compile_packs_fp32_linears_token_identical_and_undo():
    ref, m = tiny_model(), tiny_model()
    before = state_snapshot(m)
    infopt.optimize(m, [Static(max_length=256), Compile(backend="eager")])
    packed = [x for x in m.modules() if "_infopt_packed" in x.__dict__]
    assert packed and all(type(x) is nn.Linear for x in packed)
    assert any("prepacked" in n for n in m.infopt.steps[-1].notes)
    p = torch.randint(3, 1000, (1, 9))
    calls = op.kernel_calls()["packed_linear"]
    assert torch.equal(m.generate(p, max_new_tokens=16, do_sample=False),
                       ref.generate(p, max_new_tokens=16, do_sample=False))
    # every packed layer ran the operator on every forward (the prompt and 15 compiled decode steps)
    assert op.kernel_calls()["packed_linear"] - calls == 16 * len(packed)
    handles = [x._infopt_packed for x in packed]
    infopt.undo(m)
    assert_state_equal(m, before)
    assert not any("_infopt_packed" in x.__dict__ or "forward" in x.__dict__ for x in m.modules())
    assert not any(is_packed(h) for h in handles)
    # packed again after undo: the same handles, so inductor's cache serves the same graphs
    infopt.optimize(m, [Static(max_length=256), Compile(backend="eager", warmup_lengths=())])
    assert [x._infopt_packed for x in m.modules() if "_infopt_packed" in x.__dict__] == handles
    infopt.undo(m)


def test_pack_linears_off_and_bad_values():
    m = tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(backend="eager", warmup_lengths=(), pack_linears=False)])
    assert not any("_infopt_packed" in x.__dict__ for x in m.modules())
    infopt.undo(m)
    with pytest.raises(RecipeError, match="pack_linears"):
        Compile(pack_linears="yes")
    fp16 = tiny_model(dtype=torch.float16)
    before = state_snapshot(fp16)
    with pytest.raises(IncompatibleModelError, match="pack_linears=True\\) needs an fp32 model on CPU"):
        infopt.optimize(fp16, [Static(max_length=256), Compile(backend="eager", pack_linears=True)])
    assert_state_equal(fp16, before)


@pytest.mark.skipif(not op.can_pack_dtype(torch.bfloat16), reason="oneDNN runs no bf16 matmuls on this CPU")
def test_bf16_linears_are_packed_and_token_identical():
    # bf16 F.linear reorders its weight into oneDNN's layout on every call; packed once, the values are the same
    ref, m = tiny_model(dtype=torch.bfloat16, hidden_size=768, num_heads=8), tiny_model(dtype=torch.bfloat16,
                                                                                        hidden_size=768, num_heads=8)
    infopt.optimize(m, [Static(max_length=256), Compile(mode="default")])
    assert any("_infopt_packed" in x.__dict__ for x in m.modules())
    group = m.model.layers[0].self_attn.q_proj._infopt_fused
    assert group.packed is not None  # the fused q/k/v runs on one packed weight
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    kw = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
