"""Memory estimate of a causal LM for inference: weights, KV cache, activations, and which GPUs it fits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .arch import ArchSpec, arch_spec, bad_input, ceil_bytes

__all__ = [
    "DTYPE_BITS",
    "GPUS",
    "GpuFit",
    "MemoryEstimate",
    "estimate_memory",
]

DTYPE_BITS: dict[str, int] = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "int4": 4}
_FLOAT = ("float32", "bfloat16", "float16")

# Decimal capacities as marketed; `usable_fraction` leaves room for the CUDA context, the allocator and
# temporaries (vLLM's default gpu_memory_utilization is the same 0.9).
GPUS: dict[str, int] = {
    "H100 80GB": 80 * 10**9,
    "H200 141GB": 141 * 10**9,
    "A100 40GB": 40 * 10**9,
    "A100 80GB": 80 * 10**9,
    "RTX 4090 24GB": 24 * 10**9,
}

# Weight quantization layouts (the parts of a quantized matrix that are not the integer codes):
INT8_SCALE_BYTES_PER_ROW = 4  # one fp32 scale per output channel (infopt.quantize.Int8WeightOnly)
INT4_GROUP = 128  # int4: one group of 128 input values per scale ...
INT4_BYTES_PER_GROUP = 4  # ... holding a 16-bit scale and a 16-bit zero point (torchao Int4WeightOnly, AWQ, GPTQ)
# KV quantization (transformers QuantizedCache): a 16-bit scale and zero point per group of 64 values
KV_INT_GROUP = 64
KV_INT_BYTES_PER_GROUP = 4
LOGITS_BYTES = 4  # logits are upcast to fp32 before sampling


@dataclass(frozen=True)
class GpuFit:
    """Whether an estimate fits one GPU model (per device, after tensor parallelism).

    Attributes:
        gpu: name, e.g. ``"H100 80GB"``.
        capacity_bytes: the card's memory.
        usable_bytes: ``capacity_bytes * usable_fraction``.
        fits: the requested batch fits in ``usable_bytes`` on each of the ``tp`` devices.
        max_batch: the largest batch that fits at the requested ``seq_len`` (0: not even the weights).
    """

    gpu: str
    capacity_bytes: int
    usable_bytes: int
    fits: bool
    max_batch: int


@dataclass(frozen=True)
class MemoryEstimate:
    """The result of :func:`estimate_memory`; every size is in bytes.

    Attributes:
        name, model_type: what was estimated.
        weight_dtype, kv_dtype: as resolved (never "auto").
        float_dtype: dtype of activations and of the parts int8/int4 leave unquantized.
        batch, seq_len, tp, prefill_chunk, usable_fraction: the inputs.
        num_params: parameter count (tied embeddings once): every parameter resident in memory.
        active_params: parameters one token uses: ``num_params`` less the routed experts it is not sent to
            (``(E - k) / E`` of each MoE layer's experts; shared experts and routers count). Equal to
            ``num_params`` for a dense model.
        weights_bytes: all weights, with ``weights_breakdown`` by part (``embeddings``, ``attention``,
            ``mlp``, ``norms``, ``lm_head``, and ``quant_scales`` for int8/int4).
        kv_cache_bytes: keys and values for ``batch`` sequences of ``seq_len`` tokens.
        activations_bytes: rough peak of live activations plus last-position logits (see docs/memory.md).
        total_bytes: weights + KV cache + activations.
        per_device: the same four figures on each of ``tp`` devices.
        fits: per GPU in :data:`GPUS` (or the ``gpus`` argument), a :class:`GpuFit`.
        spec: the architecture shapes read from the config.
        notes: assumptions that apply to this estimate.
    """

    name: str
    model_type: str
    weight_dtype: str
    kv_dtype: str
    float_dtype: str
    batch: int
    seq_len: int
    tp: int
    prefill_chunk: int
    usable_fraction: float
    num_params: int
    weights_bytes: int
    weights_breakdown: dict[str, int]
    kv_cache_bytes: int
    activations_bytes: int
    total_bytes: int
    per_device: dict[str, int]
    fits: dict[str, GpuFit]
    spec: ArchSpec = field(repr=False)
    notes: tuple[str, ...] = ()
    active_params: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (sizes in bytes; ``spec`` as a dict of shapes).

        Example:
            >>> import json
            >>> json.loads(json.dumps(estimate_memory("llama-2-7b").to_dict()))["num_params"]
            6738415616
        """
        d = asdict(self)
        d["spec"]["layer_windows"] = list(self.spec.layer_windows)
        d["notes"] = list(self.notes)
        d["spec"]["notes"] = list(self.spec.notes)
        return d


def _check_dtype(field_name: str, v: Any, allowed: tuple[str, ...]) -> str | None:
    if v is None or v == "auto":
        return None
    if v not in allowed:
        raise bad_input(field_name, v, ", ".join(("auto",) + allowed))
    return v


def _check_int(field_name: str, v: Any, *, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise bad_input(field_name, v, f"an integer >= {minimum}")
    return v


def _weights(spec: ArchSpec, weight_dtype: str, float_dtype: str) -> tuple[int, dict[str, int]]:
    """``(num_params, bytes by part)``. Int8/int4 quantize the attention and MLP matrices only; embeddings,
    norms, biases, MoE routers and an untied ``lm_head`` stay at ``float_dtype``."""
    fb = DTYPE_BITS[weight_dtype if weight_dtype in _FLOAT else float_dtype]
    quantized = weight_dtype not in _FLOAT
    h, v, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    n_embed = v * h + spec.position_embeddings * h  # wte [V, H] (+ GPT-2's wpe [P, H])
    n_head = 0 if spec.tied_embeddings else v * h  # lm_head [V, H]
    n_norm = spec.norm_params()
    parts = {"embeddings": ceil_bytes(n_embed, fb), "attention": 0, "mlp": 0, "norms": ceil_bytes(n_norm, fb),
             "lm_head": ceil_bytes(n_head, fb)}
    scales = 0
    n_params = n_embed + n_head + n_norm
    sparse = sum(spec.is_sparse(i) for i in range(L))
    for lin, layers in [(lin, sparse) for lin in spec.layer_projections(sparse=True)] * (sparse > 0) + \
            [(lin, L - sparse) for lin in spec.layer_projections(sparse=False)] * (L - sparse > 0):
        n = lin.numel * layers
        n_params += n
        if quantized and lin.quantizable:
            parts[lin.group] += ceil_bytes(n, DTYPE_BITS[weight_dtype])
            rows = lin.out_features * lin.count * layers  # a matrix is [out, in]: scales per row (int8) / row-group
            if weight_dtype == "int8":
                scales += rows * INT8_SCALE_BYTES_PER_ROW
            else:
                scales += rows * math.ceil(lin.in_features / INT4_GROUP) * INT4_BYTES_PER_GROUP
        else:
            parts[lin.group] += ceil_bytes(n, fb)
    for group, n in spec.layer_bias_params().items():
        n_params += n * L
        parts[group] += ceil_bytes(n * L, fb)
    if quantized:
        parts["quant_scales"] = scales
    return n_params, parts


def _kv_per_seq(spec: ArchSpec, seq_len: int, kv_dtype: str) -> int:
    """KV bytes of one sequence: 2 (k, v) x kv_heads x head_dim x sum over layers of cached tokens."""
    # each layer holds k and v of shape [1, kv_heads, tokens_l, head_dim]; tokens_l <= window on sliding layers
    elems = 2 * spec.num_kv_heads * spec.head_dim * sum(spec.kv_tokens(seq_len))
    out = ceil_bytes(elems, DTYPE_BITS[kv_dtype])
    if kv_dtype not in _FLOAT:
        out += math.ceil(elems / KV_INT_GROUP) * KV_INT_BYTES_PER_GROUP
    return out


def _activations_per_seq(spec: ArchSpec, chunk: int, seq_len: int, act_dtype: str) -> int:
    """Rough peak of live activations for one sequence while a chunk of ``chunk`` tokens goes through a layer.

    Per token, at the MLP of a decoder layer in transformers' eager Python: 4 x hidden (the embeddings,
    the layer's input still held by the caller, the residual after attention, and its normed copy) plus
    the MLP's intermediates x experts per token (gated: act(gate), up and their product, 3 x
    intermediate; GPT-2: fc output and the tanh-GELU's temporaries, 4 x intermediate), or, when larger,
    the attention's 3 x (q_dim + kv_dim) (q, k, v and their rotated copies or the attention output);
    plus rope cos/sin (2 x head_dim). A fused attention kernel (SDPA, flash) is assumed: no [S, S]
    score matrix. But when a sliding window is shorter than ``seq_len``, transformers' SDPA path builds
    a [chunk, S] boolean mask that SDPA turns into an additive one of the activation dtype
    (1 + act bytes per element; flash attention needs neither). Plus the last position's logits
    [vocab] in fp32, as ``generate`` computes logits for the last position only. Checked on CPU
    against the profiler's peak (docs/memory.md).
    """
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    mlp_live = (3 if spec.gated_mlp else 4) * spec.intermediate_size * spec.experts_per_token
    attn_live = 3 * (q_dim + kv_dim)
    per_token = 4 * spec.hidden_size + max(mlp_live, attn_live) + 2 * spec.head_dim
    out = ceil_bytes(chunk * per_token, DTYPE_BITS[act_dtype]) + spec.vocab_size * LOGITS_BYTES
    if any(w is not None and w < seq_len for w in spec.layer_windows):
        out += chunk * seq_len * (1 + DTYPE_BITS[act_dtype] // 8)  # mask [1, 1, chunk, S]: bool + additive
    return out


def estimate_memory(
    config_or_model: Any,
    *,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    batch: int = 1,
    seq_len: int = 2048,
    tp: int = 1,
    float_dtype: str | None = None,
    prefill_chunk: int | None = None,
    usable_fraction: float = 0.9,
    gpus: Mapping[str, float] | None = None,
) -> MemoryEstimate:
    """Estimate the GPU memory an inference run needs, from the config alone (no weights are loaded).

    Weights are counted analytically from the config: embeddings, q/k/v/o per layer (GQA aware),
    MLP (gated: 3 matrices; GPT-2: 2, Conv1D counts the same), norms, biases, and ``lm_head``
    unless ``tie_word_embeddings``. Int8 adds one fp32 scale per output channel; int4 packs two
    values per byte and adds a 16-bit scale and zero point per group of 128 inputs. **Assumption:**
    int8/int4 quantize only the attention and MLP matrices (what ``infopt.quantize``, torchao, AWQ
    and GPTQ do by default); embeddings, norms, biases and ``lm_head`` stay at the model's float
    dtype (``float_dtype``). KV cache = 2 x sum over layers of (kv_heads x head_dim x cached tokens)
    x batch x bytes, where a sliding-window layer caches at most ``window`` tokens. Activations are
    a rough prefill peak (see ``docs/memory.md``). With ``tp`` > 1 weights and KV heads are split
    over ``tp`` devices and activations are replicated.

    Args:
        config_or_model: a transformers ``PreTrainedConfig``, a model (its config is used), a
            config dict, a path to ``config.json`` or its folder, ``"default"`` (the embedded
            SmolLM2-135M, weights not loaded) or one of :data:`~infopt.memory.KNOWN_CONFIGS`.
        weight_dtype: ``float32``, ``bfloat16``, ``float16``, ``int8``, ``int4``, or None/``"auto"``
            for ``float_dtype``.
        kv_dtype: same choices; None/``"auto"``: the activation dtype.
        batch: sequences decoded together.
        seq_len: tokens per sequence (prompt + generated) the KV cache must hold.
        tp: tensor-parallel degree; must divide ``num_attention_heads``.
        float_dtype: dtype of activations and, for int8/int4, of the unquantized parts. None: the
            model's parameter dtype, else the config's ``dtype``, else ``bfloat16``. Ignored (set to
            ``weight_dtype``) when ``weight_dtype`` is a float type.
        prefill_chunk: prompt tokens per forward during prefill (None: the whole ``seq_len`` at once,
            as plain ``generate`` does).
        usable_fraction: share of each GPU's memory the estimate may use (0 < f <= 1).
        gpus: ``{name: capacity in bytes}`` to check instead of :data:`GPUS`.

    Returns:
        :class:`MemoryEstimate`.

    Raises:
        MemoryInputError: (a ``ValueError``) an invalid argument or config field; the message names
            the field, the value and what is allowed.

    Example:
        >>> est = estimate_memory("llama-2-7b", weight_dtype="float16")
        >>> round(est.weights_bytes / 1e9, 1)
        13.5
        >>> est.fits["RTX 4090 24GB"].fits
        True
    """
    weight_dtype = _check_dtype("weight_dtype", weight_dtype, tuple(DTYPE_BITS))
    kv_dtype = _check_dtype("kv_dtype", kv_dtype, tuple(DTYPE_BITS))
    float_dtype = _check_dtype("float_dtype", float_dtype, _FLOAT)
    batch = _check_int("batch", batch)
    seq_len = _check_int("seq_len", seq_len)
    tp = _check_int("tp", tp)
    if prefill_chunk is not None:
        prefill_chunk = _check_int("prefill_chunk", prefill_chunk)
    if isinstance(usable_fraction, bool) or not isinstance(usable_fraction, (int, float)) or \
            not 0 < usable_fraction <= 1:
        raise bad_input("usable_fraction", usable_fraction, "a number in (0, 1]")
    gpus = dict(GPUS if gpus is None else gpus)
    for g, cap in gpus.items():
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
            raise bad_input(f"gpus[{g!r}]", cap, "a positive capacity in bytes")

    spec = arch_spec(config_or_model)
    if spec.num_heads % tp:
        raise bad_input("tp", tp, f"a divisor of num_attention_heads={spec.num_heads}")
    if weight_dtype in _FLOAT:
        float_dtype = weight_dtype  # a float model computes in its own dtype
    float_dtype = float_dtype or spec.param_dtype or spec.config_dtype or "bfloat16"
    weight_dtype = weight_dtype or float_dtype
    act_dtype = float_dtype
    kv_dtype = kv_dtype or act_dtype
    notes = list(spec.notes)
    if spec.max_positions is not None and seq_len > spec.max_positions:
        notes.append(f"seq_len={seq_len} exceeds the model's max_position_embeddings={spec.max_positions}")

    n_params, parts = _weights(spec, weight_dtype, float_dtype)
    weights = sum(parts.values())
    chunk = min(seq_len, prefill_chunk or seq_len)
    kv_seq = _kv_per_seq(spec, seq_len, kv_dtype)
    act_seq = _activations_per_seq(spec, chunk, seq_len, act_dtype)

    # tp: weights split evenly; KV heads split, replicated when tp > kv_heads (each device keeps >= 1 head);
    # activations replicated (conservative: the MLP intermediate is actually split too)
    kv_heads_dev = math.ceil(spec.num_kv_heads / tp)
    kv_seq_dev = math.ceil(kv_seq * kv_heads_dev / spec.num_kv_heads)
    w_dev = math.ceil(weights / tp)
    per_seq_dev = kv_seq_dev + act_seq
    per_device = {"weights": w_dev, "kv_cache": batch * kv_seq_dev, "activations": batch * act_seq,
                  "total": w_dev + batch * per_seq_dev}
    if any(w is not None and w < seq_len for w in spec.layer_windows):
        notes.append(f"seq_len > the sliding window: activations include the [{chunk}, {seq_len}] attention mask "
                     "transformers' SDPA path builds (flash attention needs none; --prefill-chunk shrinks it)")
    if tp > spec.num_kv_heads:
        notes.append(f"tp={tp} > num_key_value_heads={spec.num_kv_heads}: KV heads are replicated across devices")
    if weight_dtype not in _FLOAT:
        notes.append(f"{weight_dtype}: attention/MLP matrices quantized; embeddings, norms, biases and lm_head "
                     f"kept at {float_dtype}")

    fits = {}
    for g, cap in gpus.items():
        usable = int(cap * usable_fraction)
        max_batch = max(0, (usable - w_dev) // per_seq_dev)
        fits[g] = GpuFit(gpu=g, capacity_bytes=int(cap), usable_bytes=usable, fits=per_device["total"] <= usable,
                         max_batch=int(max_batch))
    return MemoryEstimate(
        name=spec.name,
        model_type=spec.model_type,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        float_dtype=float_dtype,
        batch=batch,
        seq_len=seq_len,
        tp=tp,
        prefill_chunk=chunk,
        usable_fraction=float(usable_fraction),
        num_params=n_params,
        active_params=n_params - spec.inactive_expert_params(),
        weights_bytes=weights,
        weights_breakdown=parts,
        kv_cache_bytes=batch * kv_seq,
        activations_bytes=batch * act_seq,
        total_bytes=weights + batch * (kv_seq + act_seq),
        per_device=per_device,
        fits=fits,
        spec=spec,
        notes=tuple(notes),
    )
