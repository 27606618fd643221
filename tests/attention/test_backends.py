import pytest
import torch

import infopt
from infopt.attention import Attention, set_backend_
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
def test_eager_and_sdpa_same_greedy_tokens(arch, prompt):
    m = tiny_model(arch)
    ref = m.generate(prompt, max_new_tokens=16, do_sample=False)
    set_backend_(m, "eager")
    assert m.config._attn_implementation == "eager"
    assert torch.equal(m.generate(prompt, max_new_tokens=16, do_sample=False), ref)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_flex_same_greedy_tokens_on_cpu(prompt):
    # flex attention compiles its kernel (about 15 s on 2 cores): one architecture is enough here
    m = tiny_model("llama")
    ref = m.generate(prompt, max_new_tokens=12, do_sample=False)
    infopt.optimize(m, [Attention("flex")])
    assert m.config._attn_implementation == "flex_attention"
    assert torch.equal(m.generate(prompt, max_new_tokens=12, do_sample=False), ref)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_unknown_backend():
    with pytest.raises(RecipeError, match="allowed: eager, sdpa, sdpa_gqa, flash_attention_2, flex"):
        Attention("fast")


def test_flash_attention_refused_on_cpu(llama, monkeypatch):
    import infopt.core.availability as av

    monkeypatch.setattr(av, "is_available", lambda m: True)  # pretend flash-attn is installed
    with pytest.raises(IncompatibleModelError, match="CUDA only"):
        infopt.optimize(llama, [Attention("flash_attention_2")])


@pytest.mark.gpu
def test_flash_attention_on_cuda(prompt):
    pytest.importorskip("flash_attn", reason="flash-attn not installed (pip install 'infopt[flash]')")
    m = tiny_model("llama", dtype=torch.bfloat16).cuda()
    ref = m.generate(prompt.cuda(), max_new_tokens=8, do_sample=False)
    infopt.optimize(m, [Attention("flash_attention_2")])
    out = m.generate(prompt.cuda(), max_new_tokens=8, do_sample=False)
    assert out.shape == ref.shape
