import re

import pytest
import torch

import infopt
from infopt.attention import Attention
from infopt.core.errors import IncompatibleModelError, MissingBackendError, QualityGateError, RecipeError
from infopt.core.patch import has_patches
from infopt.kvcache import Static
from infopt.models import tiny_model
from infopt.quantize import Int8Linear, Int8WeightOnly

from .conftest import UNIT_ARCHS, assert_state_equal, state_snapshot

FULL = [Attention("eager"), Int8WeightOnly(), Static(max_length=128)]


@pytest.mark.parametrize("arch", UNIT_ARCHS)
def test_undo_restores_bit_identical_logits(arch, prompt):
    m = tiny_model(arch)
    before = m(prompt).logits
    snap = state_snapshot(m)
    attn = m.config._attn_implementation
    infopt.optimize(m, FULL)
    assert any(isinstance(x, Int8Linear) for x in m.modules())
    assert m.config._attn_implementation == "eager"
    assert not torch.equal(m(prompt).logits, before)  # int8 changed the numbers
    infopt.undo(m)
    assert torch.equal(m(prompt).logits, before)
    assert_state_equal(m, snap)
    assert m.config._attn_implementation == attn
    assert "generate" not in m.__dict__ and "infopt" not in m.__dict__
    assert not has_patches(m)


def test_report_contents(llama, prompt):
    infopt.optimize(llama, FULL)
    rep = llama.infopt
    assert [s.key for s in rep.steps] == ["attention", "quantize:int8", "kvcache:static"]
    assert rep.memory_after < rep.memory_before
    assert rep.steps[1].stats["modules_quantized"] == 14
    llama.generate(prompt, max_new_tokens=3, do_sample=False)
    llama.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False)
    assert rep.routing["infopt"] == 1 and rep.routing["original"] == 1
    assert "beam" in str(rep.routing["reasons"]) or "num_beams" in str(rep.routing["reasons"])
    text = str(rep)
    assert "quantize:int8" in text and "MiB" in text


def _assert_untouched(m, snap, prompt, gen_before):
    assert_state_equal(m, snap)
    assert not has_patches(m)
    assert "infopt" not in m.__dict__ and "generate" not in m.__dict__
    assert torch.equal(m.generate(prompt, max_new_tokens=5, do_sample=False), gen_before)


@pytest.mark.parametrize(
    "recipe,err,needle",
    [
        ({"steps": [{"quantise": {"method": "int8"}}]}, RecipeError, "unknown recipe step"),
        ({"steps": [{"quantize": {"method": "int8", "compute_dtype": "int2"}}]}, RecipeError, "compute_dtype"),
        ([Attention("eager"), Attention("sdpa")], RecipeError, "duplicate step"),
        ({"steps": [{"compile": {}}]}, RecipeError, "requires kvcache:static"),
        ([Static(max_length=100000)], IncompatibleModelError, "max_length <= 512"),
        ([Attention("flash_attention_2")], (MissingBackendError, IncompatibleModelError), "flash"),
        ("steps: [quantize: {method: int8}\n", RecipeError, "malformed"),
    ],
    ids=["unknown-step", "bad-field", "duplicate", "incompatible-pair", "too-long", "flash-attn", "malformed-yaml"],
)
def test_bad_input_leaves_model_untouched(llama, prompt, tmp_path, recipe, err, needle):
    if isinstance(recipe, str):
        p = tmp_path / "bad.yaml"
        p.write_text(recipe)
        recipe = str(p)
    snap = state_snapshot(llama)
    gen = llama.generate(prompt, max_new_tokens=5, do_sample=False)
    with pytest.raises(err) as e:
        infopt.optimize(llama, recipe)
    assert needle in str(e.value)
    _assert_untouched(llama, snap, prompt, gen)


def test_missing_backend_names_extra(llama, monkeypatch):
    import infopt.core.availability as av

    real = av.is_available
    monkeypatch.setattr(av, "is_available", lambda m: False if m == "flash_attn" else real(m))
    with pytest.raises(MissingBackendError, match=r"infopt\[flash\]"):
        infopt.optimize(llama, [Attention("flash_attention_2")])
    assert not has_patches(llama)


def test_unsupported_architecture_untouched(prompt):
    from transformers import BertConfig, BertForMaskedLM

    m = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match="Supported model types"):
        infopt.optimize(m, [Int8WeightOnly()])
    assert_state_equal(m, snap)


def test_failure_midway_rolls_back(llama, prompt, monkeypatch):
    from infopt.core import step as step_mod

    snap = state_snapshot(llama)
    gen = llama.generate(prompt, max_new_tokens=5, do_sample=False)

    def boom(model, config, ctx):
        raise RuntimeError("kvcache step failed")

    monkeypatch.setitem(step_mod.TRANSFORMS, Static, boom)
    with pytest.raises(RuntimeError, match="kvcache step failed"):
        infopt.optimize(llama, FULL)  # attention and quantize applied, then kvcache fails
    _assert_untouched(llama, snap, prompt, gen)


def test_second_optimize_extends_and_refuses_same_stage(llama):
    infopt.optimize(llama, [Attention("eager")])
    infopt.optimize(llama, [Int8WeightOnly()])
    assert [s.key for s in llama.infopt.steps] == ["attention", "quantize:int8"]
    with pytest.raises(RecipeError, match="already has quantize:int8 applied"):
        infopt.optimize(llama, [Int8WeightOnly(compute_dtype="float32")])
    infopt.undo(llama)
    assert not has_patches(llama)


def test_optimize_refuses_non_models():
    with pytest.raises(IncompatibleModelError):
        infopt.optimize(torch.nn.Linear(2, 2), [Attention("eager")])


def test_pipeline_after_optimize(default_tokenizer):
    from transformers import pipeline

    m = tiny_model("llama")
    infopt.optimize(m, "cpu-fast")
    pipe = pipeline("text-generation", model=m, tokenizer=default_tokenizer)
    out = pipe("Hello there", max_new_tokens=5, do_sample=False)
    assert isinstance(out[0]["generated_text"], str) and out[0]["generated_text"].startswith("Hello there")
    assert m.infopt.routing["infopt"] >= 1


def test_quality_gate_pass_and_fail(default_tokenizer):
    m = tiny_model("llama")
    infopt.optimize(m, [Attention("eager")], gate={"max_kl": 1e-6, "min_top1": 0.999})
    assert m.infopt.gate["kl"] < 1e-6
    infopt.undo(m)
    with pytest.raises(QualityGateError) as e:
        infopt.optimize(m, [Int8WeightOnly()], gate={"max_kl": 0.0, "min_top1": 1.0})
    assert e.value.figures["kl"] > 0
    assert has_patches(m)  # the model stays optimized; the user decides
    infopt.undo(m)


@pytest.mark.parametrize("recipe", [[], {"steps": []}, "steps: []\n"], ids=["list", "mapping", "yaml"])
def test_empty_recipe_refused_model_untouched(recipe, tmp_path, prompt):
    m = tiny_model("llama")
    before = m(prompt).logits
    if isinstance(recipe, str):
        path = tmp_path / "empty.yaml"
        path.write_text(recipe)
        recipe = str(path)
    with pytest.raises(RecipeError, match="the recipe has no steps.*preset name"):
        infopt.optimize(m, recipe)
    with pytest.raises(RecipeError, match="no steps"):
        infopt.validate(m, recipe)
    assert not has_patches(m) and "infopt" not in m.__dict__ and "save_pretrained" not in m.__dict__
    assert torch.equal(m(prompt).logits, before)


@pytest.mark.parametrize("gate,needle", [({"min_top1": 5}, "min_top1=5 is out of range"),
                                         ({"max_kl": -1}, "max_kl=-1 is out of range"),
                                         ({"max_kll": 0.1}, "Did you mean 'max_kl'?")],
                         ids=["top1-5", "kl-negative", "key-typo"])
def test_gate_checked_before_the_model_is_touched(gate, needle):
    m = tiny_model("llama")
    with pytest.raises(RecipeError) as e:
        infopt.optimize(m, [Int8WeightOnly()], gate=gate)
    assert needle in str(e.value)
    with pytest.raises(RecipeError):
        infopt.optimize(m, {"steps": [{"quantize": "int8"}], "gate": gate})
    assert not has_patches(m) and not any(isinstance(x, Int8Linear) for x in m.modules())


@pytest.mark.parametrize("recipe", ["cpu-fast", [Attention("eager")], [Static(max_length=64)]],
                         ids=["cpu-fast", "attention", "static"])
def test_meta_model_refused_before_anything_changes(recipe):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(tiny_model("llama").config)
    attn = m.config._attn_implementation
    with pytest.raises(IncompatibleModelError, match=r"tensors are on the meta device \(model\.embed_tokens\.weight"):
        infopt.optimize(m, recipe)
    assert not has_patches(m) and m.config._attn_implementation == attn and "infopt" not in m.__dict__


def test_lazy_module_refused():
    m = tiny_model("llama")
    m.model.extra = torch.nn.LazyLinear(4)
    with pytest.raises(IncompatibleModelError, match="not materialised yet.*model.extra.weight.*forward pass"):
        infopt.optimize(m, [Attention("eager")])
    assert not has_patches(m)


def test_report_renders_in_notebooks():
    m = infopt.optimize(tiny_model("llama"), [Attention("eager"), Int8WeightOnly()])
    html = m.infopt._repr_html_()
    assert html.startswith("<table>") and "<code>quantize:int8</code>" in html and "<th>seconds</th>" in html
    assert "resident</th>" in html and "weights and buffers" in html and "MiB" in html
    md = m.infopt._repr_markdown_()
    assert "| step | seconds | notes | fallbacks |" in md and "| `quantize:int8` |" in md
    assert md.count("\n|") == 4  # header, rule, two steps
    m.infopt.steps[0].notes.append("a | b <c>")
    assert "a \\| b <c>" in m.infopt._repr_markdown_() and "a | b &lt;c&gt;" in m.infopt._repr_html_()


# -- explain: the plan as text, nothing changed ----------------------------------------------------------------------


def _untouched(model, snap):
    assert_state_equal(model, snap)
    assert not has_patches(model) and "infopt" not in model.__dict__ and "generate" not in model.__dict__


@pytest.mark.parametrize("recipe", ["cpu-fast", "cpu-lossless", "memory-saver", "throughput"])
def test_explain_lists_the_plan_and_leaves_the_model_untouched(llama, recipe):
    snap = state_snapshot(llama)
    text = infopt.explain(llama, recipe)
    _untouched(llama, snap)
    r, fallbacks = infopt.validate(llama, recipe)
    lines = text.splitlines()
    assert lines[0].startswith(f"preset {recipe}: plan for LlamaForCausalLM (llama, 2 layers")
    heads = [ln.strip() for ln in lines if re.match(r"  \d+\. ", ln)]
    assert heads == [f"{i}. {s.key}  ({type(s).__name__}; {s.fidelity})"
                     for i, s in enumerate(r.steps, 1)]  # canonical order, one line per step
    for step in r.steps:  # every field, named as the recipe names it
        for name in step.fields_dict():
            assert re.search(rf"^ +{name} += ", text, re.M), name
    assert text.count("fallbacks: ") == len(r.steps) and "Nothing was changed" in lines[-1]
    assert all(not f for f in fallbacks.values()) and text.count("fallbacks: none") == len(r.steps)


def test_explain_orders_steps_marks_changed_defaults_and_names_fallbacks(llama):
    from infopt.kvcache import HeavyHitter

    text = infopt.explain(llama, [HeavyHitter(budget=128), Int8WeightOnly(group_size=32)])
    assert text.index("1. quantize:int8") < text.index("2. kvcache:heavy_hitter")  # the order optimize runs them
    assert "budget = 128  (default 256)" in text and "recent = 64\n" in text  # a default shows only when changed
    assert "group_size      = 32  (default None)" in text
    _, fallbacks = infopt.validate(llama, [HeavyHitter(budget=128)])
    (taken,) = fallbacks["kvcache:heavy_hitter"]
    assert f"fallbacks: {taken}" in text and "eager" in taken  # what validate reports, word for word


def test_explain_raises_what_validate_raises(llama):
    for recipe in ("gpu-fast", [{"quantize": {"method": "int3"}}], [Int8WeightOnly(group_size=128)]):
        with pytest.raises((RecipeError, IncompatibleModelError)) as by_validate:
            infopt.validate(llama, recipe)
        with pytest.raises(type(by_validate.value)) as by_explain:
            infopt.explain(llama, recipe)
        assert str(by_explain.value) == str(by_validate.value)


def test_explain_names_the_steps_already_applied(llama):
    infopt.optimize(llama, [Int8WeightOnly()])
    snap = state_snapshot(llama)
    text = infopt.explain(llama, [Static(max_length=64)])
    assert "already applied to this model: quantize:int8" in text and "1. kvcache:static" in text
    assert_state_equal(llama, snap)
    assert [s.key for s in llama.infopt.steps] == ["quantize:int8"]
