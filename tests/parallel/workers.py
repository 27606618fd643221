"""Functions the parallel tests run on every rank through ``infopt.parallel.launch`` (module level: picklable).

Each returns plain numbers and booleans per rank; the tests assert on them in the parent process.
"""

from __future__ import annotations

import torch

from infopt.quantize.formats import a8

PROMPT = [[1, 17, 400, 23, 9, 1200, 5]]
NEW_TOKENS = 64


def rel_err(ref: torch.Tensor, x: torch.Tensor) -> float:
    """max |x - ref| / max |ref|."""
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max())


def _greedy(model, ids, n=NEW_TOKENS, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, snap) -> bool:
    now = model.state_dict()
    return set(now) == set(snap) and all(torch.equal(now[k], v) for k, v in snap.items())


def tiny(arch: str, **kw):
    from infopt.models import tiny_model

    if arch == "llama-bias":  # untied head, biases on every projection (o_proj/down_proj bias added once)
        import transformers as tf

        cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        m = tf.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random non-zero biases so a bias added N times would show
            for name, p in m.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        return m.eval()
    return tiny_model(arch, **kw)


def reference(model, quant=None):
    """``(logits, greedy tokens)`` of ``model`` (after ``quant``) in this single process."""
    from infopt.quantize import quantize_

    ids = torch.tensor(PROMPT)
    if quant is not None:
        quantize_(model, quant, keep_original="memory")
    with torch.no_grad():
        logits = model(ids).logits
    return logits, _greedy(model, ids)


def tp_case(model, quant=None, ref=None, dtensor=False):
    """Reference (one process) vs tensor parallel on the same model: logits, greedy tokens, bytes, undo.

    ``ref``: ``(logits, tokens)`` computed elsewhere (once, by the parent process), else computed here."""
    import infopt
    from infopt.parallel import local_bytes, tensor_parallel_
    from infopt.quantize import quantize_

    ids = torch.tensor(PROMPT, device=next(model.parameters()).device)
    snap = _state(model)  # undo reverts the quantization too: it restores this float model
    with torch.no_grad():
        float_logits = model(ids).logits
    if quant is not None:
        quantize_(model, quant, keep_original="memory")
    if ref is None:
        with torch.no_grad():
            ref_logits = model(ids).logits
        ref_tokens = _greedy(model, ids)
    else:
        ref_logits, ref_tokens = ref
    before = local_bytes(model)
    tensor_parallel_(model, dtensor=dtensor)
    after = local_bytes(model)
    with torch.no_grad():
        logits = model(ids).logits
    tokens = _greedy(model, ids)
    out = {
        "rel_err": rel_err(ref_logits, logits),
        "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
        "n_tokens": int(tokens.shape[1] - ids.shape[1]),
        "bytes_ratio": after / before,
        "vocab_parallel": model._infopt_parallel["vocab_parallel"],
        "q_proj": type(model.model.layers[0].self_attn.q_proj).__name__,
        "o_proj": type(model.model.layers[0].self_attn.o_proj).__name__,
        "q_proj_dtensor": type(getattr(model.model.layers[0].self_attn.q_proj, "weight", None)).__name__ == "DTensor",
        "q_proj_kernel": _kernel_of(model.model.layers[0].self_attn.q_proj),
        "o_proj_kernel": _kernel_of(getattr(model.model.layers[0].self_attn.o_proj, "inner", None)),
    }
    infopt.undo(model)
    with torch.no_grad():
        out["undo_logits_equal"] = bool(torch.equal(model(ids).logits, float_logits))
    out["undo_state_equal"] = _same_state(model, snap)
    return out


def _kernel_of(m) -> str | None:
    """A quantized layer's layout (what a shard must keep from its layer)."""
    return getattr(m, "layout", None)


def tp_tiny_families():
    from infopt.quantize import Int4WeightOnly, Int8WeightOnly

    res = {arch: tp_case(tiny(arch)) for arch in ("llama", "qwen2", "gemma", "llama-bias")}
    res["llama-dtensor"] = tp_case(tiny("llama"), dtensor=True)
    res["llama-bias-dtensor"] = tp_case(tiny("llama-bias"), dtensor=True)
    res["llama-bf16"] = tp_case(tiny("llama", dtype=torch.bfloat16))
    res["llama-int8"] = tp_case(tiny("llama"), Int8WeightOnly(compute_dtype="float32"))
    res["llama-int8-g32"] = tp_case(tiny("llama"), Int8WeightOnly(group_size=32, compute_dtype="float32"))
    res["llama-int4"] = tp_case(tiny("llama", hidden_size=128), Int4WeightOnly(group_size=32))
    if a8.available():  # int8 activations: the shards keep the layers' kernels
        res["llama-int8-a8"] = tp_case(tiny("llama"), Int8WeightOnly(activations="int8"))
        res["llama-int4-a8"] = tp_case(tiny("llama", hidden_size=128), Int4WeightOnly(group_size=32, activations="int8"))
    return res


def pipeline_case(arch="llama", micro_batches=4, batch=False):
    import infopt
    from infopt.parallel import local_bytes, pipeline_parallel_

    model = tiny(arch, num_layers=4)
    if batch:  # two prompts, the shorter one left-padded: the 4-D mask is sliced per chunk
        ids = torch.tensor([[2, 2, 2, 1, 17, 400, 23, 9], [1, 88, 17, 400, 23, 9, 1200, 5]])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    else:
        ids, mask = torch.tensor(PROMPT), None
    snap = _state(model)
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
    ref_tokens = _greedy(model, ids, attention_mask=mask)
    before = local_bytes(model.model.layers)
    pipeline_parallel_(model, stages=torch.distributed.get_world_size(), micro_batches=micro_batches)
    after = local_bytes(model.model.layers)
    ref_len = ids.shape[1]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    tokens = _greedy(model, ids, attention_mask=mask)
    out = {"rel_err": rel_err(ref_logits, logits), "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
           "layer_bytes_ratio": after / before, "layers": list(model._infopt_parallel["layers"]),
           "prefill_chunks": max(slot.chunks for slot in model.model.layers), "prompt_len": ref_len}
    infopt.undo(model)
    out["undo_state_equal"] = _same_state(model, snap)
    with torch.no_grad():
        out["undo_logits_equal"] = bool(torch.equal(model(ids, attention_mask=mask).logits, ref_logits))
    return out


def pipeline_recipe(steps):
    """``{parallel: {pipeline: 2}}`` plus ``steps`` through optimize, against the same steps in one process."""
    import infopt

    ids = torch.tensor(PROMPT)
    one = tiny("llama", num_layers=4)
    infopt.optimize(one, steps)
    ref = _greedy(one, ids, n=24)
    m = tiny("llama", num_layers=4)
    infopt.optimize(m, [{"parallel": {"pipeline": torch.distributed.get_world_size()}}, *steps])
    return {"tokens_equal": bool(torch.equal(_greedy(m, ids, n=24), ref)), "steps": [s.key for s in m.infopt.steps]}


def pipeline_cases():
    return {"mb4": pipeline_case(), "mb1": pipeline_case(micro_batches=1), "batch": pipeline_case(batch=True),
            "qwen2": pipeline_case("qwen2"),
            "recipe-int8-static": pipeline_recipe([{"quantize": {"method": "int8", "compute_dtype": "float32"}},
                                                   {"kvcache": {"kind": "static", "max_length": 64}}])}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test asserts on the type name and the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals():
    """Bad input under a live process group: each call must fail with a clear error and leave the model as it was."""
    import infopt
    from infopt.parallel import pipeline_parallel_, tensor_parallel_
    from infopt.quantize import BnbInt8, quantize_

    out = {}
    m = tiny("llama", hidden_size=72, num_heads=9, num_kv_heads=3)  # 9/3 heads, like the default model
    snap = _state(m)
    out["heads"] = _error(lambda: tensor_parallel_(m))
    out["heads_recipe"] = _error(lambda: infopt.optimize(m, {"parallel": {"tensor": 2}}))
    out["heads_untouched"] = _same_state(m, snap) and not infopt.core.has_patches(m)
    m = tiny("llama")
    quantize_(m, BnbInt8(), include=["*.mlp.*"], keep_original="memory")
    snap = _state(m)
    out["bnb"] = _error(lambda: tensor_parallel_(m))
    out["bnb_untouched"] = _same_state(m, snap)
    m = tiny("llama")
    out["size_mismatch"] = _error(lambda: infopt.optimize(m, {"parallel": {"tensor": 3}}))
    out["stages_mismatch"] = _error(lambda: pipeline_parallel_(m, stages=3))
    out["gpt2"] = _error(lambda: tensor_parallel_(tiny("gpt2")))
    twice = tiny("llama")
    tensor_parallel_(twice)
    out["twice"] = _error(lambda: pipeline_parallel_(twice))
    infopt.undo(twice)
    out["untouched"] = not infopt.core.has_patches(m)
    return out


def recipe_tensor():
    """``{parallel: {tensor: 2}}`` through optimize, composed with int8 and a static KV cache."""
    import infopt

    m = tiny("llama")
    ids = torch.tensor(PROMPT)
    ref = _greedy(m, ids, n=16)
    infopt.optimize(m, {"steps": [{"parallel": {"tensor": 2}}, {"kvcache": {"kind": "static", "max_length": 64}}]})
    tokens = _greedy(m, ids, n=16)
    report = m.infopt
    out = {"tokens_equal": bool(torch.equal(tokens, ref)), "steps": [s.key for s in report.steps],
           "notes": report.steps[0].notes, "stats": report.steps[0].stats}
    infopt.undo(m)
    return out


def refusals_and_recipe():
    return {"refusals": refusals(), "recipe": recipe_tensor()}


def raise_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one broke on purpose")
    return dist.get_rank()


def default_model_tp(refs):
    """The default model (9 heads, 3 KV heads) over 3 ranks, float and int8 weight-only.

    ``refs``: ``{"fp32": (logits, tokens), "int8": (...)}`` from one process (the parent computes them once).
    One load serves both cases: ``undo`` after the float case restores the full model, which is then quantized."""
    from infopt.models import load_default

    model, _ = load_default()
    return {name: tp_case(model, quant, ref=refs[name]) for name, quant in default_cases().items()}


def default_cases():
    from infopt.quantize import Int8WeightOnly

    return {"fp32": None, "int8": Int8WeightOnly(compute_dtype="float32")}



def world_of_one(device: str):
    """World size 1 on ``device`` (nccl on one GPU, gloo on CPU): the init path and a sharded forward there."""
    m = tiny("llama").to(device)
    return tp_case(m)


# --- expert parallelism -------------------------------------------------------------------------------------------

BATCH_IDS = [[2, 2, 2, 1, 17, 400, 23, 9], [1, 88, 17, 400, 23, 9, 1200, 5]]
BATCH_MASK = [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8]


def tiny_moe(arch: str, **kw):
    """A tiny MoE model: an arch of ``infopt.models.MOE_ARCHS``, or ``mixtral-3`` (3 experts, top-2: over 2 ranks
    the experts split unevenly, 2 and 1)."""
    if arch == "mixtral-3":
        import transformers as tf

        cfg = tf.MixtralConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2,
                               bos_token_id=1, eos_token_id=2, pad_token_id=2)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(cfg).eval()
    return tiny(arch, **kw)


def _observe(model, ids, mask):
    """``(logits, routing decisions, greedy tokens)`` of ``model`` on ``ids``."""
    records, remove = _routing_hooks(model)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    routing = list(records)
    remove()
    return logits, routing, _greedy(model, ids, attention_mask=mask)


def _routing_hooks(model):
    """Record the expert ids every experts module receives; returns ``(records, remove)``."""
    from infopt.core.moe import moe_blocks

    records: list[torch.Tensor] = []
    handles = [model.get_submodule(b.experts_fqn).register_forward_pre_hook(
        lambda _m, args: records.append(args[1].detach().clone())) for b in moe_blocks(model)]
    return records, lambda: [h.remove() for h in handles]


def _expert_bytes(model) -> int:
    from infopt.core.moe import moe_blocks
    from infopt.parallel import local_bytes

    return sum(local_bytes(model.get_submodule(b.experts_fqn)) for b in moe_blocks(model))


def ep_case(arch: str, dispatch: str = "all_to_all", quant=None, batch: bool = False):
    """One process vs expert parallel on the same model: logits, routing, greedy tokens, bytes, undo."""
    import infopt
    from infopt.parallel import expert_parallel_, local_bytes
    from infopt.quantize import quantize_

    model = tiny_moe(arch)
    if batch:  # two prompts, one left-padded: 16 prefill rows, 2 per decode step
        ids, mask = torch.tensor(BATCH_IDS), torch.tensor(BATCH_MASK)
    else:  # 7 prefill rows (split 4/3), then 1 per decode step (rank 1 sends none)
        ids, mask = torch.tensor(PROMPT), None
    snap = _state(model)
    with torch.no_grad():
        float_logits = model(ids, attention_mask=mask).logits
    if quant is not None:
        quantize_(model, quant, keep_original="memory")
    ref_logits, ref_routing, ref_tokens = _observe(model, ids, mask)
    before, experts_before = local_bytes(model), _expert_bytes(model)
    expert_parallel_(model, dispatch=dispatch)
    after, experts_after = local_bytes(model), _expert_bytes(model)
    logits, routing, tokens = _observe(model, ids, mask)
    experts = model.get_submodule(infopt.core.moe.moe_blocks(model)[0].experts_fqn)
    out = {
        "rel_err": rel_err(ref_logits, logits),
        "routing_equal": len(routing) == len(ref_routing)
        and all(torch.equal(a, b) for a, b in zip(routing, ref_routing, strict=True)),
        "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
        "n_tokens": int(tokens.shape[1] - ids.shape[1]),
        "experts_bytes_ratio": experts_after / experts_before,
        "other_bytes_equal": before - experts_before == after - experts_after,
        "experts": [experts.start, experts.stop],
        "experts_type": type(experts).__name__,
        "local_type": type(experts.local).__name__,
        "blocks_found": len(infopt.core.moe.moe_blocks(model)),
    }
    infopt.undo(model)
    with torch.no_grad():
        out["undo_logits_equal"] = bool(torch.equal(model(ids, attention_mask=mask).logits, float_logits))
    out["undo_state_equal"] = _same_state(model, snap)
    return out


def ep_recipe(steps):
    """``{parallel: {expert: 2}}`` plus ``steps`` through optimize, against the same steps in one process."""
    import infopt

    ids = torch.tensor(PROMPT)
    one = tiny_moe("mixtral")
    infopt.optimize(one, steps)
    ref = _greedy(one, ids, n=24)
    import warnings

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    m = tiny_moe("mixtral")
    with warnings.catch_warnings(record=True) as caught:  # a compile step that falls back to eager warns
        warnings.simplefilter("always")
        infopt.optimize(m, [{"parallel": {"expert": torch.distributed.get_world_size()}}, *steps])
        tokens = _greedy(m, ids, n=24)
    import tempfile

    report = m.infopt
    step = next(s for s in report.steps if s.key == "parallel")
    with tempfile.TemporaryDirectory() as folder:
        saved = _error(lambda: m.save_pretrained(folder))
    out = {"tokens_equal": bool(torch.equal(tokens, ref)), "steps": [s.key for s in report.steps],
           "notes": step.notes, "stats": step.stats, "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
           "warnings": [str(w.message) for w in caught if "infopt" in str(w.message)], "save_pretrained": saved}
    infopt.undo(m)
    return out


def ep_refusals():
    """Bad input under a live process group: each fails with a clear error and leaves the model as it was."""
    import infopt
    from infopt.parallel import expert_parallel_, tensor_parallel_
    from infopt.quantize import Int8WeightOnly, quantize_

    out = {}
    m = tiny_moe("mixtral")
    snap = _state(m)
    out["size_mismatch"] = _error(lambda: infopt.optimize(m, {"parallel": {"expert": 3}}))
    out["dense"] = _error(lambda: expert_parallel_(tiny("llama")))
    out["dense_recipe"] = _error(lambda: infopt.optimize(tiny("llama"), {"parallel": {"expert": 2}}))
    out["tensor_on_moe"] = _error(lambda: tensor_parallel_(m))
    import infopt.parallel.expert as ep

    real, calls = ep._local_experts, []

    def fail_on_second_block(*args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no room for block 2 on purpose")
        return real(*args)

    ep._local_experts = fail_on_second_block  # the first block is swapped (and its experts spilled), then this fails
    try:
        out["midway"] = _error(lambda: expert_parallel_(m))
    finally:
        ep._local_experts = real
    out["untouched"] = _same_state(m, snap) and not infopt.core.has_patches(m)
    expert_parallel_(m)
    out["twice"] = _error(lambda: tensor_parallel_(m))
    out["quantize_after"] = _error(lambda: quantize_(m, Int8WeightOnly()))
    infopt.undo(m)
    out["undone"] = _same_state(m, snap)
    return out


EP_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def ep_cases():
    from infopt.quantize import Int4WeightOnly, Int8WeightOnly

    res = {arch: ep_case(arch) for arch in EP_ARCHS}
    res["mixtral-all_reduce"] = ep_case("mixtral", "all_reduce")
    res["qwen2_moe-all_reduce"] = ep_case("qwen2_moe", "all_reduce")
    res["mixtral-batch"] = ep_case("mixtral", batch=True)
    res["qwen2_moe-batch-all_reduce"] = ep_case("qwen2_moe", "all_reduce", batch=True)
    res["mixtral-3"] = ep_case("mixtral-3")
    res["mixtral-int8"] = ep_case("mixtral", quant=Int8WeightOnly(compute_dtype="float32"))
    res["mixtral-int4"] = ep_case("mixtral", quant=Int4WeightOnly(group_size=32))
    res["recipe-int8-static"] = ep_recipe([{"quantize": {"method": "int8", "compute_dtype": "float32"}},
                                           {"kvcache": {"kind": "static", "max_length": 64}}])
    # the exchange is one opaque custom op inside the compiled decode step (eager backend: tracing, not codegen)
    res["recipe-static-compile"] = ep_recipe([{"kvcache": {"kind": "static", "max_length": 64}},
                                              {"compile": {"backend": "eager", "warmup_lengths": [8]}}])
    res["refusals"] = ep_refusals()
    return res


def expert_parallel_world_of_one(device: str):
    """World size 1 on ``device`` (nccl on one GPU, gloo on CPU): the exchange's collectives (all-to-all, all-gather)
    on that device's tensors."""
    import infopt
    from infopt.parallel import expert_parallel_

    m = tiny_moe("mixtral").to(device)
    ids = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        ref = m(ids).logits
    ref_tokens = _greedy(m, ids)
    out = {}
    for dispatch in ("all_to_all", "all_reduce"):
        expert_parallel_(m, dispatch=dispatch)
        with torch.no_grad():
            out[f"{dispatch}_rel_err"] = rel_err(ref, m(ids).logits)
        out[f"{dispatch}_tokens_equal"] = bool(torch.equal(_greedy(m, ids), ref_tokens))
        infopt.undo(m)
    with torch.no_grad():
        out["undo_logits_equal"] = bool(torch.equal(m(ids).logits, ref))
    return out
