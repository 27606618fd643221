"""Fixture writers for community checkpoint layouts, written from each format's documentation (not from infopt's reader).

- :func:`write_packed_folder`: a safetensors folder (GPTQ v1/v2 at 4 or 8 bits, act-order or not, or AWQ GEMM) from
  random codes, with the float model turned into its dequantized reference on the way.
- :func:`write_gguf`: a GGUF file of a tiny Llama/Qwen2 through ``gguf.GGUFWriter``; Q4_0/Q4_1/Q8_0/Q5_0 blocks from
  ``gguf.quants.quantize``, Q4_K/Q6_K blocks as random bytes (gguf-py has no K-quant encoder; any bytes with
  finite fp16 scales are valid blocks), q/k rows permuted the way llama.cpp's converter does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: word nibble i holds column AWQ_ORDER[i] of eight
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # int64 words in 0..2^32-1 -> int32 with the same bits
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` codes -> int32 ``[R * bits / 32, C]``, row ``r`` of each word at bits ``bits * (r % k)``."""
    k = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0] // k, k, codes.shape[1])
    return _to_int32((c << (torch.arange(k) * bits).view(1, k, 1)).sum(1))


def pack_cols(codes: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """``[R, C]`` codes -> int32 ``[R, C * bits / 32]``; nibble ``i`` of a word holds column ``order[i]`` of its ``k``."""
    k = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, k)
    if order is not None:
        c = c[..., list(order)]
    return _to_int32((c << (torch.arange(k) * bits).view(1, 1, k)).sum(-1))


def _linears(model: nn.Module):
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in LINEARS:
            yield name, mod


def write_packed_folder(folder: Path, model: nn.Module, *, method: str, bits: int = 4, group_size: int = 32,
                        act_order: bool = False, v2: bool = False, seed: int = 0, bias: bool = False) -> Path:
    """Quantize every decoder linear of ``model`` to random codes, store it in ``method``'s layout, and set the
    model's float weights to what those tensors stand for (the reference). ``group_size=-1``: one group per row."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    qmax = (1 << bits) - 1
    for name, lin in _linears(model):
        out_f, in_f = lin.weight.shape
        gs = in_f if group_size == -1 else group_size
        n_groups = in_f // gs
        codes = torch.randint(0, qmax + 1, (out_f, in_f), generator=g)
        if bits == 8:
            zeros = torch.full((out_f, n_groups), 128)  # sym: the only 8-bit zero point Int8Linear holds
        else:
            zeros = torch.randint(1, 15, (out_f, n_groups), generator=g)
        # weights of ~0.1 whatever the bit width (random 8-bit codes span 16x the 4-bit range)
        scales = ((torch.rand(out_f, n_groups, generator=g) * 0.02 + 0.005) / (16 if bits == 8 else 1)).half()
        if act_order:
            perm = torch.randperm(in_f, generator=g)
            g_idx = torch.empty(in_f, dtype=torch.int64)
            g_idx[perm] = torch.arange(in_f) // gs
        else:
            g_idx = torch.arange(in_f) // gs
        w = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
        lin.weight.data.copy_(w)
        if method == "gptq":
            stored_zeros = zeros if v2 else (zeros - 1) & qmax
            state[f"{name}.qweight"] = pack_rows(codes.t().contiguous(), bits)
            state[f"{name}.qzeros"] = pack_cols(stored_zeros.t().contiguous(), bits)
            state[f"{name}.g_idx"] = g_idx.to(torch.int32)
        else:
            state[f"{name}.qweight"] = pack_cols(codes.t().contiguous(), 4, AWQ_ORDER)
            state[f"{name}.qzeros"] = pack_cols(zeros.t().contiguous(), 4, AWQ_ORDER)
        state[f"{name}.scales"] = scales.t().contiguous()
        if bias:
            b = (torch.randn(out_f, generator=g) * 0.1).half()
            state[f"{name}.bias"] = b
            lin.bias = nn.Parameter(b.float(), requires_grad=False)
    owned = {k.rpartition(".")[0] for k in state}
    seen = set()
    for k, v in model.state_dict().items():
        if k.rpartition(".")[0] in owned or v.data_ptr() in seen:
            continue  # a tied head is restored from the config
        seen.add(v.data_ptr())
        state[k] = v.detach().clone().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if method == "gptq":
        qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": bits == 8,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    else:
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    config = model.config.to_dict()
    config["quantization_config"] = qcfg
    if bias:
        config["attention_bias"] = config["mlp_bias"] = True
    (folder / "config.json").write_text(json.dumps(config, default=str))
    return folder


# ---------------------------------------------------------------------------------------------------------- GGUF

GGUF_LINEARS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def tiny_vocab(size: int = 320) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of ``size`` tokens: the 256 bytes, merges of letter pairs, and two specials
    (``<|im_start|>`` bos, ``<|im_end|>`` eos, the last two ids)."""
    tokens = _bytes_to_unicode()
    letters = "etaoinshrdlucmfwyp"
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) >= size - 2:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    tokens += ["<|im_start|>", "<|im_end|>"]
    types = [1] * (size - 2) + [3, 3]
    return tokens, merges, types


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF -> GGUF order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator, dead: bool = True) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks for a ``[rows, cols]`` tensor (scales small enough for a sane model).
    ``dead``: Q4_K blocks with every sub-scale 0 (and random ones that happen to be 0); False makes every sub-scale
    odd."""
    nb = rows * cols // 256
    if kind == "Q4_K":
        blk = rng.integers(0, 256, (nb, 144), dtype=np.uint8)
        blk[:, 0:2] = (rng.random(nb) * 4e-5 + 1e-5).astype(np.float16).view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = (rng.random(nb) * 4e-5 + 1e-5).astype(np.float16).view(np.uint8).reshape(nb, 2)
        if dead:
            blk[: nb // 8, 4:16] = 0  # every sub-scale and min 0: groups of one value (0), the zero-scale path
        else:  # bit 0 of sub-scales 0..3 (bytes 4..7) and 4..7 (the low nibbles of bytes 12..15)
            blk[:, 4:8] |= 1
            blk[:, 12:16] |= 1
    else:
        blk = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
        blk[:, 208:210] = (rng.random(nb) * 2e-5 + 5e-6).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blk.reshape(rows, -1)


def encode(w: np.ndarray, kind: str, rng: np.random.Generator, dead: bool = True) -> tuple[np.ndarray, object]:
    """``(data, raw_dtype)`` for ``GGUFWriter.add_tensor``."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind in ("Q4_K", "Q6_K"):
        return random_k_blocks(w.shape[0], w.shape[1], kind, rng, dead), T[kind]
    return quants.quantize(w.astype(np.float32), T[kind]), T[kind]


def write_gguf(path: Path, model: nn.Module, types: dict[str, str], *, arch: str = "llama", seed: int = 0,
               dead_groups: bool = False, drop: tuple[str, ...] = (), reshape: dict[str, tuple] | None = None) -> Path:
    """Write ``model`` (a tiny Llama or Qwen2) as a GGUF file.

    Args:
        types: ggml type per GGUF role (``attn_q``, ..., ``token_embd``, ``output``); ``"default"`` for the rest
            of the linears. An ``output`` entry writes an untied head.
        dead_groups: give the first 32 weights of each Q4_1 row block a constant value (``d = 0`` blocks); Q4_K
            blocks have groups of sub-scale 0 unless it is False.
        drop: GGUF tensor names not to write; reshape: GGUF name -> a wrong ``[rows, cols]`` to write instead.
    """
    import gguf

    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, merges, ttypes = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.vocab_size - 2)
    w.add_eos_token_id(cfg.vocab_size - 1)

    def put(name: str, t: torch.Tensor, role: str, linear: bool):
        if name in drop:
            return
        a = t.detach().float().numpy()
        if reshape and name in reshape:
            a = np.resize(a, reshape[name])
        kind = types.get(role, types.get("default", "F32")) if linear or role == "token_embd" else "F32"
        if dead_groups and kind == "Q4_1":
            a = a.copy()
            a[::3, :32] = 0.01
        data, raw = encode(a, kind, rng, dead=dead_groups)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)

    put("token_embd.weight", model.model.embed_tokens.weight, "token_embd", False)
    for i, layer in enumerate(model.model.layers):
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, "norm", False)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, "norm", False)
        for hf, role in GGUF_LINEARS.items():
            mod = getattr(layer.self_attn if hf in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, hf)
            weight = mod.weight.detach()
            if arch == "llama" and hf in ("q_proj", "k_proj"):
                heads = cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads
                weight = torch.from_numpy(llama_permute(weight.numpy(), heads))
            put(f"blk.{i}.{role}.weight", weight, role, True)
            if mod.bias is not None:
                b = mod.bias.detach()
                if arch == "llama" and hf in ("q_proj", "k_proj"):
                    heads = cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads
                    b = torch.from_numpy(llama_permute(b.numpy(), heads))
                put(f"blk.{i}.{role}.bias", b, "bias", False)
    put("output_norm.weight", model.model.norm.weight, "norm", False)
    if "output" in types:
        put("output.weight", model.lm_head.weight, "output", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
