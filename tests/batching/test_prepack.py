"""bf16 weights prepacked for the engine's steps: used only inside them, never stale, undone."""

import pytest
import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.batching.prepack import packed_forwards, prepack_linears_, supported
from infopt.models import tiny_model

pytestmark = pytest.mark.skipif(not supported(tiny_model("llama", dtype=torch.bfloat16)),
                                reason="this CPU's oneDNN does not run bf16 matmuls")


def _linears(m):
    return [mod for mod in m.modules() if type(mod) is torch.nn.Linear]


def test_packed_forward_matches_plain_within_bf16_and_only_inside_the_block():
    m = tiny_model("llama", dtype=torch.bfloat16)
    lin = _linears(m)[0]
    x = torch.randn(5, 7, lin.in_features, dtype=torch.bfloat16)
    plain = lin(x)
    assert prepack_linears_(m) == len(_linears(m))
    assert torch.equal(lin(x), plain)  # outside packed_forwards: the original forward
    with packed_forwards():
        packed = lin(x)
    assert packed.shape == plain.shape
    torch.testing.assert_close(packed.float(), plain.float(), atol=2e-2, rtol=2e-2)
    assert prepack_linears_(m) == 0  # already packed: not wrapped twice


def test_weight_changed_in_place_falls_back_to_the_plain_weight():
    m = tiny_model("llama", dtype=torch.bfloat16)
    lin = _linears(m)[0]
    prepack_linears_(m)
    with torch.no_grad():
        lin.weight.mul_(2)  # e.g. load_state_dict or an optimizer step
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
    with packed_forwards():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_engine_prepacks_bf16_and_undo_restores():
    m = tiny_model("llama", dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    engine = Engine(m, max_batch_tokens=64, max_seqs=4)
    assert engine.prepacked == len(_linears(m))
    outs = engine.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    infopt.undo(m)
    assert all("forward" not in mod.__dict__ for mod in _linears(m))
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


def test_prepack_refused_clearly_for_fp32():
    m = tiny_model("llama")
    assert Engine(m, max_batch_tokens=64, max_seqs=4).prepacked == 0
    m = tiny_model("llama")
    with pytest.raises(ValueError, match="prepack=True needs a bf16 model"):
        Engine(m, max_batch_tokens=64, max_seqs=4, prepack=True)
    assert not infopt.core.patch.has_patches(m) and m.config._attn_implementation == "sdpa"  # left untouched
