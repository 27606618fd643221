import pytest
import torch
from torch import nn

import infopt
from infopt.compile import compile_stats
from infopt.compile.fuse import fuse_projections_, unfuse_projections_
from infopt.core.errors import RecipeError
from infopt.models import tiny_model

IDS = torch.tensor([[1, 17, 400, 23, 9, 5, 88]])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "qwen3"])
def test_fused_model_is_the_same_model(arch):
    # same tokens, same state_dict (keys, values, parameter objects), one storage per group, no extra memory
    ref, m = tiny_model(arch), tiny_model(arch)
    params = dict(m.named_parameters())
    groups = fuse_projections_(m)
    assert len(groups) == 2 * m.config.num_hidden_layers
    assert dict(m.named_parameters()) == params  # the same Parameter objects
    sd, want = m.state_dict(), ref.state_dict()
    assert list(sd) == list(want) and all(torch.equal(sd[k], want[k]) for k in want)
    attn = m.model.layers[0].self_attn
    assert len({_storage(attn.q_proj.weight), _storage(attn.k_proj.weight), _storage(attn.v_proj.weight)}) == 1
    if attn.q_proj.bias is not None:  # qwen2: the biases are fused too
        assert _storage(attn.q_proj.bias) == _storage(attn.v_proj.bias)
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in ref.parameters())
    kw = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(m.generate(IDS, **kw), ref.generate(IDS, **kw))
    torch.testing.assert_close(m(IDS).logits, ref(IDS).logits)
    assert all(g.calls > 0 for g in groups)  # the fused matmul ran, for every group


def test_a_projection_called_on_another_input_computes_its_own():
    m = tiny_model()
    attn = m.model.layers[0].self_attn
    fuse_projections_(m)
    x1, x2 = torch.randn(1, 3, m.config.hidden_size), torch.randn(1, 3, m.config.hidden_size)
    q = attn.q_proj(x1)
    k = attn.k_proj(x2)  # not the input q_proj saw
    v = attn.v_proj(x1)
    torch.testing.assert_close(q, nn.functional.linear(x1, attn.q_proj.weight))
    torch.testing.assert_close(k, nn.functional.linear(x2, attn.k_proj.weight))
    torch.testing.assert_close(v, nn.functional.linear(x1, attn.v_proj.weight))


def test_weights_written_or_moved_after_fusion_are_used():
    # load_state_dict writes in place through the views; .to() gives each weight storage of its own: both must
    # reach the fused matmul (the group fuses again on the next eager forward)
    # (inference: with grad mode on, each layer runs its own linear and the group is not used)
    m, other = tiny_model(), tiny_model(seed=1)
    groups = fuse_projections_(m)
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(m(IDS).logits, other(IDS).logits)
        m.to(torch.float64)
        torch.testing.assert_close(m(IDS).logits, other.to(torch.float64)(IDS).logits)
    assert all(g.refuses == 1 for g in groups)
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.float64 and _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight)


def test_undo_gives_each_layer_its_own_storage_and_forward():
    ref, m = tiny_model(), tiny_model()
    groups = fuse_projections_(m)
    unfuse_projections_(groups)
    attn = m.model.layers[0].self_attn
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    assert "forward" not in attn.q_proj.__dict__ and "_infopt_fused" not in attn.k_proj.__dict__
    sd, want = m.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_quantized_layers_without_a_fused_form_and_patched_layers_are_left_alone():
    m = tiny_model()
    infopt.optimize(m, [{"quantize": {"method": "int4", "group_size": 32}}])  # the CPU kernel's packed layout
    assert fuse_projections_(m) == []
    m1 = tiny_model()
    infopt.optimize(m1, [{"quantize": {"method": "int8", "group_size": 16}}])  # group scales: not per channel
    assert fuse_projections_(m1) == []
    m2 = tiny_model()
    m2.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)
    groups = fuse_projections_(m2)
    assert len(groups) == 2 * m2.config.num_hidden_layers - 1  # layer 0's q/k/v: a hook on k_proj


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_step_fuses_by_default_token_identical(dtype):
    # fp32: the fused groups also run on oneDNN's packed weights where the torch build has them
    ref, m = tiny_model(dtype=dtype), tiny_model(dtype=dtype)
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}, {"compile": {"mode": "default"}}])
    group = m.model.layers[0].self_attn.q_proj._infopt_fused
    kw = dict(max_new_tokens=20, do_sample=False)
    assert torch.equal(m.generate(IDS, **kw), ref.generate(IDS, **kw))
    stats = compile_stats(m)
    assert stats.compiles == 1 and not stats.eager_shapes and stats.compiles_after_warmup == 0
    assert group.calls > 0
    infopt.undo(m)
    assert "_infopt_fused" not in m.model.layers[0].self_attn.q_proj.__dict__
    assert torch.equal(m.generate(IDS, **kw), ref.generate(IDS, **kw))


@pytest.mark.slow
def test_compiled_packed_fused_step_sees_weights_written_in_place():
    # the packed copy of a fused buffer is keyed on the buffer's version; a write through a layer's view bumps it
    # hidden 768: the fused q/k/v (1152 x 768) is large enough to be packed
    m, ref = tiny_model(hidden_size=768, num_heads=8), tiny_model(hidden_size=768, num_heads=8, seed=1)
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}, {"compile": {"mode": "default"}}])
    group = m.model.layers[0].self_attn.q_proj._infopt_fused
    from infopt.ops.packed_linear import can_pack

    assert group.packed is not None or not can_pack()
    m.load_state_dict(ref.state_dict())
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(m.generate(IDS, **kw), ref.generate(IDS, **kw))


def test_compile_step_fuse_projections_off_and_bad_value():
    m = tiny_model()
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}, {"compile": {"mode": "default", "fuse_projections": False,
                                                                     "warmup_lengths": []}}])
    assert "_infopt_fused" not in m.model.layers[0].self_attn.q_proj.__dict__
    with pytest.raises(RecipeError, match="fuse_projections"):
        infopt.optimize(tiny_model(), [{"kvcache": {"kind": "static"}}, {"compile": {"fuse_projections": "yes"}}])


def test_a_fused_model_saves_and_loads_in_plain_transformers(tmp_path):
    # safetensors refuses views of a shared buffer: state_dict hands out tensors of their own
    from transformers import AutoModelForCausalLM

    ref, m = tiny_model(), tiny_model()
    fuse_projections_(m)
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    want = ref.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    # keep_vars=True still gives the parameters themselves
    assert m.state_dict(keep_vars=True)["model.layers.0.self_attn.q_proj.weight"] is m.model.layers[0].self_attn.q_proj.weight


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, {"method": "int8"}, {"method": "int8", "cuda_kernel": "gemv"},
                                   {"method": "int4", "group_size": 32, "cuda_kernel": "gemv"},
                                   {"method": "fp8", "activations": "none"}],
                         ids=["float", "int8", "int8-gemv", "int4-gemv", "fp8-wo"])
def test_gpu_fast_fused_step_runs_fewer_kernels_same_tokens(quant):
    """On CUDA the point of fusing is the kernel count: per decode token the fused step launches fewer kernels
    (two matmuls per layer where there were five), with the same greedy tokens (fp32, TF32 off); for float and for
    quantized layers (QuantizedFusedGroup)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(model, ids, kw):
        model.generate(ids, **kw)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0), out

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ids = IDS.cuda()
        kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
        counts, outs = {}, {}
        for fuse in (False, True):
            m = tiny_model(num_layers=4).cuda()
            infopt.optimize(m, [*([{"quantize": quant}] if quant else []), {"kvcache": {"kind": "static"}},
                                {"compile": {"mode": "reduce-overhead", "fuse_projections": fuse}}])
            counts[fuse], outs[fuse] = kernels(m, ids, kw)
        assert torch.equal(outs[True], outs[False])
        # 4 layers x 3 matmuls fewer per decode token (23 tokens) at least
        assert counts[True] <= counts[False] - 4 * 3 * 20, counts
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_gradients_reach_each_fused_and_packed_weight():
    # the fused buffer and the packed copies are no parameters: with grad mode on, each layer runs its own linear
    from infopt.compile import packed
    from infopt.ops.packed_linear import can_pack

    ref, model = tiny_model(), tiny_model()
    groups = fuse_projections_(model)
    layers = packed.pack_linears_(model, min_elements=0) if can_pack() else []
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for m in (ref, model):
        m(ids).logits.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    calls = groups[0].calls
    with torch.no_grad():  # inference still runs the fused matmul
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert groups[0].calls == calls + 1
    packed.unpack_linears_(layers)
    unfuse_projections_(groups)


@pytest.mark.parametrize("quant", [{"method": "int8"}, {"method": "int8", "compute_dtype": "bfloat16"},
                                   {"method": "int4", "group_size": 32, "cuda_kernel": "gemv"},
                                   {"method": "fp8", "activations": "none"}, {"method": "fp8"}],
                         ids=["int8-f32", "int8-bf16", "int4-gemv", "fp8-wo", "fp8-dynamic"])
def test_quantized_projections_fuse_into_one_layer_of_their_class(quant):
    """Per-channel int8 layers, int4 layers in the gemv layout and per-row FP8 layers: codes and scales move into shared buffers (the
    layers' become views), one hidden layer of the class computes the group; outputs, state_dict and undo as
    before; a load into the layers is seen (in place) or refused and fused again (new tensors)."""
    from infopt.compile.fuse import QuantizedFusedGroup

    ref, m = tiny_model(), tiny_model()
    for model in (ref, m):
        if quant["method"] == "fp8":  # the quantize step refuses FP8 on CPU (no fp8 matmul): the layers directly
            from infopt.quantize.formats.fp8 import FP8Linear

            for layer in model.model.layers:
                for parent in (layer.self_attn, layer.mlp):
                    for name, child in list(parent.named_children()):
                        if isinstance(child, torch.nn.Linear):
                            setattr(parent, name, FP8Linear.from_float(child, activations=quant.get("activations",
                                                                                                    "dynamic")))
        else:
            infopt.optimize(model, [{"quantize": quant}])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        want = ref(IDS).logits
        groups = fuse_projections_(m)
        assert len(groups) == 2 * m.config.num_hidden_layers
        assert all(isinstance(g, QuantizedFusedGroup) for g in groups)
        q = m.model.layers[0].self_attn.q_proj
        assert q.__dict__["_infopt_fused"].intact()
        assert torch.equal(m(IDS).logits, want) and groups[0].calls == 1
        saved = m.state_dict()
        assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)
        name = groups[0].tensors[0]
        assert all(saved[f"model.layers.0.self_attn.{p}.{name}"].untyped_storage().data_ptr()
                   != groups[0].fused[name].untyped_storage().data_ptr() for p in ("q_proj", "k_proj", "v_proj"))
        m.load_state_dict(ref.state_dict())
        assert torch.equal(m(IDS).logits, want)
        m.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)  # k alone: its own forward
        unfuse_projections_(groups)
        assert "forward" not in q.__dict__ and torch.equal(m(IDS).logits, want)


@pytest.mark.slow
def test_compile_step_fuses_int8_projections_token_identical():
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(ref, [{"quantize": {"method": "int8"}}])
    infopt.optimize(m, [{"quantize": {"method": "int8"}}, {"kvcache": {"kind": "static"}},
                        {"compile": {"mode": "default"}}])
    group = m.model.layers[0].mlp.gate_proj._infopt_fused
    kw = dict(max_new_tokens=20, do_sample=False)
    assert torch.equal(m.generate(IDS, **kw), ref.generate(IDS, **kw))
    assert group.calls > 0 and compile_stats(m).compiles_after_warmup == 0
    infopt.undo(m)
    assert "_infopt_fused" not in m.model.layers[0].mlp.gate_proj.__dict__
