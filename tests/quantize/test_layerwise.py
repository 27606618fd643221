import pytest
import torch

from infopt.core.introspect import inspect_model
from infopt.models import tiny_model
from infopt.quantize import GPTQ
from infopt.quantize.algorithms.layerwise import (
    Grid,
    LayerRunner,
    _first_layer_inputs,
    capture_layer_calls,
    quantize_layerwise,
)
from infopt.quantize.api import quantize_targets

from ..conftest import assert_state_equal, state_snapshot


def ids(n=5, seq=48):
    return torch.randint(0, 49152, (n, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "gemma3", "phi3"])
def test_replay_matches_the_model(arch):
    """Layer 0's inputs captured in batches, then each layer replayed with the arguments recorded on a batch of
    one (per layer: Gemma 3 alternates sliding and full attention), reproduce the model's last layer output."""
    m = tiny_model(arch, num_layers=3)
    info = inspect_model(m)
    x = ids()
    got = []
    last = m.get_submodule(info.layer_fqns[-1])
    h = last.register_forward_hook(lambda mod, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        m(x, use_cache=False)
    h.remove()
    _, calls = capture_layer_calls(m, info, x[:1])
    hidden = _first_layer_inputs(m, info, x, batch=2)
    assert [t.shape[0] for t in hidden] == [2, 2, 1]
    for i, fqn in enumerate(info.layer_fqns):
        hidden = LayerRunner(calls[i], hidden).run(m.get_submodule(fqn), keep_outputs=True)
    torch.testing.assert_close(torch.cat(hidden), got[0], atol=1e-5, rtol=1e-5)


def test_driver_copies_layers_and_stops_after_last_target():
    m = tiny_model("llama", num_layers=3)
    snap = state_snapshot(m)
    cfg = GPTQ(group_size=32)
    targets = [t for t in quantize_targets(m, cfg) if ".1." in t.fqn]
    seen = []

    def fn(index, work, runner, rel_targets):
        seen.append((index, sorted(rel_targets)))
        assert work is not m.model.layers[index]
        work.mlp.up_proj.weight.zero_()  # edits the copy only
        return {}

    quantize_layerwise(m, targets, ids(), fn, desc="test")
    assert seen == [(1, sorted(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]))]
    assert_state_equal(m, snap)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True)], ids=["int4", "int4-sym", "int8"])
def test_grid_rtn_error_bounded(bits, symmetric):
    w = torch.randn(16, 64)
    grid = Grid(bits, symmetric)
    codes, scales, zeros = grid.rtn(w, 32)
    assert int(codes.min()) >= 0 and int(codes.max()) <= grid.maxq
    err = (grid.dequantize(codes, scales, zeros, 32) - w).abs()
    assert bool((err <= scales.repeat_interleave(32, 1) * 0.5 + 1e-6).all())
