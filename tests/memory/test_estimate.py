"""infopt.memory: analytic estimates checked against real tiny models, filled caches and the default model."""

from __future__ import annotations

import doctest
import json
from importlib import resources

import pytest
import torch
import transformers as tf

import infopt.memory as memory
from infopt.cli.memory import format_estimate
from infopt.core.errors import InfoptError
from infopt.core.introspect import param_bytes
from infopt.memory import KNOWN_CONFIGS, GpuFit, MemoryInputError, arch_spec, estimate_memory
from infopt.models import TINY_ARCHS, tiny_model


def unique_param_count(model) -> int:
    """Parameters, each storage once (tied embeddings once)."""
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    return n


def filled_kv_bytes(model, cache, *, batch: int, length: int) -> int:
    """Run a prompt of ``length`` tokens through ``model`` into ``cache`` and sum the bytes it holds."""
    ids = torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    # each layer holds keys and values [batch, kv_heads, tokens, head_dim]
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def peak_prefill_bytes(model, *, batch: int, length: int) -> tuple[int, int]:
    """``(peak bytes allocated, KV bytes)`` of one prefill forward on CPU, from the profiler's allocation events.

    The peak counts everything allocated during the call (activations, masks, logits, the cache);
    the weights exist before it and are not counted.
    """
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)  # as generate's prefill
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    if not events:
        pytest.skip("this torch build's profiler records no CPU allocation events")
    live = peak = 0
    for _, nbytes in events:  # +size on allocation, -size on free
        live += nbytes
        peak = max(peak, live)
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return peak, kv


def _tiny(arch: str, **kw):
    # gemma3 with 6 layers: 5 sliding-window layers (window 64) and 1 full-attention layer
    return tiny_model(arch, num_layers=6 if arch == "gemma3" else 2, **kw)


_SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
# families estimate_memory models beyond TINY_ARCHS, as (config class, extra kwargs)
_EXTRA = {
    "mixtral-moe": (tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": (tf.Gemma2Config, dict(head_dim=16)),
    "llama-biases-untied": (tf.LlamaConfig, dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen2-sliding": (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "mistral-sliding": (tf.MistralConfig, dict(sliding_window=16)),
}


def _extra(name: str):
    cls, kw = _EXTRA[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(cls(**_SMALL, **kw)).eval()


# ---------------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_weights_match_tiny_model(arch):
    model = _tiny(arch)
    est = estimate_memory(model, seq_len=64)
    assert est.weight_dtype == "float32"  # auto: the model's own dtype
    assert est.num_params == unique_param_count(model)  # exact: every matrix, bias and norm counted
    actual = param_bytes(model)  # parameters + buffers (rope inv_freq, a few bytes)
    assert abs(est.weights_bytes - actual) / actual < 0.10
    assert abs(est.weights_bytes - actual) < 1024  # in practice only the buffers differ


@pytest.mark.parametrize("name", list(_EXTRA))
def test_weights_match_other_families(name):
    model = _extra(name)
    est = estimate_memory(model, seq_len=64)
    assert est.num_params == unique_param_count(model)
    assert abs(est.weights_bytes - param_bytes(model)) < 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weights_follow_model_dtype(dtype):
    model = tiny_model("qwen2", dtype=dtype)
    est = estimate_memory(model, seq_len=64)
    assert est.weight_dtype == est.kv_dtype == str(dtype).removeprefix("torch.")
    assert abs(est.weights_bytes - param_bytes(model)) < 1024


def test_quantized_weights_keep_embeddings_in_float():
    fp = estimate_memory("llama-3-8b", weight_dtype="bfloat16")
    i8 = estimate_memory("llama-3-8b", weight_dtype="int8")
    i4 = estimate_memory("llama-3-8b", weight_dtype="int4")
    assert i8.float_dtype == i4.float_dtype == "bfloat16"  # the config's dtype
    for q in (i8, i4):
        assert q.weights_breakdown["embeddings"] == fp.weights_breakdown["embeddings"]
        assert q.weights_breakdown["lm_head"] == fp.weights_breakdown["lm_head"]
        assert q.num_params == fp.num_params
    # int8: 1 byte per value + 4 bytes per output row; int4: half a byte + 4 bytes per 128-input group
    assert i8.weights_breakdown["mlp"] * 2 == fp.weights_breakdown["mlp"]
    assert i4.weights_breakdown["mlp"] * 4 == fp.weights_breakdown["mlp"]
    assert i4.weights_breakdown["quant_scales"] / (i4.weights_breakdown["attention"] + i4.weights_breakdown["mlp"]) \
        == pytest.approx(4 / 64)
    assert fp.weights_bytes > i8.weights_bytes > i4.weights_bytes
    assert estimate_memory("llama-3-8b", weight_dtype="int4", float_dtype="float32").weights_breakdown[
        "embeddings"] == 2 * fp.weights_breakdown["embeddings"]


# ---------------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_kv_matches_filled_dynamic_cache(arch):
    model = _tiny(arch)
    length = 100  # > gemma3's 64-token window
    actual = filled_kv_bytes(model, tf.DynamicCache(config=model.config), batch=2, length=length)
    est = estimate_memory(model, batch=2, seq_len=length)
    # sliding layers of a DynamicCache keep window - 1 tokens; the estimate counts the full window
    assert abs(est.kv_cache_bytes - actual) / actual < 0.10


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_kv_matches_static_cache_exactly(arch):
    model = _tiny(arch)
    length = 100
    actual = filled_kv_bytes(model, tf.StaticCache(config=model.config, max_cache_len=length), batch=1, length=length)
    assert estimate_memory(model, seq_len=length).kv_cache_bytes == actual


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen2-sliding", "mixtral-moe", "gemma2"])
def test_kv_matches_filled_cache_other_families(name):
    model = _extra(name)
    length = 40  # > the 16-token windows
    actual = filled_kv_bytes(model, tf.DynamicCache(config=model.config), batch=1, length=length)
    est = estimate_memory(model, seq_len=length)
    assert abs(est.kv_cache_bytes - actual) / actual < 0.10


@pytest.mark.parametrize("arch, length", [("llama", 512), ("gpt2", 1024), ("gemma3", 1024)])
def test_activations_near_measured_peak(arch, length):
    # gemma3 at 1024 > its 64-token window: transformers materializes a [S, S] mask, which the estimate counts
    model = _tiny(arch, max_positions=2048)
    peak, kv = peak_prefill_bytes(model, batch=2, length=length)
    est = estimate_memory(model, batch=2, seq_len=length)
    assert est.kv_cache_bytes == pytest.approx(kv, rel=0.02)  # sliding layers keep window - 1 tokens
    assert 0.75 < (peak - kv) / est.activations_bytes < 1.25  # a rough estimate, by design


def test_kv_formula_gqa_and_sliding_window():
    # Llama 2 7B fp16: 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token
    assert estimate_memory("llama-2-7b", seq_len=4096).kv_cache_bytes == 4096 * 512 * 1024
    # Llama 3 8B: GQA with 8 KV heads, a quarter of that
    assert estimate_memory("llama-3-8b", seq_len=4096, batch=3).kv_cache_bytes == 3 * 4096 * 128 * 1024
    # Mistral 7B v0.1: every layer slides over 4096 tokens, so the cache stops growing there
    m4k, m32k = (estimate_memory("mistral-7b", seq_len=s).kv_cache_bytes for s in (4096, 32768))
    assert m4k == m32k
    # Gemma 3 text (from a dict): 5 of every 6 layers slide
    spec = arch_spec({"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512, "hidden_size": 256,
                      "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                      "vocab_size": 1000})
    assert spec.layer_windows.count(512) == 10 and spec.layer_windows.count(None) == 2
    assert sum(spec.kv_tokens(4096)) == 10 * 512 + 2 * 4096


def test_kv_quantized_and_tp():
    bf = estimate_memory("llama-3-8b", seq_len=8192)
    i8 = estimate_memory("llama-3-8b", seq_len=8192, kv_dtype="int8")
    assert i8.kv_cache_bytes == bf.kv_cache_bytes // 2 + bf.kv_cache_bytes // 2 // 64 * 4  # + scale/zero per 64
    tp2 = estimate_memory("llama-3-8b", seq_len=8192, tp=2)
    assert tp2.per_device["kv_cache"] == bf.kv_cache_bytes // 2
    assert tp2.per_device["weights"] == -(-bf.weights_bytes // 2)
    tp16 = estimate_memory("llama-3-8b", seq_len=8192, tp=16)  # 8 KV heads on 16 devices: 1 head each
    assert tp16.per_device["kv_cache"] == bf.kv_cache_bytes // 8
    assert any("replicated" in n for n in tp16.notes)


def test_raw_qwen2_dict_without_sliding():
    # Qwen2 config.json files set sliding_window but switch it off with use_sliding_window=false
    d = {**_SMALL, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}
    assert arch_spec(d).layer_windows == (None, None)
    unknown = {**_SMALL, "model_type": "my-own-llama", "sliding_window": 16, "use_sliding_window": False}
    assert arch_spec(unknown).layer_windows == (None, None)
    assert "llama-like" in arch_spec(unknown).notes[0]


# ---------------------------------------------------------------------------------------------- known configs


# public parameter counts (model cards / papers)
_PUBLIC_PARAMS = {"llama-2-7b": 6.74e9, "llama-2-70b": 68.98e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.55e9,
                  "mistral-7b": 7.24e9, "smollm2-135m": 134.5e6}


@pytest.mark.parametrize("name", KNOWN_CONFIGS)
def test_known_configs(name):
    est = estimate_memory(name)
    assert est.num_params == pytest.approx(_PUBLIC_PARAMS[name], rel=0.01)
    assert est.weight_dtype in ("float16", "bfloat16")  # the config's dtype
    assert est.weights_bytes == pytest.approx(2 * est.num_params, rel=0.001)
    assert 0 < est.activations_bytes < est.weights_bytes
    assert est.total_bytes == est.weights_bytes + est.kv_cache_bytes + est.activations_bytes


def test_known_config_files_match_the_list():
    shipped = sorted(p.name[:-5] for p in resources.files("infopt.memory").joinpath("configs").iterdir()
                     if p.name.endswith(".json"))
    assert shipped == sorted(KNOWN_CONFIGS)


def test_llama_2_7b_fp16_is_13_5_gb():
    est = estimate_memory("llama-2-7b", weight_dtype="float16")
    assert est.weights_bytes == pytest.approx(13.5e9, rel=0.05)


def test_fits_and_max_batch_agree():
    est = estimate_memory("llama-3-8b", seq_len=4096)
    h100 = est.fits["H100 80GB"]
    assert isinstance(h100, GpuFit) and h100.fits and h100.max_batch > 1
    at_max = estimate_memory("llama-3-8b", seq_len=4096, batch=h100.max_batch)
    over = estimate_memory("llama-3-8b", seq_len=4096, batch=h100.max_batch + 1)
    assert at_max.fits["H100 80GB"].fits and not over.fits["H100 80GB"].fits
    assert set(est.fits) == set(memory.GPUS)
    big = estimate_memory("llama-3-70b")  # 141 GB of bf16 weights: too big for any single GPU listed
    assert not any(f.fits for f in big.fits.values()) and all(f.max_batch == 0 for f in big.fits.values())
    assert estimate_memory("llama-3-70b", tp=4).fits["H100 80GB"].fits
    assert estimate_memory("llama-3-70b", weight_dtype="int4").fits["H100 80GB"].fits


def test_inputs_accepted(tmp_path):
    model = tiny_model("llama")
    ref = estimate_memory(model, seq_len=64)
    model.config.save_pretrained(tmp_path)
    for x in (model.config, model.config.to_dict(), tmp_path, tmp_path / "config.json", str(tmp_path)):
        est = estimate_memory(x, seq_len=64)
        assert (est.num_params, est.weights_bytes, est.kv_cache_bytes) == \
            (ref.num_params, ref.weights_bytes, ref.kv_cache_bytes), type(x)
    assert estimate_memory("LLAMA-3-8B").name == "llama-3-8b"
    assert estimate_memory("default", weight_dtype="bfloat16").num_params == estimate_memory(
        "smollm2-135m").num_params


def test_to_dict_is_json():
    est = estimate_memory("mistral-7b", weight_dtype="int4", tp=2)
    d = json.loads(json.dumps(est.to_dict()))
    assert d["weights_bytes"] == est.weights_bytes
    assert d["fits"]["H100 80GB"]["max_batch"] == est.fits["H100 80GB"].max_batch
    assert d["spec"]["layer_windows"] == [4096] * 32


# ---------------------------------------------------------------------------------------------- errors


def _cfg(**over):
    return {**_SMALL, "model_type": "llama", **over}


@pytest.mark.parametrize(
    "args, kwargs, field",
    [
        (("llama-3-8b",), dict(weight_dtype="fp8"), "weight_dtype"),
        (("llama-3-8b",), dict(kv_dtype="int2"), "kv_dtype"),
        (("llama-3-8b",), dict(float_dtype="int8"), "float_dtype"),
        (("llama-3-8b",), dict(batch=0), "batch"),
        (("llama-3-8b",), dict(seq_len=-1), "seq_len"),
        (("llama-3-8b",), dict(seq_len=1.5), "seq_len"),
        (("llama-3-8b",), dict(tp=3), "tp"),
        (("llama-3-8b",), dict(tp=True), "tp"),
        (("llama-3-8b",), dict(prefill_chunk=0), "prefill_chunk"),
        (("llama-3-8b",), dict(usable_fraction=1.5), "usable_fraction"),
        (("llama-3-8b",), dict(gpus={"mine": -1}), "gpus"),
        (("no-such-model",), {}, "model"),
        ((42,), {}, "config_or_model"),
        ((_cfg(hidden_size=None),), {}, "hidden_size"),
        (({k: v for k, v in _cfg(model_type="my-llama").items() if k != "hidden_size"},), {}, "hidden_size"),
        ((_cfg(model_type="my-llama", intermediate_size="big"),), {}, "intermediate_size"),
        ((_cfg(num_key_value_heads=3),), {}, "num_key_value_heads"),
        ((_cfg(num_hidden_layers=0),), {}, "num_hidden_layers"),
        (({"model_type": "my-moe", **_SMALL, "n_routed_experts": 8, "moe_intermediate_size": 64},), {}, "n_routed_experts"),
    ],
    ids=["weight-dtype", "kv-dtype", "float-dtype", "batch-0", "seq-neg", "seq-float", "tp-3", "tp-bool",
         "chunk-0", "fraction", "gpus", "unknown-name", "int", "no-hidden", "raw-no-hidden", "raw-str-inter",
         "kv-heads", "layers-0", "moe"],
)
def test_bad_inputs_name_the_field(args, kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        estimate_memory(*args, **kwargs)
    assert isinstance(e.value, MemoryInputError) and isinstance(e.value, InfoptError)
    assert "allowed" in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        estimate_memory(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        estimate_memory(tmp_path)


# ---------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def cli(monkeypatch):
    import infopt.cli

    # only this package's plugin: the others (eval, bench) are built and tested elsewhere
    monkeypatch.setattr(infopt.cli, "_PLUGINS", ("infopt.cli.memory",))
    return infopt.cli.main


def test_cli_table(cli, capsys):
    assert cli(["memory", "--model", "llama-3-8b"]) == 0
    out = capsys.readouterr().out
    for s in ("llama-3-8b", "8.03B params", "weights", "KV cache", "activations", "total", "max batch",
              *memory.GPUS):
        assert s in out, s
    assert "14.96" in out  # bf16 weights in GiB


def test_cli_json(cli, tmp_path, capsys):
    out = tmp_path / "sub" / "est.json"
    argv = ["memory", "--model", "llama-2-70b", "--weight-dtype", "int4", "--kv-dtype", "int8", "--batch", "4",
            "--seq-len", "4096", "--tp", "2", "--json", str(out)]
    assert cli(argv) == 0
    d = json.loads(out.read_text())
    est = estimate_memory("llama-2-70b", weight_dtype="int4", kv_dtype="int8", batch=4, seq_len=4096, tp=2)
    assert d == json.loads(json.dumps(est.to_dict()))
    assert "wrote" in capsys.readouterr().out
    assert cli(["memory", "--model", "mistral-7b", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "mistral"


def test_cli_default_and_folder(cli, tmp_path, capsys):
    assert cli(["memory"]) == 0
    assert "default" in capsys.readouterr().out
    tiny_model("gpt2").config.save_pretrained(tmp_path)
    assert cli(["memory", "--model", str(tmp_path), "--seq-len", "128"]) == 0
    assert "(gpt2)" in capsys.readouterr().out


def test_cli_bad_value_exit_code(cli, capsys):
    assert cli(["memory", "--model", "llama-3-8b", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err
    assert cli(["memory", "--model", "nope"]) == 2
    assert "known name" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- API hygiene


def test_all_names_exist_and_docstring_examples_run():
    for name in memory.__all__:
        assert getattr(memory, name) is not None, name
    from infopt.cli import memory as cli
    from infopt.memory import arch, estimate

    for mod in (arch, estimate, cli):
        failed, attempted = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert attempted > 0 and failed == 0, mod.__name__  # no example found would pass vacuously


# ---------------------------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_default_model_weights_and_kv(default_model):
    model, _ = default_model  # infopt.models.load_default(): SmolLM2-135M-Instruct, fp32
    est = estimate_memory(model, seq_len=64)
    actual = param_bytes(model)
    assert abs(est.weights_bytes - actual) / actual < 0.10
    assert est.num_params == unique_param_count(model)
    assert estimate_memory("default", seq_len=64).weights_bytes == est.weights_bytes  # config only, same answer
    cache_bytes = filled_kv_bytes(model, tf.DynamicCache(config=model.config), batch=1, length=64)
    assert abs(est.kv_cache_bytes - cache_bytes) / cache_bytes < 0.10
    peak, kv = peak_prefill_bytes(model, batch=1, length=256)
    act = estimate_memory(model, seq_len=256).activations_bytes
    assert 0.85 < (peak - kv) / act < 1.15  # measured 0.97 when written


# ---------------------------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_resident_and_active_params_match_built_model(arch):
    from infopt.core.moe import moe_param_counts

    model = tiny_model(arch)
    est = estimate_memory(model, seq_len=64)
    counts = moe_param_counts(model)  # read off the built modules
    assert est.num_params == counts["total"] == unique_param_count(model)
    assert est.active_params == counts["active"] < est.num_params
    assert abs(est.weights_bytes - param_bytes(model)) < 1024


def test_moe_dense_layers_and_shared_expert_counted():
    from infopt.core.moe import moe_param_counts

    config = tf.Qwen2MoeConfig(**_SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1])
    with torch.random.fork_rng(devices=[]):
        model = tf.AutoModelForCausalLM.from_config(config).eval()
    est = estimate_memory(model, seq_len=64)
    assert est.spec.dense_layers == (1,)
    assert est.num_params == unique_param_count(model)
    assert est.active_params == moe_param_counts(model)["active"]
    # one sparse layer: 8 experts x 3 x 32 x 64, of which 6/8 idle per token
    assert est.num_params - est.active_params == 8 * 3 * 32 * 64 * 6 // 8
    assert "8 experts, 2 per token" in format_estimate(est)


def test_dense_model_active_equals_total():
    est = estimate_memory(tiny_model("llama"), seq_len=64)
    assert est.active_params == est.num_params
