import pytest
import torch

import infopt
from infopt.compile import Compile
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.kvcache import Static


def test_compile_requires_static_cache(llama):
    with pytest.raises(RecipeError, match="requires kvcache:static"):
        infopt.optimize(llama, [Compile()])


def test_reduce_overhead_needs_cuda(llama):
    with pytest.raises(IncompatibleModelError, match="CUDA graphs"):
        infopt.optimize(llama, [Static(max_length=64), Compile(mode="reduce-overhead")])


def test_compiled_forward_token_identical_and_undo(llama, prompt):
    ref = llama.generate(prompt, max_new_tokens=8, do_sample=False)
    infopt.optimize(llama, [Static(max_length=64), Compile(backend="eager")])
    assert "forward" in llama.__dict__
    out = llama.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    infopt.undo(llama)
    assert "forward" not in llama.__dict__
