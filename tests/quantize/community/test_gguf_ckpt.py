"""GGUF files onto int4/int8 layers: logits against transformers' own (dequantizing) GGUF loader, on tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infopt.core.errors import CheckpointError
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int8Linear
from infopt.quantize.community import load_quantized

from .writers import write_gguf

pytest.importorskip("gguf")

VOCAB = 320
# K-quant super-blocks are 256 weights, so every input dimension is a multiple of 256
SHAPES = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, vocab_size=VOCAB)

CASES = {
    "q4_0-embd_q8_0": {"default": "Q4_0", "token_embd": "Q8_0"},
    "q4_1-dead_groups": {"default": "Q4_1", "token_embd": "F16"},
    "q4_k_m-head_q6_k": {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q4_K",
                         "output": "Q6_K"},
    "q8_0-head_q8_0": {"default": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"},
    "q4_k_m-tied_q6_k": {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
    "f16-dense": {"default": "F16", "token_embd": "F16"},
}
EXPECT = {"Q4_0": Int4Linear, "Q4_1": Int4Linear, "Q4_K": Int4Linear, "Q8_0": Int8Linear, "Q6_K": Int8Linear,
          "F16": torch.nn.Linear}


def _write(tmp_path, types, arch="llama", **kw):
    model = tiny_model(arch, **SHAPES)
    return write_gguf(tmp_path / "m.gguf", model, types, arch=arch, dead_groups=True, **kw)


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gguf_types_load_exactly(tmp_path, case):
    types = CASES[case]
    path = _write(tmp_path, types)
    ref = _logits(_reference(path), IDS)
    model, tok = load_quantized(path, reference=True)
    # the swap: each linear's type follows its tensor's ggml type
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is EXPECT[types["default"]]
    assert type(layer.self_attn.v_proj) is EXPECT[types.get("attn_v", types["default"])]
    assert type(layer.mlp.down_proj) is EXPECT[types.get("ffn_down", types["default"])]
    head = model.get_output_embeddings()
    if "output" in types:
        assert type(head) is EXPECT[types["output"]]
    else:  # tied: the head reads the (dense) embedding
        assert head.weight is model.get_input_embeddings().weight
    # the reference path computes with the file's weights in fp32: equal up to rounding
    out = _logits(model, IDS)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    # the kernels (bf16 activations in the int4 one): the same model within bf16 noise
    fast, _ = load_quantized(path, tokenizer=False)
    kl = F.kl_div(F.log_softmax(_logits(fast, IDS), -1), F.log_softmax(ref, -1), log_target=True,
                  reduction="batchmean")
    assert kl < 1e-3
    assert tok is not None and tok.convert_tokens_to_ids("<|im_end|>") == VOCAB - 1


@pytest.mark.parametrize("case", ["q4_0-embd_q8_0", "q4_k_m-head_q6_k"])
def test_int8_activation_layers_hold_the_files_weights_exactly(tmp_path, case):
    """With ``activations="auto"`` the weights the kernels multiply are the file's, bit for bit: Q4_0's fp16 scales
    (a8_sym), Q4_K's two-level scales (a8_k: d * sc and dmin * m computed in fp32, exact), Q6_K's group scales."""
    from gguf import GGUFReader, dequantize

    from infopt.quantize.formats import a8

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    types = CASES[case]
    path = _write(tmp_path, types)
    fast, _ = load_quantized(path, tokenizer=False, activations="auto")
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def file_weight(name):
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32")).reshape(
            *reversed([int(d) for d in t.shape]))

    for i, layer in enumerate(fast.model.layers):
        up, down = layer.mlp.up_proj, layer.mlp.down_proj
        assert up.layout == {"Q4_0": "a8_sym", "Q4_K": "a8_k"}[types["default"]]
        held = a8.int4_dense_t(up.weight_packed, up.scale_min, 32, torch.float32).t()
        assert torch.equal(held, file_weight(f"blk.{i}.ffn_up.weight"))
        if types.get("ffn_down") == "Q6_K":  # its two-level scales as the file holds them
            assert down.wscale.dtype == torch.uint8
            assert torch.equal(down.dequantize().float(), file_weight(f"blk.{i}.ffn_down.weight"))
    # saved (the portable codes, scales and zero points) and loaded back: the same layouts and the same weights
    from transformers import AutoModelForCausalLM

    fast.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.model.layers[0].mlp.up_proj.layout == fast.model.layers[0].mlp.up_proj.layout
    assert torch.equal(_logits(again, IDS), _logits(fast, IDS))


def test_qwen2_with_biases_and_no_qk_permutation(tmp_path):
    path = _write(tmp_path, {"default": "Q4_K", "token_embd": "Q8_0"}, arch="qwen2")
    model, _ = load_quantized(path, reference=True, tokenizer=False)
    q = model.model.layers[1].self_attn.q_proj
    assert isinstance(q, Int4Linear) and q.bias is not None
    ref = _logits(_reference(path), IDS)
    assert (_logits(model, IDS) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_config_and_tokenizer_match_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = _write(tmp_path, {"default": "Q4_0", "token_embd": "Q8_0"})
    model, tok = load_quantized(path)
    want = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    got = model.config.to_dict()
    for key in ("dtype", "torch_dtype", "transformers_version"):
        want.pop(key, None)
        got.pop(key, None)
    assert got == want
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "the reader is fast<|im_end|> déjà"
    assert tok(text).input_ids == ref_tok(text).input_ids
    assert (tok.bos_token, tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)


def test_generate_and_bf16(tmp_path):
    """Loaded in bf16 onto the int4 kernel: the logits of transformers' own fp32 loader within bf16 noise (KL 4.3e-5,
    top-1 1.0 measured) and its greedy tokens."""
    path = _write(tmp_path, {"default": "Q4_1", "token_embd": "Q8_0"})
    reference = _reference(path)
    model, _ = load_quantized(path, dtype=torch.bfloat16, tokenizer=False)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)
    with torch.no_grad():
        raw = model(IDS).logits
    assert raw.dtype == torch.bfloat16
    out, ref = raw.float(), _logits(reference, IDS)
    kl = F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    assert kl < 1e-3 and (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95, kl
    for row in (IDS[:1], IDS[1:]):
        got = model.generate(row, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        want = reference.generate(row, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert got.tolist() == want.tolist()


def test_unsupported_linear_type_names_the_tensor(tmp_path):
    path = _write(tmp_path, {"default": "Q4_0", "ffn_up": "Q5_0"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        load_quantized(path)


def test_wrong_shape_and_missing_tensor(tmp_path):
    path = _write(tmp_path, {"default": "Q4_0"}, reshape={"blk.1.ffn_up.weight": (256, 256)})
    with pytest.raises(CheckpointError, match="shape"):
        load_quantized(path, tokenizer=False)
    path = _write(tmp_path, {"default": "Q4_0"}, drop=("blk.1.ffn_norm.weight",))
    with pytest.raises(CheckpointError, match="post_attention_layernorm"):
        load_quantized(path, tokenizer=False)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_quantized(bad)


def test_architectures_whose_tensors_transformers_reshapes_are_refused():
    from infopt.quantize.community.gguf_ckpt import _processor

    with pytest.raises(CheckpointError, match="GPT2TensorProcessor"):
        _processor("gpt2", {}, "x.gguf")


def test_save_pretrained_reloads_with_plain_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _write(tmp_path, {"default": "Q4_K", "attn_v": "Q6_K", "output": "Q8_0"})
    model, tok = load_quantized(path)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert isinstance(again.lm_head, Int8Linear) and isinstance(again.model.layers[0].mlp.up_proj, Int4Linear)
    assert torch.equal(_logits(again, IDS), _logits(model, IDS))


def test_device_argument_packs_for_the_devices_kernel(tmp_path, device):
    from tests.devices import DEVICES

    path = _write(tmp_path, {"default": "Q4_K", "attn_v": "Q6_K", "token_embd": "Q8_0"})
    ref = _logits(_reference(path), IDS)
    model, _ = load_quantized(path, device=device, tokenizer=False)
    assert model.model.layers[0].mlp.up_proj.layout == DEVICES[device].int4_layout
    assert model.model.layers[0].self_attn.v_proj.weight_int8.device.type == device
    out = _logits(model, IDS.to(device)).cpu()
    assert F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean") < 1e-3


@pytest.mark.parametrize("case", ["q4_0-embd_q8_0", "q4_1-dead_groups", "q4_k_m-head_q6_k", "q4_k_m-tied_q6_k"])
def test_cpu_fast_layers_transcoded_from_llama_cpp_files_are_the_decoded_ones(tmp_path, monkeypatch, case):
    """Files as llama.cpp writes them (group scales, dead groups, Q4_K super-blocks, llama's permuted q/k rows):
    ``activations="auto"`` builds the same layers through the C++ transcoder as through decoding, bit for bit."""
    from infopt.quantize.community import gguf_blocks, gguf_ckpt
    from infopt.quantize.formats import a8

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    path = _write(tmp_path, CASES[case])
    written, real = [], gguf_blocks.a8_int4
    for module in (gguf_ckpt, gguf_blocks):  # (gguf_blocks': the codes of Q4_K's a8_k layers)
        monkeypatch.setattr(module, "a8_int4", lambda *a, **k: written.append(real(*a, **k)) or written[-1])
    fast, _ = load_quantized(path, tokenizer=False, activations="auto")
    kind = CASES[case]["default"]
    int4 = sum(kind == CASES[case].get(n, kind) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                          "ffn_up", "ffn_down"))
    assert len(written) == int4 * SHAPES["num_layers"] and None not in written  # each int4 linear transcoded once
    for module in (gguf_ckpt, gguf_blocks):
        monkeypatch.setattr(module, "a8_int4", lambda *a, **k: None)
    monkeypatch.setattr(gguf_ckpt, "a8_int8", lambda *a: None)
    slow, _ = load_quantized(path, tokenizer=False, activations="auto")
    # Q4_0's symmetric codes keep their fp16 scales alone (a8_sym), Q4_K its two-level scales (a8_k); Q4_1 needs a
    # minimum too (a8)
    assert fast.model.layers[0].self_attn.q_proj.layout == {"Q4_0": "a8_sym", "Q4_K": "a8_k"}.get(kind, "a8")
    got, want = dict(fast.named_buffers()), dict(slow.named_buffers())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert torch.equal(_logits(fast, IDS), _logits(slow, IDS))


@pytest.mark.parametrize("case", ["q4_k_m-tied_q6_k", "q4_0-embd_q8_0", "q8_0-head_q8_0"])
def test_cpu_fast_takes_llama_cpp_group_scales_on_int8_activations(tmp_path, case):
    """A Q4_K_M file as llama.cpp writes a tied model (Q6_K ``attn_v``, ``ffn_down`` and token embedding) or Q8_0
    blocks with a scale per 32: ``activations="auto"`` gives every 8-bit linear int8 activations with the file's group
    scales as they are, and a tied 8-bit embedding becomes the int8 head whose codes the embedding reads, looking up
    exactly the file's rows; the logits stay within activation quantization's loss of the file's own."""
    from infopt.quantize.community.gguf_ckpt import Int8Blocks
    from infopt.quantize.formats import a8
    from infopt.quantize.formats.int8 import SharedInt8Embedding

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    types = CASES[case]
    path = _write(tmp_path, types)
    reference, _ = load_quantized(path, reference=True, tokenizer=False)
    fast, _ = load_quantized(path, tokenizer=False, activations="auto")
    group = {"Q6_K": 16, "Q8_0": 32}
    int8 = [(n, m) for n, m in fast.named_modules() if isinstance(m, Int8Linear)]
    assert int8 and all(m.layout == "a8" for _, m in int8), [(n, m.layout) for n, m in int8]
    v = fast.model.layers[0].self_attn.v_proj
    if types.get("attn_v", types["default"]) in Int8Blocks:
        assert v.group_size == group[types.get("attn_v", types["default"])]
    head, emb = fast.get_output_embeddings(), fast.get_input_embeddings()
    if "output" not in types:  # tied: one int8 copy, the embedding reads its rows
        assert isinstance(emb, SharedInt8Embedding) and emb.head is head
        assert head.group_size == group[types["token_embd"]]
        ids = torch.arange(VOCAB)
        assert torch.equal(emb(ids), reference.get_input_embeddings()(ids))
    before = a8.kernel_calls()["int8_a8_linear"]
    out, ref = _logits(fast, IDS), _logits(reference, IDS)
    assert a8.kernel_calls()["int8_a8_linear"] - before >= len(int8)
    kl = F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    assert kl < 1e-2, kl


def _mapped_from(path, t: torch.Tensor) -> bool:
    """Whether tensor ``t``'s memory lies in a mapping of file ``path`` (Linux's /proc/self/maps)."""
    ptr, name = t.data_ptr(), str(path.resolve())
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return len(fields) >= 6 and fields[5] == name
    return False


@pytest.mark.parametrize("kind, dtype, mapped", [("F32", torch.float32, True), ("F16", torch.float16, True),
                                                 ("F16", torch.float32, False)])
def test_large_dense_tensors_stay_copy_on_write_views_of_the_file(tmp_path, monkeypatch, kind, dtype, mapped):
    """``mmap=True`` (the default): a large dense tensor already in the model's dtype is the file's pages, not a copy;
    the model computes the same logits, writes into it reach the model and never the file. One that needs a cast,
    or ``mmap=False``, is the process's own memory."""
    import os

    from infopt.quantize.community import gguf_ckpt

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads /proc/self/maps to see where the weights live (Linux)")
    monkeypatch.setattr(gguf_ckpt, "_MAP_BYTES", 64 << 10)  # the tiny embedding: 320 x 256 values
    path = _write(tmp_path, {"default": "Q4_0", "token_embd": kind, "output": "Q8_0"})
    written = path.read_bytes()
    model, _ = load_quantized(path, dtype=dtype, tokenizer=False)
    copy, _ = load_quantized(path, dtype=dtype, tokenizer=False, mmap=False)
    weight = model.get_input_embeddings().weight
    assert weight.dtype == dtype and _mapped_from(path, weight) is mapped
    assert not _mapped_from(path, copy.get_input_embeddings().weight)
    assert torch.equal(_logits(model, IDS), _logits(copy, IDS))
    with torch.no_grad():
        weight[IDS[0, 0]] += 1  # copy on write: this process's page only
    assert path.read_bytes() == written
    assert not torch.equal(_logits(model, IDS), _logits(copy, IDS))
    again, _ = load_quantized(path, dtype=dtype, tokenizer=False)
    assert torch.equal(_logits(again, IDS), _logits(copy, IDS))


@pytest.mark.parametrize("embd", ["Q4_0", "Q4_K", "Q8_0"])
def test_an_untied_quantized_embedding_keeps_its_blocks(tmp_path, monkeypatch, embd):
    """``cpu-fast``'s layers (``activations="auto"``) keep an untied quantized token embedding in the file's blocks
    (mapped from the file where large), as llama.cpp's quantizer writes one (Q4_0 in a Q4_0 file, Q4_K in a Q4_K_M
    one, the head in Q6_K): every lookup, eager or compiled, is bit for bit the dense decode's row, so the logits
    equal those of the same load with the embedding decoded dense; its state dict is that dense matrix
    (``save_pretrained`` writes a plain embedding, which loads back to the same logits, the file's Q6_K group scales
    kept), and ``export_gguf`` writes its blocks as read."""
    from gguf import GGMLQuantizationType

    from infopt.quantize.community import gguf_ckpt
    from infopt.quantize.community.gguf_embedding import BlockEmbedding
    from infopt.quantize.formats import a8

    if a8.resolve("auto", "cpu") != "int8":
        pytest.skip("the a8 layouts need the C++ kernel with AVX512-VNNI or AVX2")
    types = {"default": "Q4_0", "attn_v": "Q6_K", "token_embd": embd, "output": "Q6_K"}  # untied: a head of its own
    path = _write(tmp_path, types)
    monkeypatch.setattr(gguf_ckpt, "_MAP_BYTES", 16 << 10)
    model, _ = load_quantized(path, tokenizer=False, activations="auto")
    emb = model.get_input_embeddings()
    assert isinstance(emb, BlockEmbedding) and emb.kind == types["token_embd"] and _mapped_from(path, emb.blocks)
    monkeypatch.setattr(gguf_ckpt, "_block_embedding", lambda *a: None)
    dense, _ = load_quantized(path, tokenizer=False, activations="auto")
    assert type(dense.get_input_embeddings()) is torch.nn.Embedding
    ids = torch.arange(VOCAB).view(4, -1)
    assert torch.equal(emb(ids), dense.get_input_embeddings()(ids))
    assert torch.equal(torch.compile(emb, fullgraph=True)(ids), emb(ids))  # as in cpu-fast's compiled step
    assert torch.equal(_logits(model, IDS), _logits(dense, IDS))
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], dense.get_input_embeddings().weight)
    model.load_state_dict(state)  # its own values: taken
    with pytest.raises(RuntimeError, match="block embedding keeps the file's rows"):
        model.load_state_dict({**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"] + 1})

    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(again.get_input_embeddings()) is torch.nn.Embedding
    assert torch.equal(_logits(again, IDS), _logits(model, IDS))

    import infopt

    infopt.export_gguf(model, tmp_path / "again.gguf")
    src = {t.name: t for t in gguf_ckpt._reader(str(path)).tensors}
    out = {t.name: t for t in gguf_ckpt._reader(str(tmp_path / "again.gguf")).tensors}
    embd = GGMLQuantizationType[types["token_embd"]]
    assert out["token_embd.weight"].tensor_type == src["token_embd.weight"].tensor_type == embd
    assert bytes(out["token_embd.weight"].data) == bytes(src["token_embd.weight"].data)
