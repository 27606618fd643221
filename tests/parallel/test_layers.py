"""Quantized shards keep their layer's kernel settings (no process group needed: ``shard_rows``/``shard_cols``
are pure slicing)."""

import pytest
import torch
from torch import nn

from infopt.core.errors import IncompatibleModelError
from infopt.parallel.layers import shard_cols, shard_rows
from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import Int4Linear
from infopt.quantize.formats.int8 import Int8Linear

kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")


def _linear(out_f=64, in_f=128, bias=True):
    torch.manual_seed(0)
    return nn.Linear(in_f, out_f, bias=bias)


def _int8(**kw):
    layer = Int8Linear.from_float(_linear(), **kw)
    return layer


def _settings(m):
    if isinstance(m, Int8Linear):
        return m.activations, m.compute_dtype, m.cuda_kernel
    return m.layout, m.weight_dense is not None


def _check_shards(layer, world=2):
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        ref = layer(x)
        rows = [shard_rows(layer, r, world, "layers.0.q") for r in range(world)]
        cols = [shard_cols(layer, r, world, "layers.0.o") for r in range(world)]
        by_rows = torch.cat([m(x) for m in rows], dim=-1)
        step = layer.in_features // world
        by_cols = sum(m(x[:, r * step:(r + 1) * step]) for r, m in enumerate(cols))
        if layer.bias is not None:
            by_cols = by_cols + layer.bias
    for m in rows + cols:
        assert type(m) is type(layer) and _settings(m) == _settings(layer)
    assert torch.allclose(by_rows, ref, atol=1e-5, rtol=1e-5)
    # the column shards' partial sums add in another order (and int8 activations are quantized per slice group)
    assert torch.allclose(by_cols, ref, atol=2e-2 * ref.abs().max().item())


@kernel
def test_int8_shard_with_int8_activations_keeps_them():
    # before: shard_rows read weight_int8, which a layer with int8 activations does not hold (AttributeError)
    _check_shards(_int8(activations="int8"))


def test_int8_shard_keeps_compute_dtype_and_cuda_kernel():
    layer = _int8()
    layer.cuda_kernel = "gemv"
    _check_shards(layer)


@kernel
def test_int4_a8_shard_keeps_the_int8_activation_layout():
    # before: shards took the device's automatic layout (cpu_int4pack), dropping the int8 activations
    _check_shards(Int4Linear.from_float(_linear(), group_size=32, layout="a8"))


def test_int4_gemv_shard_keeps_the_gemv_layout_and_dense_copy():
    layer = Int4Linear.from_float(_linear(), group_size=32, layout="gemv")
    layer.enable_dense()
    assert layer.weight_dense is not None
    _check_shards(layer)


def test_int4_automatic_layout_shard_follows_the_device():
    layer = Int4Linear.from_float(_linear(), group_size=32)
    _check_shards(layer)
    assert shard_rows(layer, 0, 2)._layout_auto


@kernel
def test_shard_that_cannot_keep_int8_activations_is_refused_with_the_layer_named():
    layer = Int8Linear.from_float(_linear(out_f=48), activations="int8")  # 2 shards of 24 rows: not a multiple of 16
    with pytest.raises(IncompatibleModelError, match=r"layers\.0\.q.*activations='float'"):
        shard_rows(layer, 0, 2, "layers.0.q")
