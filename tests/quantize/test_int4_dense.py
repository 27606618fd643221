import pytest
import torch

import infopt
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly
from infopt.quantize.formats import int4
from infopt.quantize.formats.int4 import DENSE_FP32_MIN_ROWS, DENSE_MIN_ROWS, Int4Linear


def _layer(dense: bool) -> Int4Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    q = Int4Linear.from_float(lin, group_size=32)
    if dense:
        q.enable_dense()
    return q


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 8, 15, 16, 64])
def test_dense_copy_matches_the_kernel(rows, fast_bf16, monkeypatch):
    """The copy is bf16 where the CPU has native bf16 GEMMs and serves calls from DENSE_MIN_ROWS rows; elsewhere it
    is kept in the layer's dtype and serves calls from DENSE_FP32_MIN_ROWS rows."""
    monkeypatch.setattr(int4, "_FAST_BF16", [fast_bf16])
    kernel, dense = _layer(False), _layer(True)
    wd = dense.weight_dense
    assert wd.dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    x = torch.randn(rows, 64)
    want = x @ kernel.dequantize().t() + kernel.bias
    got = dense(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 activations, as in the int4 kernel
    if rows < (DENSE_MIN_ROWS if fast_bf16 else DENSE_FP32_MIN_ROWS):
        assert torch.equal(got, kernel(x))  # short calls keep the int4 kernel
    else:
        assert torch.equal(got, torch.nn.functional.linear(x.to(wd.dtype), wd).float() + dense.bias)


def test_a8_layers_keep_no_copy_without_native_bf16_gemms(monkeypatch):
    monkeypatch.setattr(int4, "_FAST_BF16", [False])
    layer = Int4Linear.from_float(torch.nn.Linear(64, 32), group_size=32, layout="a8")
    layer.enable_dense()
    assert layer.weight_dense is None


def test_dense_copy_is_not_saved_and_follows_loaded_codes():
    src = _layer(True)
    dst = Int4Linear.from_float(torch.nn.Linear(64, 32), group_size=32)  # other codes, as a rebuilt layer has
    dst.enable_dense()
    assert not torch.equal(dst.weight_dense, src.weight_dense)
    assert "weight_dense" not in src.state_dict()
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.weight_dense, src.weight_dense)


def test_recipe_field_and_prompt_path_close_to_kernel_path():
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(ref, [Int4WeightOnly(group_size=32)])
    infopt.optimize(m, [Int4WeightOnly(group_size=32, dense_prefill=True)])
    layer = m.model.layers[0].mlp.up_proj
    assert isinstance(layer, Int4Linear) and layer.weight_dense is not None
    ids = torch.randint(3, 1000, (1, 24))
    torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=0.05, atol=0.05)
    infopt.undo(m)
    assert isinstance(m.model.layers[0].mlp.up_proj, torch.nn.Linear)
