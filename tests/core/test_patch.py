import os

import torch
from torch import nn

from infopt.core import patch
from infopt.models import tiny_model


def test_swap_module_and_undo_restores_same_object():
    m = tiny_model("llama")
    old = m.model.layers[0].mlp.up_proj
    patch.swap_module(m, "model.layers.0.mlp.up_proj", nn.Identity())
    assert isinstance(m.model.layers[0].mlp.up_proj, nn.Identity)
    assert patch.has_patches(m)
    assert patch.undo(m) == 1
    assert m.model.layers[0].mlp.up_proj is old
    assert not patch.has_patches(m)


def test_swap_keep_original_disk_frees_and_restores_bit_identical():
    m = tiny_model("llama")
    lin = m.model.layers[1].self_attn.q_proj
    w = lin.weight.detach().clone()
    param_obj = lin.weight
    patch.swap_module(m, "model.layers.1.self_attn.q_proj", nn.Identity(), keep_original="disk")
    assert lin.weight.numel() == 0  # storage released while swapped out
    patch.undo(m)
    assert m.model.layers[1].self_attn.q_proj.weight is param_obj
    assert torch.equal(param_obj, w)


def test_disk_spill_writes_no_file_for_tensors_of_zeros(tmp_path):
    """A blank model being rebuilt by infopt.load holds zeros: they are not written to disk (2 s for the default
    model), and undo makes them again, bit for bit, beside a spilled tensor that was not zeros."""
    m = tiny_model("llama")
    lin = m.model.layers[0].mlp.down_proj
    with torch.no_grad():
        lin.weight.zero_()
    patch.swap_module(m, "model.layers.0.mlp.down_proj", nn.Identity(), keep_original="disk")
    assert lin.weight.numel() == 0 and not os.listdir(patch.get_handle(m).spill_dir())
    q = m.model.layers[0].self_attn.q_proj
    w = q.weight.detach().clone()
    patch.swap_module(m, "model.layers.0.self_attn.q_proj", nn.Identity(), keep_original="disk")
    patch.undo(m)
    assert m.model.layers[0].mlp.down_proj is lin and lin.weight.shape == (64, 128) and not lin.weight.any()
    assert lin.weight.dtype == torch.float32 and lin.weight.is_contiguous()
    assert torch.equal(m.model.layers[0].self_attn.q_proj.weight, w)


def test_disk_spill_keeps_tied_weights_in_place():
    m = tiny_model("llama")  # lm_head tied to the embedding
    assert m.lm_head.weight is m.model.embed_tokens.weight
    emb = m.model.embed_tokens.weight.detach().clone()
    patch.swap_module(m, "lm_head", nn.Identity(), keep_original="disk")
    assert torch.equal(m.model.embed_tokens.weight, emb)  # still used by the embedding: not spilled
    patch.undo(m)
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_wrap_method_is_instance_only():
    a, b = tiny_model("llama"), tiny_model("llama")
    calls = []

    def make(orig):
        def gen(*args, **kw):
            calls.append(1)
            return orig(*args, **kw)

        return gen

    patch.wrap_method(a, "generate", make)
    a.generate(torch.tensor([[1, 2]]), max_new_tokens=1, do_sample=False)
    b.generate(torch.tensor([[1, 2]]), max_new_tokens=1, do_sample=False)
    assert calls == [1]
    assert "generate" not in type(a).__dict__ or type(a).generate is type(b).generate
    patch.undo(a)
    assert "generate" not in a.__dict__


def test_hook_and_attr_undo():
    m = tiny_model("llama")
    seen = []
    patch.register_hook(m, m.model.layers[0], lambda mod, args: seen.append(1))
    patch.set_attr(m, m.config, "use_cache", False)
    patch.set_attr(m, m, "brand_new", 3)
    m(torch.tensor([[1, 2]]))
    assert seen == [1] and m.config.use_cache is False and m.brand_new == 3
    assert patch.undo(m) == 3
    m(torch.tensor([[1, 2]]))
    assert seen == [1]
    assert m.config.use_cache is True
    assert not hasattr(m, "brand_new")


def test_undo_on_untouched_model_is_zero():
    assert patch.undo(tiny_model("gpt2")) == 0
