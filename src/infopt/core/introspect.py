"""Model introspection: decoder layers, attention/MLP linears, head counts, GQA and rope per family."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from .errors import IncompatibleModelError

__all__ = [
    "ModelInfo",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "inspect_model",
    "param_bytes",
    "linear_fqns",
    "context_length",
    "attention_window",
    "text_config",
]


@dataclass(frozen=True)
class _Family:
    """Where things live in one architecture family (names relative to a decoder layer)."""

    layers: str  # dotted path from the causal-LM root to the ModuleList of decoder layers
    attn: str
    attn_linears: tuple[str, ...]
    mlp: str
    mlp_linears: tuple[str, ...]
    embed: str
    lm_head: str = "lm_head"
    conv1d: bool = False  # GPT-2 uses transformers' Conv1D (weight stored [in, out])


_LLAMA_LIKE = _Family(
    layers="model.layers",
    attn="self_attn",
    attn_linears=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp="mlp",
    mlp_linears=("gate_proj", "up_proj", "down_proj"),
    embed="model.embed_tokens",
)

FAMILIES: dict[str, _Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    # mixture-of-experts families: attention as Llama; ``mlp`` is the sparse block (router ``gate``, 3D experts,
    # see core/moe.py), or a dense MLP in the layers a config keeps dense (Qwen2/Qwen3-MoE ``mlp_only_layers``)
    "mixtral": _LLAMA_LIKE,
    "qwen2_moe": _Family(
        layers="model.layers",
        attn="self_attn",
        attn_linears=("q_proj", "k_proj", "v_proj", "o_proj"),
        mlp="mlp",
        mlp_linears=("gate_proj", "up_proj", "down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                     "shared_expert.down_proj"),
        embed="model.embed_tokens",
    ),
    "qwen3_moe": _LLAMA_LIKE,
    "olmoe": _LLAMA_LIKE,
    "phi3": _Family(
        layers="model.layers",
        attn="self_attn",
        attn_linears=("qkv_proj", "o_proj"),
        mlp="mlp",
        mlp_linears=("gate_up_proj", "down_proj"),
        embed="model.embed_tokens",
    ),
    "gpt2": _Family(
        layers="transformer.h",
        attn="attn",
        attn_linears=("c_attn", "c_proj"),
        mlp="mlp",
        mlp_linears=("c_fc", "c_proj"),
        embed="transformer.wte",
        conv1d=True,
    ),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelInfo:
    """What infopt needs to know about a causal LM.

    Attributes:
        model_type: ``config.model_type`` (``llama``, ``gpt2``, ...).
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim: shapes.
        gqa_groups: query heads per KV head (1 = MHA).
        rope_theta: rope base, or None for learned positions (GPT-2).
        layer_fqns: dotted names of the decoder layers.
        attn_linear_fqns / mlp_linear_fqns: dotted names of the projection layers.
        lm_head_fqn, embed_fqn: output head and input embedding.
        tied_embeddings: True when ``lm_head.weight`` is the embedding matrix.
        conv1d: True when projections are transformers ``Conv1D`` (weight ``[in, out]``).
        dtype, device: of the first parameter.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float | None
    layer_fqns: tuple[str, ...]
    attn_linear_fqns: tuple[str, ...]
    mlp_linear_fqns: tuple[str, ...]
    lm_head_fqn: str
    embed_fqn: str
    tied_embeddings: bool
    conv1d: bool
    dtype: torch.dtype
    device: torch.device
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def gqa_groups(self) -> int:
        return self.num_heads // max(1, self.num_kv_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token costs across all layers, at the model's dtype."""
        elem = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 4
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def text_config(config, *, decoder: bool = False):
    """The part of a model config that describes its text decoder: ``config.get_text_config()`` where the config
    has that method (a multimodal config nests it: Gemma 3's ``text_config``), else ``config`` itself.

    Args:
        config: a transformers ``PretrainedConfig`` (or any object: returned as it is without ``get_text_config``).
        decoder: ask for the decoder's side only (``get_text_config(decoder=True)``: no ``text_encoder``, and an old
            encoder-decoder config's ``decoder_*`` fields): what transformers' caches read.

    Returns:
        The text config.

    Example:
        >>> from infopt.models import tiny_model
        >>> config = tiny_model("llama").config
        >>> text_config(config) is config, text_config(config, decoder=True) is config, text_config(3)
        (True, True, 3)
    """
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    return get(decoder=True) if decoder else get()


def context_length(model: nn.Module) -> int | None:
    """The model's trained context in tokens (``max_position_embeddings``; GPT-2's ``n_positions``), or None.

    Example:
        >>> from infopt.models import tiny_model
        >>> context_length(tiny_model("gpt2", max_positions=128))
        128
    """
    tc = text_config(model.config)
    n = getattr(tc, "max_position_embeddings", None) or getattr(tc, "n_positions", None)
    return int(n) if n else None


def attention_window(model: nn.Module) -> int | None:
    """The narrowest attention window of ``model``'s layers in tokens (sliding-window or chunked layers: Gemma 3,
    Mistral with ``sliding_window``), or None when every layer attends to all keys.

    Read the way transformers' own caches read the layer structure (``get_layer_types_and_kwargs``).

    Example:
        >>> from infopt.models import tiny_model
        >>> attention_window(tiny_model("gemma3")), attention_window(tiny_model("llama"))
        (64, None)
    """
    tc = text_config(model.config, decoder=True)
    _, per_layer = get_layer_types_and_kwargs(tc)
    if isinstance(per_layer, dict):  # older transformers (5.17): one mapping for every layer kind
        per_layer = [per_layer]
    windows = [int(kw["sliding_window"]) for kw in per_layer if kw.get("sliding_window")]
    return min(windows) if windows else None


def inspect_model(model: nn.Module) -> ModelInfo:
    """Describe a Hugging Face causal LM.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` instance.

    Returns:
        :class:`ModelInfo`.

    Raises:
        IncompatibleModelError: the model has no HF config or its ``model_type`` is not one of
            :data:`SUPPORTED_MODEL_TYPES`.

    Example:
        >>> from infopt.models import tiny_model
        >>> inspect_model(tiny_model("llama")).num_layers
        2
    """
    config = getattr(model, "config", None)
    if config is None:
        raise IncompatibleModelError(
            f"{type(model).__name__} has no `.config`; infopt works on Hugging Face transformers causal LMs "
            f"(AutoModelForCausalLM). Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    tc = text_config(config)
    model_type = getattr(tc, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise IncompatibleModelError(
            f"model_type '{model_type}' ({type(model).__name__}) is not supported yet. "
            f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Open an issue with the model name to have it added."
        )
    try:
        layers = model.get_submodule(family.layers)
    except AttributeError as e:
        raise IncompatibleModelError(
            f"{type(model).__name__} (model_type '{model_type}') has no '{family.layers}'; infopt expects the "
            "*ForCausalLM class (AutoModelForCausalLM), not the bare base model"
        ) from e
    n_layers = len(layers)
    layer_fqns = tuple(f"{family.layers}.{i}" for i in range(n_layers))

    def existing(prefix: str, sub: str, names: tuple[str, ...]) -> list[str]:
        out = []
        for n in names:
            fqn = f"{prefix}.{sub}.{n}"
            try:
                model.get_submodule(fqn)
            except AttributeError:
                continue
            out.append(fqn)
        return out

    attn, mlp = [], []
    for lf in layer_fqns:
        attn += existing(lf, family.attn, family.attn_linears)
        mlp += existing(lf, family.mlp, family.mlp_linears)

    hidden = getattr(tc, "hidden_size", None) or tc.n_embd
    heads = getattr(tc, "num_attention_heads", None) or tc.n_head
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or hidden // heads
    rope = getattr(tc, "rope_parameters", None)
    rope_theta = None
    extras: dict = {}
    if rope is not None and hasattr(rope, "get"):
        rope_theta = rope.get("rope_theta")
        nested = {k: v for k, v in rope.items() if isinstance(v, dict)}
        if rope_theta is None and nested:  # per layer type (Gemma 3: sliding vs full attention)
            extras["rope_theta_per_layer_type"] = {k: v.get("rope_theta") for k, v in nested.items()}
            rope_theta = (nested.get("full_attention") or next(iter(nested.values()))).get("rope_theta")
    if rope_theta is None:
        rope_theta = getattr(tc, "rope_theta", None)

    lm_head = getattr(model, "lm_head", None)
    embed = model.get_submodule(family.embed)
    # (an embedding that reads a quantized head's codes, quantize's share_embedding, has no weight of its own)
    embed_weight = getattr(embed, "weight", None)
    tied = lm_head is not None and embed_weight is not None and getattr(lm_head, "weight", None) is embed_weight
    p = next(model.parameters())
    return ModelInfo(
        model_type=model_type,
        num_layers=n_layers,
        hidden_size=int(hidden),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(tc.vocab_size),
        rope_theta=float(rope_theta) if rope_theta is not None else None,
        layer_fqns=layer_fqns,
        attn_linear_fqns=tuple(attn),
        mlp_linear_fqns=tuple(mlp),
        lm_head_fqn=family.lm_head,
        embed_fqn=family.embed,
        tied_embeddings=bool(tied),
        conv1d=family.conv1d,
        dtype=p.dtype,
        device=p.device,
        extras=extras,
    )


def linear_fqns(model: nn.Module, *, include_lm_head: bool = False) -> list[str]:
    """Dotted names of the attention and MLP projections (and optionally ``lm_head``)."""
    info = inspect_model(model)
    out = list(info.attn_linear_fqns) + list(info.mlp_linear_fqns)
    if include_lm_head:
        out.append(info.lm_head_fqn)
    return out


def param_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers, each stretch of memory counted once (tied weights once;
    views of one buffer, as fused projections are, each for its own rows)."""
    seen: set = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None:
            continue
        try:
            ptr = t.untyped_storage().data_ptr()
            key = (ptr, t.storage_offset(), t.numel()) if ptr != 0 else id(t)
        except (RuntimeError, NotImplementedError):
            key = id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
