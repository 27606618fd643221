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


@pytest.mark.gpu
def test_flex_same_greedy_tokens_on_cuda(prompt):
    # flex attention compiles its kernel on first use: one architecture is enough here
    ref_model = tiny_model("llama").cuda()
    p = prompt.cuda()
    ref = ref_model.generate(p, max_new_tokens=12, do_sample=False)
    m = tiny_model("llama").cuda()
    infopt.optimize(m, [Attention("flex")])
    assert m.config._attn_implementation == "flex_attention"
    assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False), ref)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("with_static", [False, True])
def test_flex_refused_on_cpu_untouched(llama, with_static):
    # Inductor's C++ flex kernel reads key rows past the cache's end on some decode shapes (benchmarks/studies/
    # flex_cpu_probe.py): generated tokens came out as id 0 now and then; refused before anything changes
    from infopt.kvcache import Static

    from ..conftest import assert_state_equal, state_snapshot

    snap = state_snapshot(llama)
    steps = [Attention("flex")] + ([Static(max_length=128)] if with_static else [])
    with pytest.raises(IncompatibleModelError, match="flex on CPU: .* reads key rows past the end.* Use backend 'sdpa'"):
        infopt.optimize(llama, steps)
    with pytest.raises(IncompatibleModelError, match="flex on CPU"):
        set_backend_(llama, "flex")
    assert_state_equal(llama, snap)
    assert llama.config._attn_implementation == "sdpa" and "generate" not in llama.__dict__


def test_unknown_backend():
    with pytest.raises(RecipeError, match="allowed: eager, sdpa, sdpa_gqa, flash_attention_2, flex"):
        Attention("fast")


def test_flash_attention_refused_on_cpu(llama, monkeypatch):
    import infopt.core.availability as av

    monkeypatch.setattr(av, "is_available", lambda m: True)  # pretend flash-attn is installed
    with pytest.raises(IncompatibleModelError, match="CUDA only"):
        infopt.optimize(llama, [Attention("flash_attention_2")])


def _kernels(prof) -> set[str]:
    return {e.name for e in prof.events()}


def _flash_attn_ran(names: set[str]) -> bool:
    """flash-attn's own work in a profile: its custom ops (``flash_attn::_flash_attn_forward``, flash-attn >= 2.7)
    or its CUDA kernels (``flash_fwd_kernel``, ``flash_fwd_splitkv_kernel``), which PyTorch's SDPA copy of the same
    kernels names ``pytorch_flash::flash_fwd_kernel``."""
    return any(n.startswith("flash_attn::") or ("flash_fwd" in n and "pytorch_flash" not in n) for n in names)


@pytest.mark.gpu
def test_flash_attention_on_cuda(prompt):
    pytest.importorskip("flash_attn", reason="flash-attn not installed (pip install 'infopt[flash]')")
    from torch.profiler import ProfilerActivity, profile

    from tests.attention.helpers import assert_greedy_close

    ref = tiny_model("llama", dtype=torch.bfloat16).cuda()
    m = tiny_model("llama", dtype=torch.bfloat16).cuda()
    infopt.optimize(m, [Attention("flash_attention_2")])
    assert m.config._attn_implementation == "flash_attention_2"
    p = prompt.cuda()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = m.generate(p, max_new_tokens=8, do_sample=False)
    names = _kernels(prof)
    seen = sorted(n for n in names if "flash" in n.lower() or "attention" in n.lower() or "fmha" in n.lower())
    assert _flash_attn_ran(names), f"no flash-attn op or kernel in the profile; attention-like events: {seen}"
    sdpa = [n for n in names if "scaled_dot_product" in n or "pytorch_flash" in n or "fmha" in n.lower()]
    assert not sdpa, f"SDPA ran under flash_attention_2: {sdpa}"
    # bf16: the two flash kernels tile the sums differently; identical up to a near-tie (see the helper)
    assert_greedy_close(ref, p, out[0, p.shape[1]:].tolist(), 8)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"
