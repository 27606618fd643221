"""GPTQ and AWQ folders onto Int4Linear/Int8Linear: logits against the dequantized checkpoint, no backend imported."""

from __future__ import annotations

import copy
import importlib.abc
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from infopt.core.errors import CheckpointError
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int8Linear
from infopt.quantize.community import detect_format, load_quantized
from infopt.quantize.formats.int4 import quantize_int4_grouped
from infopt.quantize.serialization.export import export_gptq, load_gptq_state

from .writers import write_packed_folder

IDS = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
BACKENDS = ("gptqmodel", "auto_gptq", "awq")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits.float()


def _kl(a, ref):
    return F.kl_div(F.log_softmax(a, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")


class _Blocker(importlib.abc.MetaPathFinder):
    """Fails any import of a GPTQ/AWQ backend package and records the attempt."""

    def __init__(self):
        self.tried = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BACKENDS:
            self.tried.append(name)
            raise ImportError(f"blocked in this test: {name}")
        return None


@pytest.fixture
def no_backends(monkeypatch):
    blocker = _Blocker()
    monkeypatch.setattr(sys, "meta_path", [blocker, *sys.meta_path])
    for mod in list(sys.modules):
        if mod.split(".")[0] in BACKENDS:
            monkeypatch.delitem(sys.modules, mod)
    yield blocker
    assert blocker.tried == []


def _act_order_model(group_size=32, seed=0):
    """A tiny Llama whose decoder linears are int4 with integer zero points and a random input permutation per layer
    (the state GPTQ's act-order leaves), in the portable layout so export reads exact codes."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(seed)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            perm = torch.randperm(mod.in_features, generator=g)
            codes, scales, zeros = quantize_int4_grouped(mod.weight.detach()[:, perm], group_size, zero_point="int")
            layer = Int4Linear.from_codes(codes, scales, zeros, group_size=group_size, in_perm=perm, layout="plain")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
    return model


def test_gptq_export_with_act_order_loads_exactly(tmp_path, no_backends):
    folder = export_gptq(_act_order_model(), tmp_path / "gptq")
    assert json.loads((folder / "quantize_config.json").read_text())["desc_act"] is True
    ref_model = tiny_model("llama")
    ref_model.load_state_dict(load_gptq_state(folder), strict=False)
    ref = _logits(ref_model)
    assert detect_format(folder) == "gptq"
    model, tok = load_quantized(folder, reference=True)
    assert tok is None  # the folder has no tokenizer
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Int4Linear) and q.in_perm is not None and q.group_size == 32
    assert (_logits(model) - ref).abs().max() <= 1e-4 * ref.abs().max()
    fast, _ = load_quantized(folder)
    assert fast.model.layers[0].mlp.up_proj.layout != "plain"
    assert _kl(_logits(fast), ref) < 1e-3


VARIANTS = {
    "gptq-4bit-g32-v1": dict(method="gptq", bits=4, group_size=32),
    "gptq-4bit-g32-v2": dict(method="gptq", bits=4, group_size=32, v2=True),
    "gptq-4bit-g32-act_order": dict(method="gptq", bits=4, group_size=32, act_order=True),
    "gptq-4bit-per_row": dict(method="gptq", bits=4, group_size=-1),
    "gptq-8bit-per_channel": dict(method="gptq", bits=8, group_size=-1),
    "gptq-8bit-g32": dict(method="gptq", bits=8, group_size=32),
    "gptq-8bit-per_channel-act_order": dict(method="gptq", bits=8, group_size=-1, act_order=True),
    "awq-g32": dict(method="awq", group_size=32),
    "awq-g64-bias": dict(method="awq", group_size=64, bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_packed_folders_load_exactly(tmp_path, variant, no_backends):
    kw = VARIANTS[variant]
    ref_model = tiny_model("llama")
    write_packed_folder(tmp_path, ref_model, **kw)
    ref = _logits(ref_model)
    model, _ = load_quantized(tmp_path, reference=True)
    lin = model.model.layers[1].mlp.down_proj
    assert isinstance(lin, Int8Linear if kw.get("bits") == 8 else Int4Linear)
    if isinstance(lin, Int4Linear):
        # group -1 (one per row of 128) becomes kernel groups of 128 sharing their scale
        assert lin.group_size == (128 if kw["group_size"] == -1 else kw["group_size"])
    assert (lin.bias is not None) == kw.get("bias", False)
    assert (_logits(model) - ref).abs().max() <= 1e-4 * ref.abs().max()
    fast, _ = load_quantized(tmp_path)
    assert _kl(_logits(fast), ref) < 1e-3


def _tamper_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, match", [
    ({"bits": 3}, "bits=3"),
    ({"checkpoint_format": "marlin"}, "marlin"),
    ({"group_size": 0}, "group_size=0"),
], ids=["gptq-3bit", "gptq-marlin", "gptq-group0"])
def test_gptq_configs_refused(tmp_path, changes, match):
    write_packed_folder(tmp_path, tiny_model("llama"), method="gptq")
    _tamper_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_quantized(tmp_path)


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin"])
def test_awq_versions_other_than_gemm_refused(tmp_path, version):
    write_packed_folder(tmp_path, tiny_model("llama"), method="awq")
    _tamper_config(tmp_path, version=version)
    with pytest.raises(CheckpointError, match=f"AWQ version '{version}'.*GEMM"):
        load_quantized(tmp_path)


def test_8bit_act_order_groups_refused(tmp_path):
    write_packed_folder(tmp_path, tiny_model("llama"), method="gptq", bits=8, group_size=32, act_order=True)
    with pytest.raises(CheckpointError, match="8-bit GPTQ with act-order"):
        load_quantized(tmp_path)


def test_wrong_shapes_and_missing_tensors_named(tmp_path):
    from safetensors.torch import load_file, save_file

    write_packed_folder(tmp_path, tiny_model("llama"), method="gptq")
    state = load_file(str(tmp_path / "model.safetensors"))
    bad = copy.copy(state)
    bad["model.layers.1.mlp.up_proj.qweight"] = bad["model.layers.1.mlp.up_proj.qweight"][:4]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.qweight: shape"):
        load_quantized(tmp_path)
    bad = {k: v for k, v in state.items() if k != "model.layers.0.mlp.gate_proj.scales"}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.scales is missing"):
        load_quantized(tmp_path)
    bad = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no tensor for model\.norm\.weight"):
        load_quantized(tmp_path)


def test_folders_that_are_not_community_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_quantized(tmp_path / "nowhere")
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_quantized(tmp_path)
    _cfg = json.loads((tmp_path / "config.json").read_text())
    _cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(_cfg))
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes'"):
        load_quantized(tmp_path)


def test_save_pretrained_reloads_with_plain_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    write_packed_folder(tmp_path / "src", tiny_model("llama"), method="gptq", act_order=True)
    model, _ = load_quantized(tmp_path / "src")
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert isinstance(again.model.layers[0].mlp.up_proj, Int4Linear)
    assert torch.equal(_logits(again), _logits(model))
