"""GGUF export: every tensor back through infopt's GGUF loader (names, q/k row order, config), float linears quantized
exactly as llama.cpp's reference quantizer does, quantized layers' codes kept, tokenizers round-tripped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'infopt[gguf]')")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

import infopt  # noqa: E402
from infopt.core.errors import CheckpointError  # noqa: E402
from infopt.models import tiny_model  # noqa: E402
from infopt.quantize import Int4Linear, Int4WeightOnly, Int8Linear, Int8WeightOnly, quantize_  # noqa: E402
from infopt.quantize.community.gguf_ckpt import _reader  # noqa: E402

IDS = torch.tensor([[1, 17, 400, 23, 9, 5, 88, 1000, 3]])


def _tensors(path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in _reader(str(path)).tensors}


def _with_rope_theta(model, theta: float):
    model.config.rope_parameters["rope_theta"] = theta
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def _with_rope(model, params: dict):
    model.config.rope_parameters = params
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


@pytest.mark.parametrize("params", [LLAMA3, {**LLAMA3, "original_max_position_embeddings": 2048},
                                    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}],
                         ids=["llama3", "llama3-2048", "linear"])
def test_a_scaled_rotary_embedding_round_trips(params, tmp_path):
    """A llama3 scaling goes out as llama.cpp's rope_freqs tensor (one divisor per frequency) and a linear one as
    metadata; loaded back, the model computes the same frequencies and the same logits bit for bit, where the file
    read without its scaling would give others."""
    model = _with_rope(tiny_model("llama"), params)
    report = infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    tensors = _tensors(tmp_path / "m.gguf")
    fields = _reader(str(tmp_path / "m.gguf")).fields
    if params["rope_type"] == "llama3":
        divisors = tensors["rope_freqs.weight"]
        assert divisors.shape == (model.config.head_dim // 2,) and divisors.max() == 8.0 and divisors.min() == 1.0
        assert report["tensors"] == len(tensors)
    else:
        assert "rope_freqs.weight" not in tensors and "llama.rope.scaling.type" in fields
    loaded, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False)
    assert loaded.config.rope_parameters["rope_type"] == params["rope_type"]
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    positions = torch.arange(400, 400 + IDS.shape[1])[None]
    with torch.no_grad():
        want = model(IDS, position_ids=positions).logits
        assert torch.equal(loaded(IDS, position_ids=positions).logits, want)
        unscaled = _with_rope(loaded, {"rope_type": "default", "rope_theta": 10000.0})
        assert not torch.equal(unscaled(IDS, position_ids=positions).logits, want)


@pytest.mark.parametrize(("theta", "head_dim", "factor"), [(500000.0, 128, 8.0), (500000.0, 64, 32.0),
                                                            (500000.0, 128, 32.0)],
                         ids=["llama3.1-8b", "llama3.2-1b", "llama3.2-3b"])
def test_llama3_divisors_solve_back_to_the_parameters_that_gave_them(theta, head_dim, factor):
    """The divisors of the Llama 3.x checkpoints' own rotary parameters (low 1, high 4, original 8192) solve back to
    those parameters; divisors no llama3 set gives are refused, not loaded as something else."""
    from transformers import LlamaConfig

    from infopt.quantize.community.gguf_rope import export_rope, rope_from_gguf

    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters=params)
    _, divisors = export_rope(config, "llama")
    cfg = {"rope_theta": theta}
    rope_from_gguf(cfg, "llama", {}, divisors, "m.gguf")
    assert cfg["rope_scaling"] == {k: v for k, v in params.items() if k != "rope_theta"}
    bent = divisors.copy()
    bent[-1] *= 0.5  # the longest wavelength divided by half the factor: no llama3 set does that
    with pytest.raises(CheckpointError, match="no llama3 rotary scaling"):
        rope_from_gguf({"rope_theta": theta}, "llama", {}, bent, "m.gguf")


def test_a_rotary_scaling_infopt_does_not_map_is_refused_on_load(tmp_path):
    import gguf

    model = tiny_model("llama")
    infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    reader = _reader(str(tmp_path / "m.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
    writer.add_string("llama.rope.scaling.type", "yarn")
    writer.add_float32("llama.rope.scaling.factor", 4.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="rotary scaling 'yarn'"):
        infopt.load_quantized(tmp_path / "yarn.gguf", tokenizer=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_model_round_trips_exactly_in_f32(arch, tmp_path):
    """F32 everywhere: the loaded model's logits are the original's, bit for bit (names, Llama's q/k row order,
    qwen2's biases, the config, its rotary base (Qwen2.5's 1e6, SmolLM2's 1e5), the tied head all made it
    through)."""
    model = _with_rope_theta(tiny_model(arch), {"llama": 1e5, "qwen2": 1e6}[arch])
    report = infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    assert report["linears"] == {"F32": 7 * model.config.num_hidden_layers} and report["exact"]
    loaded, tok = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False)
    assert tok is None and loaded.config.num_key_value_heads == model.config.num_key_value_heads
    assert loaded.config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def _gemma3(layers: int = 2, sliding_window: int = 8):
    """A tiny Gemma 3 as llama.cpp computes one (attention scaled by 1/sqrt(head_dim)), with norm weights that are
    not all zero (Gemma's norms scale by 1 + w) and bf16-exact (so 1 + w is exact in fp32), and a short sliding
    window, so that positions past it test the sliding layers."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=sliding_window, vocab_size=1000, max_position_embeddings=512,
                              tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = (torch.randn(p.shape, generator=gen) * 0.3).bfloat16().float()
    return model


LONG_IDS = torch.arange(3, 3 + 40).unsqueeze(0) * 37 % 1000  # past the sliding window of _gemma3


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_round_trip_exactly_in_f32(arch, tmp_path):
    """Qwen3's q/k norms, Gemma 3's four norms per layer (written as llama.cpp multiplies them, 1 + w), its sliding
    window, its attention scale and its head size (256, not hidden / heads, in the real models): back through the
    loader with the same logits bit for bit, over positions past the sliding window."""
    model = _gemma3() if arch == "gemma3" else tiny_model("qwen3")
    report = infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    assert report["linears"] == {"F32": 7 * model.config.num_hidden_layers} and report["exact"]
    fields = _reader(str(tmp_path / "m.gguf")).fields
    assert fields["general.architecture"].contents() == {"qwen3": "qwen3", "gemma3": "gemma3"}[arch]
    loaded, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False)
    assert loaded.config.head_dim == model.config.head_dim
    if arch == "gemma3":
        assert loaded.config.sliding_window == 8 and loaded.config.query_pre_attn_scalar == model.config.head_dim
        norm = _tensors(tmp_path / "m.gguf")["blk.0.post_ffw_norm.weight"]
        assert np.array_equal(norm, model.model.layers[0].post_feedforward_layernorm.weight.detach().numpy() + 1)
    with torch.no_grad():
        assert torch.equal(loaded(LONG_IDS).logits, model(LONG_IDS).logits)


def test_a_head_size_other_than_hidden_over_heads_is_written_and_read(tmp_path):
    """Qwen3-4B's heads are 128 wide over a hidden size of 2560 / 32 heads: llama.cpp reads the size from
    key_length/value_length (else it takes 80), and the loader must too (transformers' qwen3 table skips it, so a
    Qwen3 config would take its class default)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=24, vocab_size=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    fields = _reader(str(tmp_path / "m.gguf")).fields
    assert [fields[f"qwen3.{k}"].contents() for k in ("attention.key_length", "attention.value_length",
                                                      "rope.dimension_count")] == [24, 24, 24]
    loaded, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False)
    assert loaded.config.head_dim == 24
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(("layers", "hidden", "heads", "head_dim", "scalar"), [
    (26, 1152, 4, 256, 256),  # Gemma-3-1B
    (62, 5376, 32, 128, 168),  # Gemma-3-27B: llama.cpp scales by hidden / heads there
    (2, 64, 4, 16, 16),
])
def test_a_gemma3_file_gets_llama_cpps_attention_scale(layers, hidden, heads, head_dim, scalar):
    """The file has no key for Gemma 3's attention scale (llama.cpp derives it); the config class's default (256)
    is one size's, so the loader sets llama.cpp's rule."""
    from infopt.quantize.community.gguf_ckpt import _gemma3_config

    cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim}
    _gemma3_config(cfg, {}, "gemma3")
    assert cfg["query_pre_attn_scalar"] == scalar and "final_logit_softcapping" not in cfg


@pytest.mark.parametrize(("setting", "value", "match"), [
    ("query_pre_attn_scalar", 256, "query_pre_attn_scalar 256"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
])
def test_a_gemma3_setting_llama_cpp_fixes_otherwise_is_refused(setting, value, match, tmp_path):
    """llama.cpp's Gemma 3 graph fixes the layer pattern, the attention scale and the sliding layers' rotary base
    instead of reading them: a model that differs is refused, not written as a file that runs another model."""
    model = _gemma3()
    setattr(model.config, setting, value)
    with pytest.raises(CheckpointError, match=match):
        infopt.export_gguf(model, tmp_path / "m.gguf", type="F32")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_float_linears_take_llama_cpps_reference_quantization(kind, tmp_path):
    """Each float linear is quantized as llama.cpp's reference quantizer does (gguf-py's ``quants``): the loaded
    layers compute with exactly those weights (Q4_1 to fp32 rounding), q/k rows included (they are permuted for
    llama.cpp and back)."""
    model = tiny_model("llama")
    report = infopt.export_gguf(model, tmp_path / "m.gguf", type=kind)
    assert report["linears"] == {kind: 14} and len(report["quantized"]) == 14
    loaded, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, reference=True)
    qtype = getattr(Q, kind)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
        w = model.model.layers[1].get_submodule(name).weight.detach().float().numpy()
        want = quants.dequantize(quants.quantize(w, qtype), qtype)
        got = loaded.model.layers[1].get_submodule(name)
        assert isinstance(got, Int8Linear if kind == "Q8_0" else Int4Linear), name
        if kind == "Q4_1":  # the loader holds Q4_1's minimum as a zero point -m / d: (q - z) d rounds once more
            np.testing.assert_allclose(got.dequantize().numpy(), want, rtol=2**-20, atol=2**-22 * np.abs(want).max())
        else:
            assert np.array_equal(got.dequantize().numpy(), want), (kind, name)


def test_a_loaded_file_exports_again_byte_for_byte(tmp_path):
    """A model loaded from a GGUF file on the reference layers keeps its codes and fp16 block fields: written again,
    every tensor is the file's own bytes, and the report calls each linear exact."""
    model = tiny_model("llama")
    infopt.export_gguf(model, tmp_path / "a.gguf", type="Q4_0")
    loaded, _ = infopt.load_quantized(tmp_path / "a.gguf", tokenizer=False, reference=True)
    report = infopt.export_gguf(loaded, tmp_path / "b.gguf", type="Q8_0")  # type: for float linears only
    assert report["linears"] == {"Q4_0": 14} and len(report["exact"]) == 14 and not report["quantized"]
    first, again = _tensors(tmp_path / "a.gguf"), _tensors(tmp_path / "b.gguf")
    assert first.keys() == again.keys()
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_infopt_quantized_layers_keep_their_codes(tmp_path):
    """int4 layers in groups of 32 go out as Q4_0 (symmetric) with their own codes, int8 ones in groups of 32 as
    Q8_0. Scales the kernel layout holds in bf16 fit the blocks' fp16 exactly; fp32 ones (the plain layout) are
    rounded to it (listed as rounded). Layers in other groups are dequantized and quantized again to ``type``
    (listed as requantized)."""
    int4 = quantize_(tiny_model("llama"), Int4WeightOnly(group_size=32, symmetric=True))
    mlp = int4.model.layers[0].mlp
    mlp.down_proj = Int4Linear.from_float(tiny_model("llama").model.layers[0].mlp.down_proj, group_size=32,
                                          symmetric=True, layout="plain")
    report = infopt.export_gguf(int4, tmp_path / "a.gguf", type="Q8_0")
    assert report["linears"] == {"Q4_0": 14}
    assert report["rounded"] == ["model.layers.0.mlp.down_proj"] and len(report["exact"]) == 13
    loaded, _ = infopt.load_quantized(tmp_path / "a.gguf", tokenizer=False, reference=True)
    for name in ("up_proj", "down_proj"):
        (q_src, s_src, _), (q_got, s_got, z_got) = mlp.get_submodule(name)._portable(), \
            loaded.model.layers[0].mlp.get_submodule(name)._portable()
        assert torch.equal(q_src, q_got) and bool((z_got == 8).all()), name
        assert torch.equal(s_got, s_src.to(torch.float16).float()), name
    int8 = quantize_(tiny_model("llama"), Int8WeightOnly(group_size=32))
    report = infopt.export_gguf(int8, tmp_path / "b.gguf")
    assert report["linears"] == {"Q8_0": 14}
    loaded, _ = infopt.load_quantized(tmp_path / "b.gguf", tokenizer=False, reference=True)
    assert torch.equal(loaded.model.layers[1].self_attn.o_proj.weight_int8,
                       int8.model.layers[1].self_attn.o_proj.weight_int8)
    g64 = quantize_(tiny_model("llama"), Int4WeightOnly(group_size=64))
    report = infopt.export_gguf(g64, tmp_path / "c.gguf", type="Q4_1")
    assert report["linears"] == {"Q4_1": 14} and len(report["requantized"]) == 14


def test_a_cpu_fast_model_exports_its_shared_int8_head_as_the_token_embedding(tmp_path):
    """``cpu-fast``'s quantization (here with symmetric int4, which Q4_0 holds): its int8 head, which the embedding
    reads its rows from, goes out as the Q8_0 token embedding with the head's own codes (whatever the layer's layout),
    no output tensor (llama.cpp then reads the embedding as the output layer, as infopt does); loaded back, the
    embedding and the tied head are those codes times the fp16-rounded scales, and the int4 layers keep their
    codes."""
    from infopt.quantize.formats.int8 import SharedInt8Embedding
    from infopt.quantize.formats.primitives import unpack_int4

    model = tiny_model("llama")
    infopt.optimize(model, [Int4WeightOnly(group_size=32, symmetric=True, include_lm_head=True, share_embedding=True,
                                           activations="auto")])
    head = model.lm_head
    assert isinstance(model.model.embed_tokens, SharedInt8Embedding) and isinstance(head, Int8Linear)
    report = infopt.export_gguf(model, tmp_path / "m.gguf", type="Q4_0")
    assert report["linears"] == {"Q4_0": 14, "Q8_0": 1} and "model.embed_tokens" in report["exact"] + report["rounded"]
    kinds = {t.name: t.tensor_type.name for t in _reader(str(tmp_path / "m.gguf")).tensors}
    assert kinds["token_embd.weight"] == "Q8_0" and "output.weight" not in kinds
    loaded, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, reference=True)
    scale = head.weight_scale.float().to(torch.float16).float()
    scale = scale.unsqueeze(-1) if head.group_size is None else scale.repeat_interleave(head.group_size, dim=1)
    want = head.codes().float() * scale
    assert torch.equal(loaded.model.embed_tokens.weight, want)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    src, got = model.model.layers[1].mlp.up_proj, loaded.model.layers[1].mlp.up_proj
    assert torch.equal(unpack_int4(src._portable()[0]), unpack_int4(got._portable()[0]))


def test_a_cpu_fast_file_loads_into_cpu_fasts_layers_with_the_files_codes(tmp_path):
    """``load_quantized(activations="auto")``: the layers cpu-fast builds (int4 in the int8-activation layout where
    the CPU has the kernel, an int8 head over the Q8_0 token embedding's codes that the embedding reads its rows
    from, no float embedding), holding exactly the file's weights: exported again, every tensor is byte for byte
    the first file's."""
    from infopt.quantize.formats import a8
    from infopt.quantize.formats.int8 import SharedInt8Embedding

    model = _with_rope_theta(tiny_model("qwen2"), 1e6)
    infopt.optimize(model, [Int4WeightOnly(group_size=32, symmetric=True, include_lm_head=True, share_embedding=True,
                                           activations="auto")])
    infopt.export_gguf(model, tmp_path / "a.gguf", type="Q4_0")
    loaded, _ = infopt.load_quantized(tmp_path / "a.gguf", tokenizer=False, activations="auto")
    int8 = a8.resolve("auto", "cpu") == "int8"
    assert isinstance(loaded.model.embed_tokens, SharedInt8Embedding) and loaded.model.embed_tokens.head is loaded.lm_head
    assert loaded.lm_head.group_size is None and loaded.lm_head.activations == ("int8" if int8 else "float")
    up = loaded.model.layers[0].mlp.up_proj
    assert isinstance(up, Int4Linear) and (up.layout == "a8_sym") == int8  # Q4_0: the fp16 scales alone
    assert not any(p.numel() == loaded.config.vocab_size * loaded.config.hidden_size for p in loaded.parameters())
    infopt.export_gguf(loaded, tmp_path / "b.gguf", type="Q4_0")
    first, again = _tensors(tmp_path / "a.gguf"), _tensors(tmp_path / "b.gguf")
    assert first.keys() == again.keys()
    assert all(np.array_equal(first[k], again[k]) for k in first)
    with torch.no_grad():  # it runs, and as the fast reading of the same weights it stays close to the reference's
        ref, _ = infopt.load_quantized(tmp_path / "a.gguf", tokenizer=False, reference=True)
        got, want = loaded(IDS).logits, ref(IDS).logits
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    with pytest.raises(ValueError, match="activations='int4'"):
        infopt.load_quantized(tmp_path / "a.gguf", tokenizer=False, activations="int4")


def test_the_tokenizer_round_trips(tmp_path):
    """The default tokenizer (BPE) written into the file encodes a text into the same ids once loaded back, with
    the same special tokens and chat template."""
    model, tok = tiny_model("llama", with_tokenizer=True)
    infopt.export_gguf(model, tmp_path / "m.gguf", tok, pre="smollm")
    fields = _reader(str(tmp_path / "m.gguf")).fields
    assert "tokenizer.ggml.merges" in fields and "tokenizer.chat_template" in fields
    _, loaded = infopt.load_quantized(tmp_path / "m.gguf")
    text = "Hello world, 1234 times: <|im_start|>user\nWhat is infopt?<|im_end|>"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.eos_token_id, loaded.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)


def test_bad_input_is_named(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(CheckpointError, match="type 'Q5_K'"):
        infopt.export_gguf(model, tmp_path / "m.gguf", type="Q5_K")
    with pytest.raises(CheckpointError, match="float_type"):
        infopt.export_gguf(model, tmp_path / "m.gguf", float_type="Q4_0")
    with pytest.raises(CheckpointError, match="architecture 'gpt2'"):
        infopt.export_gguf(tiny_model("gpt2"), tmp_path / "m.gguf")
    scaled = _with_rope(tiny_model("llama"), {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 256})
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        infopt.export_gguf(scaled, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.real_model
@pytest.mark.slow
def test_the_shipped_default_model_file_exports_its_linears_byte_for_byte(tmp_path):
    """The embedded SmolLM2 Q4_1 file, loaded and written again: each of its 210 quantized linears is the file's
    own bytes (codes and fp16 fields kept); the embedding, Q8_0 in the file and dense once loaded, goes out as F32."""
    from infopt.models import default_gguf_path

    model, tok = infopt.load_quantized(default_gguf_path(), reference=True)
    report = infopt.export_gguf(model, tmp_path / "m.gguf", tok, pre="smollm")
    assert report["linears"] == {"Q4_1": 210} and len(report["exact"]) == 210
    shipped, again = _tensors(default_gguf_path()), _tensors(tmp_path / "m.gguf")
    linears = [k for k in shipped if k.startswith("blk.") and not k.endswith("norm.weight")]
    assert len(linears) == 210 and all(np.array_equal(shipped[k], again[k]) for k in linears)


@pytest.mark.parametrize(("arch", "kind"), [("llama", "Q4_0"), ("qwen2", "Q4_1"), ("llama", "Q8_0")])
def test_transcoded_layers_are_the_decoded_layers(arch, kind, tmp_path, monkeypatch):
    """Q4_0 / Q4_1 / Q8_0 blocks written by the C++ transcoder straight into cpu-fast's layouts (llama's q/k rows
    permuted on the way) give the layers the decoding path builds: every buffer bit for bit, the same types and
    settings."""
    from infopt.quantize.community import gguf_ckpt
    from infopt.quantize.formats import a8

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    model = tiny_model(arch)
    step = (Int8WeightOnly(include_lm_head=True, share_embedding=True, activations="int8") if kind == "Q8_0" else
            Int4WeightOnly(group_size=32, symmetric=kind == "Q4_0", include_lm_head=True, share_embedding=True,
                           activations="auto"))
    infopt.optimize(model, [step])
    infopt.export_gguf(model, tmp_path / "m.gguf", type=kind)
    written = []
    for name in ("a8_int4", "a8_int8"):
        real = getattr(gguf_ckpt, name)
        monkeypatch.setattr(gguf_ckpt, name, lambda *a, real=real, **k: written.append(real(*a, **k)) or written[-1])
    fast, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, activations="auto")
    # every linear and the head transcoded once (q and k on the loader's thread, the rest ahead of it)
    assert len(written) == len(model.model.layers) * 7 + 1 and None not in written
    for name in ("a8_int4", "a8_int8"):  # as where the C++ kernels are not built: the decoding path
        monkeypatch.setattr(gguf_ckpt, name, lambda *a, **k: None)
    slow, _ = infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, activations="auto")
    got, want = dict(fast.named_buffers()), dict(slow.named_buffers())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    for (name, m), m2 in zip(fast.named_modules(), slow.modules(), strict=True):
        assert type(m) is type(m2), name
        for attr in ("layout", "group_size", "act_group", "compute_dtype", "out_dtype", "_layout_auto"):
            assert getattr(m, attr, None) == getattr(m2, attr, None), (name, attr)
    assert isinstance(fast.model.layers[0].mlp.up_proj, Int8Linear if kind == "Q8_0" else Int4Linear)
    assert fast.lm_head.layout == "a8"
    with torch.no_grad():
        assert torch.equal(fast(IDS).logits, slow(IDS).logits)


def test_a_failure_on_the_transcoding_thread_reaches_the_caller_and_the_thread_ends(tmp_path, monkeypatch):
    import threading

    from infopt.quantize.community import gguf_ckpt
    from infopt.quantize.formats import a8

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    model = tiny_model("qwen2")
    infopt.optimize(model, [Int4WeightOnly(group_size=32, symmetric=True, activations="auto")])
    infopt.export_gguf(model, tmp_path / "m.gguf", type="Q4_0")

    def broken(raw, kind, perm=None, symmetric=False):
        raise RuntimeError("transcoder broke on " + kind)

    monkeypatch.setattr(gguf_ckpt, "a8_int4", broken)
    with pytest.raises(RuntimeError, match="transcoder broke on Q4_0"):
        infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, activations="auto")
    assert not [t for t in threading.enumerate() if t.name.startswith("infopt-gguf")]
    monkeypatch.undo()
    infopt.load_quantized(tmp_path / "m.gguf", tokenizer=False, activations="auto")
    assert not [t for t in threading.enumerate() if t.name.startswith("infopt-gguf")]


K_SHAPES = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, vocab_size=320)  # K blocks: 256 inputs
Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}


def _k_values(data: np.ndarray, kind: str) -> np.ndarray:
    return quants.dequantize(data, Q[kind])


def test_a_q4_k_m_file_on_cpu_fasts_layers_exports_its_k_blocks_again(tmp_path):
    """A Q4_K_M file (Q4_K linears and token embedding, Q6_K ``attn_v``, ``ffn_down`` and head) loaded into
    ``cpu-fast``'s int8-activation layers, which hold both K types' two levels of scales as the file has them, goes out
    in the same types: every tensor's weights are the file's, bit for bit, and each linear is reported exact. The
    bytes are the file's too, except the codes of a Q4_K group whose sub-scale is 0 (they multiply 0; the layer holds
    them as 0)."""
    from infopt.quantize.community.gguf_blocks import _k4_scales

    from .writers import write_gguf

    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama", **K_SHAPES), Q4_K_M, dead_groups=True)
    model, _ = infopt.load_quantized(path, tokenizer=False, activations="int8")
    assert model.model.layers[0].self_attn.q_proj.layout == "a8_k"
    report = infopt.export_gguf(model, tmp_path / "b.gguf", type="Q8_0")
    assert report["linears"] == {"Q4_K": 10, "Q6_K": 5} and len(report["exact"]) == 15
    src, got = _reader(str(path)).tensors, {t.name: t for t in _reader(str(tmp_path / "b.gguf")).tensors}
    for t in src:
        kind, again = t.tensor_type.name, got[t.name]
        assert again.tensor_type.name == kind, t.name
        a, b = np.array(t.data), np.array(again.data)
        if kind == "F32":
            assert np.array_equal(a, b), t.name
            continue
        assert np.array_equal(_k_values(a, kind), _k_values(b, kind)), t.name
        if kind == "Q6_K" or t.name == "token_embd.weight":
            assert np.array_equal(a, b), t.name
        else:  # scales and minimums as the file's; codes too wherever no group is dead
            blocks, blocks2 = a.reshape(-1, 144), b.reshape(-1, 144)
            assert np.array_equal(blocks[:, :16], blocks2[:, :16]), t.name
            sc, _ = _k4_scales(torch.from_numpy(blocks[:, 4:16]))  # (the loader's reading of the 6-bit fields)
            live = (sc != 0).all(1).numpy()
            assert 0 < live.sum() < len(live), t.name  # the test file has both kinds
            assert np.array_equal(blocks[live], blocks2[live]), t.name


def test_a_q4_k_file_on_the_reference_layers_exports_q4_k_with_its_values(tmp_path):
    """On the reference layers a Q4_K layer holds fp32 scales ``d * sc`` and zero points ``dmin * m / (d * sc)``,
    which Q4_1's fp16 fields would round: they are factored back into Q4_K's two levels (a Q6_K layer's group scales
    into Q6_K's), so the file written holds
    the same weights bit for bit (not necessarily the same bytes: another unit can give the same products), and it
    loads back into the same layers. A layer whose scales do not factor (infopt's own asymmetric int4) is Q4_1,
    rounded, as before."""
    from .writers import write_gguf

    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama", **K_SHAPES), {**Q4_K_M, "token_embd": "F32"},
                      dead_groups=False)
    model, _ = infopt.load_quantized(path, tokenizer=False, reference=True)
    report = infopt.export_gguf(model, tmp_path / "b.gguf")
    assert report["linears"] == {"Q4_K": 10, "Q6_K": 5} and len(report["exact"]) == 15
    src, got = _reader(str(path)).tensors, {t.name: t for t in _reader(str(tmp_path / "b.gguf")).tensors}
    for t in src:
        kind = t.tensor_type.name
        if kind in ("Q4_K", "Q6_K"):
            assert got[t.name].tensor_type.name == kind, t.name
            assert np.array_equal(_k_values(np.array(t.data), kind), _k_values(np.array(got[t.name].data), kind))
    again, _ = infopt.load_quantized(tmp_path / "b.gguf", tokenizer=False, reference=True)
    for (name, a), b in zip(model.named_modules(), again.modules(), strict=True):
        if isinstance(a, Int4Linear):
            assert all(torch.equal(x, y) for x, y in zip(a._portable(), b._portable(), strict=True)), name
    own = quantize_(tiny_model("llama", **K_SHAPES), Int4WeightOnly(group_size=32))
    report = infopt.export_gguf(own, tmp_path / "c.gguf")
    assert report["linears"] == {"Q4_1": 14} and len(report["rounded"]) == 14
