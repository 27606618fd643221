"""A group size that does not divide a layer is refused with sizes that divide every layer the step quantizes."""

import re

import pytest
import torch
from torch import nn

import infopt
from infopt.core.errors import IncompatibleModelError
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.quantize.api import KERNEL_GROUP_SIZES

from ..conftest import assert_state_equal, state_snapshot


def _llama_with_mlp_width(intermediate: int, hidden: int = 128):
    """A tiny llama whose MLP is ``intermediate`` wide, so its layers' in_features differ in their divisors
    (q/k/v/o and gate/up read ``hidden``, down reads ``intermediate``)."""
    m = tiny_model("llama", hidden_size=hidden, num_layers=1)
    mlp = m.model.layers[0].mlp
    torch.manual_seed(0)
    mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
    mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
    mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
    m.config.intermediate_size = intermediate
    return m


def _offered(message: str) -> list[int]:
    return [int(g) for g in re.search(r"use group_size ([\d or]+)", message)[1].split(" or ")]


@pytest.mark.parametrize("make", [Int4WeightOnly, Int8WeightOnly], ids=["int4", "int8"])
def test_every_offered_group_size_is_accepted(make):
    m = _llama_with_mlp_width(96)  # 128 takes 128/64/32; 96 takes only 32
    with pytest.raises(IncompatibleModelError) as e:
        infopt.validate(m, [make(group_size=128)])
    msg = str(e.value)
    assert "does not divide model.layers.0.mlp.down_proj.in_features=96" in msg
    assert _offered(msg) == [32]  # 128 and 64 divide the hidden width but not the MLP's: not offered
    for g in (set(KERNEL_GROUP_SIZES) - {32}):
        with pytest.raises(IncompatibleModelError):
            infopt.validate(m, [make(group_size=g)])
    infopt.validate(m, [make(group_size=32)])


def test_the_first_refused_layer_lists_only_sizes_the_others_take():
    m = _llama_with_mlp_width(96)
    with pytest.raises(IncompatibleModelError) as e:  # q_proj (128) is the first layer 256 does not divide
        infopt.validate(m, [Int4WeightOnly(group_size=256)])
    assert "q_proj.in_features=128; use group_size 32 (the sizes that divide every layer it quantizes)" in str(e.value)


@pytest.mark.parametrize("make", [Int4WeightOnly, Int8WeightOnly], ids=["int4", "int8"])
def test_a_layer_no_kernel_size_divides_gets_no_size_offered(make):
    m = _llama_with_mlp_width(80)  # 80 = 16 * 5: no size of 32, 64, 128, 256 divides it
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError) as e:
        infopt.optimize(m, [make(group_size=256)])
    msg = str(e.value)
    assert "no group size of 32, 64, 128, 256 divides the input width of model.layers.0.mlp.down_proj (80)" in msg
    assert "use group_size" not in msg
    assert_state_equal(m, snap)
    if make is Int8WeightOnly:  # the alternative it names does apply
        assert "(or group_size=None for one scale per channel)" in msg
        infopt.optimize(m, [make(group_size=None)])
        assert type(m.model.layers[0].mlp.down_proj).__name__ == "Int8Linear"
