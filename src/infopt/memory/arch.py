"""Architecture shapes for memory estimates: resolve a model/config/name/path and read the shapes that cost bytes."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from ..core.errors import InfoptError
from ..core.introspect import text_config
from ..models import default_model_dir

__all__ = [
    "MemoryInputError",
    "ArchSpec",
    "Projection",
    "KNOWN_CONFIGS",
    "arch_spec",
    "load_known_config",
    "resolve_config",
]

# shipped in src/infopt/memory/configs/<name>.json (package data)
KNOWN_CONFIGS: tuple[str, ...] = (
    "llama-2-7b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "mistral-7b",
    "smollm2-135m",
)
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class MemoryInputError(InfoptError, ValueError):
    """An input to the memory estimator is invalid: the message names the field, the value and what is allowed.

    Subclasses ``ValueError`` (so ``except ValueError`` works) and :class:`~infopt.InfoptError` (so the
    ``infopt`` CLI prints it as ``infopt: error: ...`` with exit code 2).
    """


def bad_input(field: str, value: Any, allowed: str) -> MemoryInputError:
    """The error for one invalid field, worded like :func:`infopt.core.step.bad_field`."""
    return MemoryInputError(f"estimate_memory: {field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class Projection:
    """One projection matrix kind inside a decoder layer: ``count`` matrices of ``[out_features, in_features]``."""

    group: str  # "attention" or "mlp": where its bytes are reported
    name: str
    in_features: int
    out_features: int
    count: int = 1
    quantizable: bool = True  # False for MoE routers, which int8/int4 recipes leave in floating point

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features * self.count


# What differs between the families infopt supports (attribute names resolve from the config).
# qkv_bias / o_bias / mlp_bias: True, False, or the config attribute that says so.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": dict(),
    "mixtral": dict(),
    "qwen2_moe": dict(qkv_bias=True),
    "qwen3_moe": dict(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
    "olmoe": dict(qk_norm_full=True),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
    "gemma": dict(qkv_bias="attention_bias", o_bias="attention_bias"),
    "gemma2": dict(qkv_bias="attention_bias", o_bias="attention_bias", norms_per_layer=4),
    "gemma3_text": dict(qkv_bias="attention_bias", o_bias="attention_bias", norms_per_layer=4, qk_norm=True),
    "phi3": dict(),
    "gpt2": dict(qkv_bias=True, o_bias=True, mlp_bias=True, gated=False, layernorm=True, learned_positions=True),
}
# MoE layouts modelled: Mixtral's, Qwen2/Qwen3-MoE's (expert width moe_intermediate_size, a shared expert, dense
# layers by decoder_sparse_step / mlp_only_layers) and OLMoE's; DeepSeek's (n_routed_experts) is refused
_UNSUPPORTED_MOE_FIELDS = ("n_routed_experts",)


@dataclass(frozen=True)
class ArchSpec:
    """The shapes of a decoder-only causal LM that determine its memory.

    Attributes:
        name: where the config came from (known name, path, ``name_or_path``).
        model_type: ``config.model_type``; unknown types are counted as llama-like (see ``notes``).
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size: shapes.
        max_positions: context length the model was trained for (``max_position_embeddings``).
        tied_embeddings: ``lm_head`` shares the embedding matrix (counted once).
        gated_mlp: gate/up/down (llama-like, 3 matrices) vs fc/proj (GPT-2, 2 matrices).
        layernorm: LayerNorm with bias (GPT-2) vs RMSNorm (weight only).
        norms_per_layer: 2, or 4 for Gemma 2/3 (pre/post attention and feed-forward).
        qk_norm: per-head RMSNorm on q and k (Qwen3, Gemma 3).
        qkv_bias, o_bias, mlp_bias: which projections carry a bias.
        position_embeddings: rows of a learned position table (GPT-2), else 0 (rope).
        num_experts, experts_per_token: mixture of experts (1, 1 for dense models).
        moe_intermediate_size: one routed expert's width (0: ``intermediate_size``, as in Mixtral).
        shared_expert_size: width of a shared expert every token uses, with its ``[1, H]`` gate (Qwen2-MoE), or 0.
        dense_layers: indices of the layers of an MoE model that keep a dense MLP (``mlp_only_layers``,
            ``decoder_sparse_step``).
        qk_norm_full: RMSNorm on the whole q and k projections (OLMoE) rather than per head.
        layer_windows: per layer, the KV window in tokens (sliding/chunked attention) or None (full).
        config_dtype: the dtype the config declares (``float32``/``bfloat16``/``float16``) or None.
        param_dtype: the floating dtype of the model's parameters when a model was passed, else None.
        notes: assumptions made while reading the config.
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int | None
    tied_embeddings: bool
    gated_mlp: bool = True
    layernorm: bool = False
    norms_per_layer: int = 2
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    position_embeddings: int = 0
    num_experts: int = 1
    experts_per_token: int = 1
    moe_intermediate_size: int = 0
    shared_expert_size: int = 0
    dense_layers: tuple[int, ...] = ()
    qk_norm_full: bool = False
    layer_windows: tuple[int | None, ...] = ()
    config_dtype: str | None = None
    param_dtype: str | None = None
    notes: tuple[str, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds experts (False for every layer of a dense model)."""
        return self.num_experts > 1 and layer not in self.dense_layers

    def layer_projections(self, sparse: bool | None = None) -> tuple[Projection, ...]:
        """The projection matrices of one decoder layer (fused layouts such as Phi-3's ``qkv_proj`` count the same).

        Args:
            sparse: for an MoE model, a layer with experts (the default) or one of its dense layers.
        """
        sparse = self.num_experts > 1 if sparse is None else sparse and self.num_experts > 1
        h = self.hidden_size
        i = (self.moe_intermediate_size or self.intermediate_size) if sparse else self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # q_proj out, k/v_proj out
        out = [
            Projection("attention", "q_proj", h, q),
            Projection("attention", "k_proj", h, kv),
            Projection("attention", "v_proj", h, kv),
            Projection("attention", "o_proj", q, h),
        ]
        e = self.num_experts if sparse else 1
        if self.gated_mlp:
            out += [Projection("mlp", "gate_proj", h, i, e), Projection("mlp", "up_proj", h, i, e),
                    Projection("mlp", "down_proj", i, h, e)]
        else:
            out += [Projection("mlp", "fc", h, i, e), Projection("mlp", "proj", i, h, e)]
        if e > 1:
            out.append(Projection("mlp", "router", h, e, quantizable=False))
            if self.shared_expert_size:
                s = self.shared_expert_size
                out += [Projection("mlp", "shared_gate_proj", h, s), Projection("mlp", "shared_up_proj", h, s),
                        Projection("mlp", "shared_down_proj", s, h),
                        Projection("mlp", "shared_expert_gate", h, 1, quantizable=False)]
        return tuple(out)

    def inactive_expert_params(self) -> int:
        """Routed-expert parameters one token does not use: ``(E - k) / E`` of the experts of every sparse layer
        (0 for a dense model). Active parameters per token are the total minus this."""
        if self.num_experts <= 1:
            return 0
        per_layer = sum(p.numel for p in self.layer_projections(sparse=True) if p.count == self.num_experts)
        sparse = sum(self.is_sparse(i) for i in range(self.num_layers))
        return per_layer * sparse * (self.num_experts - self.experts_per_token) // self.num_experts

    def layer_bias_params(self) -> dict[str, int]:
        """Bias elements of one decoder layer, by group (``attention``/``mlp``)."""
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        attn = (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp_in = 2 * self.intermediate_size if self.gated_mlp else self.intermediate_size
        mlp = (mlp_in + h) * self.num_experts if self.mlp_bias else 0
        return {"attention": attn, "mlp": mlp}

    def norm_params(self) -> int:
        """Elements of every norm: per layer, q/k norms, and the final norm (LayerNorm has weight and bias)."""
        per = self.hidden_size * (2 if self.layernorm else 1)
        layer = self.norms_per_layer * per + (2 * self.head_dim if self.qk_norm else 0)
        if self.qk_norm_full:
            layer += (self.num_heads + self.num_kv_heads) * self.head_dim
        return self.num_layers * layer + per

    def kv_tokens(self, seq_len: int) -> tuple[int, ...]:
        """Tokens each layer's KV cache holds at ``seq_len``: the window for sliding layers, else all of them."""
        return tuple(seq_len if w is None else min(seq_len, w) for w in self.layer_windows)


def _known_path(name: str):
    return resources.files("infopt.memory").joinpath("configs", f"{name}.json")


def load_known_config(name: str) -> dict:
    """The shipped config of a known model, as a ``config.json``-style dict.

    Args:
        name: one of :data:`KNOWN_CONFIGS` (case-insensitive).

    Returns:
        A dict with ``model_type``, ``hidden_size``, ``num_hidden_layers``, ... (no weights).

    Raises:
        MemoryInputError: unknown name.

    Example:
        >>> load_known_config("llama-3-8b")["num_key_value_heads"]
        8
    """
    key = str(name).lower()
    if key not in KNOWN_CONFIGS:
        raise bad_input("model", name, ", ".join(KNOWN_CONFIGS))
    return json.loads(_known_path(key).read_text())


def _default_config() -> tuple[dict, str]:
    """The embedded default model's config.json, without loading its weights (shipped copy if not converted)."""
    try:
        path = default_model_dir(convert=False) / "config.json"
    except FileNotFoundError:
        path = None  # not converted yet: the shipped SmolLM2-135M shapes are the same model
    if path is not None and path.is_file():
        return json.loads(path.read_text()), f"default ({path.parent.name})"
    return load_known_config("smollm2-135m"), "default (shipped smollm2-135m config)"


def _read_json(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise bad_input("model", str(path.parent), "a folder containing config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise bad_input("model", str(path), f"a readable config.json ({e})") from e
    if not isinstance(data, dict):
        raise bad_input("model", str(path), "a JSON object (a Hugging Face config.json)")
    return data


def _config_from_dict(d: Mapping) -> Any:
    """A transformers config built from a config.json dict, so class defaults and derived fields
    (``layer_types``, Qwen2's ``use_sliding_window``) match what ``from_pretrained`` would see;
    the plain dict when transformers does not know the ``model_type``."""
    clean = {k: v for k, v in d.items() if not str(k).startswith("_")}
    if "model_type" not in clean:
        return clean
    from transformers import CONFIG_MAPPING, AutoConfig

    if clean["model_type"] not in CONFIG_MAPPING:
        return clean  # a model_type this transformers does not know: read the dict as is
    try:
        return AutoConfig.for_model(**clean)
    except (StrictDataclassError, ValueError, TypeError) as e:  # a field of the wrong type or value
        detail = " ".join(str(e).split())
        raise MemoryInputError(
            f"estimate_memory: transformers rejected the '{clean['model_type']}' config ({detail}); allowed: "
            f"the fields and types transformers' {CONFIG_MAPPING[clean['model_type']].__name__} accepts"
        ) from e


def resolve_config(config_or_model: Any) -> tuple[Any, str, str | None]:
    """Turn any accepted input into ``(config, name, float_dtype_of_model)``.

    Args:
        config_or_model: a transformers ``PreTrainedConfig``, a model with ``.config``, a config dict,
            a path to ``config.json`` or to a folder holding one, ``"default"``, or a name in
            :data:`KNOWN_CONFIGS`.

    Returns:
        ``(config, name, dtype)``: the text (decoder) config object or dict, a display name, and the
        floating dtype of the model's parameters when a model was passed (else None).

    Raises:
        MemoryInputError: an unknown name, a missing/unreadable file, or an unsupported type.

    Example:
        >>> cfg, name, dtype = resolve_config("mistral-7b")
        >>> cfg.sliding_window, name
        (4096, 'mistral-7b')
    """
    obj, dtype = config_or_model, None
    if hasattr(obj, "config") and hasattr(obj, "parameters"):  # a model: use its config, note its dtype
        for p in obj.parameters():
            if p.is_floating_point():
                dtype = str(p.dtype).removeprefix("torch.")
                break
        obj = obj.config
    if isinstance(obj, (str, os.PathLike)):
        s = str(obj)
        if s == "default":
            d, name = _default_config()
        elif Path(s).exists():  # a local folder or file wins over a known name spelled the same
            d, name = _read_json(Path(s)), s
        elif s.lower() in KNOWN_CONFIGS:
            d, name = load_known_config(s), s.lower()
        else:
            raise bad_input("model", s, f"'default', a known name ({', '.join(KNOWN_CONFIGS)}), or an existing "
                                        "config.json / model folder")
        return _decoder_config(_config_from_dict(d)), name, dtype
    if isinstance(obj, Mapping):
        return _decoder_config(_config_from_dict(obj)), str(obj.get("_name_or_path") or obj.get("model_type") or
                                                          "config dict"), dtype
    if hasattr(obj, "model_type") and hasattr(obj, "to_dict"):  # a transformers PreTrainedConfig
        name = getattr(obj, "name_or_path", "") or obj.model_type
        return _decoder_config(obj), name, dtype
    raise bad_input("config_or_model", type(obj).__name__,
                    "a transformers PreTrainedConfig, a model with .config, a dict, a config.json path, "
                    f"'default' or one of {', '.join(KNOWN_CONFIGS)}")


def _decoder_config(cfg: Any) -> Any:
    """:func:`infopt.core.introspect.text_config` (the decoder's side), for a raw ``config.json`` dict too."""
    if isinstance(cfg, Mapping):  # a raw dict (unknown model_type): a multimodal one nests the decoder
        text = cfg.get("text_config")
        return text if isinstance(text, Mapping) and "hidden_size" not in cfg else cfg
    return text_config(cfg, decoder=True)


_MISSING = object()


def _get(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` set (not None) on a config object or dict."""
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return v
    if default is _MISSING:
        raise bad_input(names[0], None, "a positive integer in the model config (it is required to size the model)")
    return default


def _positive_int(field: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or int(v) <= 0:
        raise bad_input(field, v, "a positive integer")
    return int(v)


def _dtype_name(v: Any) -> str | None:
    s = str(v).removeprefix("torch.") if v is not None else None
    return s if s in _FLOAT_DTYPES else None


def arch_spec(config_or_model: Any) -> ArchSpec:
    """Read the shapes that cost memory from a model, config, dict, path or known name.

    Args:
        config_or_model: anything :func:`resolve_config` accepts.

    Returns:
        :class:`ArchSpec`.

    Raises:
        MemoryInputError: a required field is missing or not a positive integer, the head counts do not
            divide, or the config is an MoE layout not modelled (DeepSeek's ``n_routed_experts``).

    Example:
        >>> s = arch_spec("llama-3-8b")
        >>> (s.num_layers, s.num_kv_heads, s.head_dim, s.tied_embeddings)
        (32, 8, 128, False)
    """
    cfg, name, param_dtype = resolve_config(config_or_model)
    model_type = str(_get(cfg, "model_type", default="unknown"))
    fam = _FAMILIES.get(model_type)
    notes: list[str] = []
    if fam is None:
        fam = {}
        notes.append(f"model_type '{model_type}' is not modelled specifically; counted as llama-like "
                     "(gated MLP, RMSNorm, no biases)")

    def flag(key: str) -> bool:
        v = fam.get(key, False)
        return bool(_get(cfg, v, default=False)) if isinstance(v, str) else bool(v)

    hidden = _positive_int("hidden_size", _get(cfg, "hidden_size", "n_embd"))
    layers = _positive_int("num_hidden_layers", _get(cfg, "num_hidden_layers", "n_layer"))
    heads = _positive_int("num_attention_heads", _get(cfg, "num_attention_heads", "n_head"))
    kv_heads = _positive_int("num_key_value_heads", _get(cfg, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise bad_input("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
    head_dim = _get(cfg, "head_dim", default=None)
    if head_dim is None:
        if hidden % heads:
            raise bad_input("head_dim", None, f"set explicitly: hidden_size={hidden} is not a multiple of "
                                              f"num_attention_heads={heads}")
        head_dim = hidden // heads
    head_dim = _positive_int("head_dim", head_dim)
    gated = fam.get("gated", True)
    inter = _get(cfg, "intermediate_size", "n_inner", default=None)
    if inter is None and not gated:
        inter = 4 * hidden  # GPT-2: n_inner=None means 4 x n_embd
    elif inter is None:
        raise bad_input("intermediate_size", None, "a positive integer in the model config (the MLP width)")
    inter = _positive_int("intermediate_size", inter)
    vocab = _positive_int("vocab_size", _get(cfg, "vocab_size"))
    max_pos = _get(cfg, "max_position_embeddings", "n_positions", default=None)
    max_pos = _positive_int("max_position_embeddings", max_pos) if max_pos is not None else None

    for f in _UNSUPPORTED_MOE_FIELDS:
        v = _get(cfg, f, default=None)
        if v and not isinstance(v, bool):
            raise bad_input(f, v, "a dense model or a Mixtral, Qwen2/Qwen3-MoE or OLMoE style MoE (num_local_experts "
                                  "or num_experts); other MoE layouts are not modelled yet")
    experts = _positive_int("num_local_experts", _get(cfg, "num_local_experts", "num_experts", default=None) or 1)
    top_k = _positive_int("num_experts_per_tok", _get(cfg, "num_experts_per_tok", default=1)) if experts > 1 else 1
    moe_inter = shared = 0
    dense_layers: tuple[int, ...] = ()
    if experts > 1:
        v = _get(cfg, "moe_intermediate_size", default=None)
        moe_inter = _positive_int("moe_intermediate_size", v) if v else 0
        v = _get(cfg, "shared_expert_intermediate_size", default=None)
        shared = _positive_int("shared_expert_intermediate_size", v) if v else 0
        step = _positive_int("decoder_sparse_step", _get(cfg, "decoder_sparse_step", default=None) or 1)
        only = set(_get(cfg, "mlp_only_layers", default=None) or ())
        dense_layers = tuple(i for i in range(layers) if i in only or (i + 1) % step)

    windows = _layer_windows(cfg, layers, notes)
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    return ArchSpec(
        name=name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        max_positions=max_pos,
        tied_embeddings=tied,
        gated_mlp=gated,
        layernorm=fam.get("layernorm", False),
        norms_per_layer=fam.get("norms_per_layer", 2),
        qk_norm=fam.get("qk_norm", False),
        qkv_bias=flag("qkv_bias"),
        o_bias=flag("o_bias"),
        mlp_bias=flag("mlp_bias"),
        position_embeddings=(max_pos or 0) if fam.get("learned_positions") else 0,
        num_experts=experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        shared_expert_size=shared,
        dense_layers=dense_layers,
        qk_norm_full=fam.get("qk_norm_full", False),
        layer_windows=windows,
        # older config.json files spell it torch_dtype (reading that attribute off a config object warns)
        config_dtype=_dtype_name(_get(cfg, *(("dtype", "torch_dtype") if isinstance(cfg, Mapping) else ("dtype",)),
                                      default=None)),
        param_dtype=_dtype_name(param_dtype),
        notes=tuple(notes),
    )


def _layer_windows(cfg: Any, layers: int, notes: list[str]) -> tuple[int | None, ...]:
    """Per layer KV window, following transformers' cache layout (``get_layer_types_and_kwargs``):
    ``layer_types`` when the config has them (Gemma 2/3, Qwen2), else every layer slides when
    ``sliding_window`` is set (Mistral v0.1, Phi-3)."""
    sw = _get(cfg, "sliding_window", default=None)
    if _get(cfg, "use_sliding_window", default=True) is False:
        sw = None  # Qwen2 raw config.json: sliding_window is set but switched off
    chunk = _get(cfg, "attention_chunk_size", default=None)
    types = _get(cfg, "layer_types", default=None)
    if types is None:
        types = ["sliding_attention" if sw else "full_attention"] * layers
    if len(types) != layers:
        raise bad_input("layer_types", f"{len(types)} entries", f"one per layer ({layers})")
    out: list[int | None] = []
    for t in types:
        if t == "sliding_attention" and sw:
            out.append(_positive_int("sliding_window", sw))
        elif t == "chunked_attention" and chunk:
            out.append(_positive_int("attention_chunk_size", chunk))
        else:
            out.append(None)
    n_win = sum(w is not None for w in out)
    if n_win:
        notes.append(f"{n_win} of {layers} layers use a {min(w for w in out if w)}-token window: their KV cache "
                     "stops growing there")
    return tuple(out)


def ceil_bytes(numel: int, bits: float) -> int:
    """Bytes to hold ``numel`` values of ``bits`` bits each (int4 packs two per byte)."""
    return math.ceil(numel * bits / 8)
