"""An optimized model the user drops is freed, with everything infopt keeps for it.

infopt's per-model state (the undo records, the generate decoder, the engine, speculative counters, compiled
steps) references the model; none of it may keep the model alive from a process-wide table, and the
temporary folder holding the weights a quantization moved to disk for undo goes with the model.
"""

import copy
import gc
import os
import weakref

import pytest
import torch

import infopt
from infopt.core import patch
from infopt.models import tiny_model

RECIPES = {
    "quantize": [{"quantize": {"method": "int8"}}],
    "static+compile": [{"kvcache": "static"}, {"compile": {}}],
    "int4+static+lookup": [{"quantize": {"method": "int4", "group_size": 32}}, {"kvcache": "static"},
                           {"speculative": {"method": "prompt_lookup"}}],
    "self-draft": [{"speculative": {"method": "self_draft", "num_layers": 1}}, {"kvcache": "static"}],
    "batching": [{"batching": {}}],
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_dropped_optimized_model_is_freed(name):
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": RECIPES[name]})
    m.generate(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 3]), max_new_tokens=4, do_sample=False)
    spill = patch.get_handle(m)._spill_dir
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None, f"recipe {name}: the model is still referenced after the user dropped it"
    if spill is not None:
        assert not os.path.exists(spill), "the undo spill folder outlived its model"


def test_spill_folder_removed_on_gc_and_on_undo():
    m = tiny_model("llama")
    patch.swap_module(m, "model.layers.0.mlp.up_proj", torch.nn.Identity(), keep_original="disk")
    folder = patch.get_handle(m)._spill_dir
    assert folder is not None and os.listdir(folder)
    del m
    gc.collect()
    assert not os.path.exists(folder)

    m = tiny_model("llama")
    patch.swap_module(m, "model.layers.0.mlp.up_proj", torch.nn.Identity(), keep_original="disk")
    folder = patch.get_handle(m)._spill_dir
    patch.undo(m)
    assert not os.path.exists(folder)
    assert not any(k.startswith(patch.STATE_PREFIX) for k in vars(m))  # undo leaves no attribute behind


def test_state_is_not_part_of_the_weights_and_copies_start_clean():
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": [{"quantize": {"method": "int8"}}, {"kvcache": "static"}]})
    assert any(k.startswith(patch.STATE_PREFIX) for k in vars(m))
    assert not any(patch.STATE_PREFIX in k for k in m.state_dict())
    c = copy.deepcopy(m)
    assert patch.get_handle(c).records == []  # replaying the original's records on a copy would undo the original
    assert patch.has_patches(m)
    patch.undo(c)
    assert patch.has_patches(m)
