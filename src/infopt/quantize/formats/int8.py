"""Int8 weight-only quantization: per-output-channel symmetric round-to-nearest; int8 matmul kernels on CPU (torch's)
and CUDA (Triton, :mod:`infopt.ops.triton_int8`). :func:`kernel_calls` counts which kernel each forward ran."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...core.errors import IncompatibleModelError, RecipeError
from ...core.step import StepConfig, bad_field, register_step
from ..api import check_group_size, check_keep, quantize_targets, register_quantizer, register_shared_embedding
from ..bound import HoldsBound
from ..experts import QuantizedExperts, check_experts_shapes, register_experts_quantizer
from . import a8
from .int8_layouts import BY_ACTIVATIONS, LAYOUTS, _int8pack_available, act_group, filled_next
from .primitives import KeepsFormat, choose_qparams, dequantize, group_block, quantize

__all__ = ["Int8WeightOnly", "Int8Linear", "SharedInt8Embedding", "quantize_int8_per_channel", "saving_compact",
           "KERNELS", "kernel_calls"]

KERNELS = ("int8_f32_linear", "dequantized_chunks", "int8_a8_linear", "dequantized", "w8_gemv", "int8_weight_mm",
           "weight_int8pack_mm", "reference")
"""Keys of :func:`kernel_calls`: infopt's C++ int8 x fp32 operator; without it, the weight dequantized a chunk of rows
at a time (fp32 on CPU); int8 activations (:func:`infopt.quantize.formats.a8.int8_a8_linear`, whose count says whether its C++
kernel ran); the weight dequantized per call (group scales off the fp32 CPU path); the Triton ops (CUDA, or Triton's
interpreter); ``torch._weight_int8pack_mm`` (CPU, bf16/fp16); ``reference``: the int8 weight cast, times the scales."""

_CALLS = dict.fromkeys(KERNELS, 0)  # eager forwards per kernel since import (a diagnostic: unlocked, += under the GIL)


def kernel_calls() -> dict[str, int]:
    """Eager :class:`Int8Linear` forwards since import per kernel that served them (:data:`KERNELS`); a forward traced
    into a compiled graph is not counted (the graph calls the kernel itself). Take the difference of two snapshots.

    Example:
        >>> layer = Int8Linear.from_float(nn.Linear(64, 32), compute_dtype="bfloat16")
        >>> before = kernel_calls()["weight_int8pack_mm"]
        >>> _ = layer(torch.randn(1, 64))
        >>> kernel_calls()["weight_int8pack_mm"] - before  # bf16 activations on torch's fused CPU kernel
        1
    """
    return dict(_CALLS)

_COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": None}


CUDA_KERNELS = ("tl_dot", "gemv")
"""Values of :attr:`Int8WeightOnly.cuda_kernel`."""


@register_step
@dataclass(frozen=True)
class Int8WeightOnly(StepConfig, HoldsBound):
    """Weights stored as int8 with one fp32 scale per output channel; activations stay floating point.

    Args:
        group_size: None (default) for one scale per output channel, which the fused CPU kernel
            takes; or a number of input channels per scale (finer, more accurate). With fp32 activations on
            CPU (``compute_dtype`` ``"float32"``, or ``"auto"`` in an fp32 model) every call runs on infopt's
            int8 x fp32 kernel with the group scales; other dtypes and devices dequantize the weight per call.
            Must divide every quantized layer's ``in_features``.
        compute_dtype: dtype of the matmul. ``"auto"``: for an fp32 model on a CPU where infopt's C++ kernels
            build with AVX-512, ``"float32"`` (measured faster there than bf16 activations, and exact); on other
            CPUs bfloat16 activations with the fused int8 kernel (``torch._weight_int8pack_mm``), which is
            faster than an fp32 matmul on the same weights; the model's dtype elsewhere. ``"float32"`` keeps fp32
            activations and sums: on CPU every call runs on infopt's int8 x fp32 kernel
            (:func:`infopt.quantize.formats.a8.int8_f32_linear`; without the C++ kernels, the weight is dequantized a
            chunk of rows at a time). On CUDA every per-channel layer
            runs infopt's Triton kernel (:func:`~infopt.ops.triton_int8.int8_weight_mm`: int8 weight
            tiles converted in registers, fp32 accumulation) in the compute dtype; without Triton,
            dequantize-then-matmul, with a warning.
        include_lm_head: also quantize the output head. When it is tied to the input embedding, the
            head gets its own int8 copy and the embedding keeps its weight: more memory in all, but the
            head is read whole every token while the embedding gives one row per token.
        activations: ``"float"`` (default) or ``"int8"``: each call quantizes its activations to int8
            per row and group of 16 channels and multiplies them with the int8 codes in integers
            (:mod:`infopt.quantize.formats.a8`; AVX512-VNNI or AVX2 on CPUs that have them). Lossy beyond the weights;
            ``out_features`` a multiple of 16, and ``group_size`` None or a multiple of 16 (of the activation group:
            8 or 4 where ``in_features`` is not a multiple of 16).
            ``"auto"``: ``"int8"`` where the C++ kernel runs with AVX512-VNNI or AVX2 and the layer fits it, else
            ``"float"`` (:func:`infopt.quantize.formats.a8.resolve`).
        share_embedding: with ``include_lm_head`` and a head tied to the input embedding, the embedding
            looks its rows up in the head's int8 codes (:class:`SharedInt8Embedding`) instead of keeping its
            float weight: one int8 copy serves both (the default model's 113 MiB fp32 embedding goes). Lossy
            for the embedding (per-row int8, as the head), measured in docs/performance.md. An untied or
            unusual embedding (``max_norm``, a non-scalar scale) keeps its weight, with a note in the report.
        experts: on a mixture-of-experts model, also quantize the experts (default True): each expert's
            ``gate_up`` and ``down`` become :class:`Int8Linear` layers with their own per-channel scales
            (:class:`infopt.quantize.experts.QuantizedExperts`). Routers and shared-expert gates stay in float.
        cuda_kernel: for per-channel layers on CUDA: ``"tl_dot"`` (default), the Triton kernel above at every row
            count; ``"gemv"``: up to eight rows (decode) through infopt's Triton matrix-vector kernel
            (:func:`infopt.ops.triton_gemv.w8_gemv`), which does not pad one row to a 16-row tile, and
            ``tl_dot`` above. On an H200 at one row on an 8B Llama's q/k/v and o layers the GEMV kernel read at
            30-44% of the copy bandwidth against 42-48% for ``tl_dot`` (the fifth GPU lane run), so it is not the
            default.
        max_kl / keep: a bound on the step's KL divergence and the layers kept in higher precision to hold it, as
            in :class:`~infopt.quantize.formats.int4.Int4WeightOnly` (levels here: ``float-activations``, ``float``).

    Raises:
        RecipeError: unknown compute_dtype, a group_size that is not a positive integer, a non-boolean include_lm_head,
            a malformed ``keep`` entry or bound.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = quantize_(tiny_model(), Int8WeightOnly())
        >>> type(m.model.layers[0].mlp.up_proj).__name__
        'Int8Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "int8"
    discriminator: ClassVar[str] = "method"
    group_size: int | None = None
    compute_dtype: str = "auto"
    include_lm_head: bool = False
    activations: str = "float"
    share_embedding: bool = False
    experts: bool = True
    cuda_kernel: str = "tl_dot"
    max_kl: float | None = None
    keep: tuple[str, ...] = ()

    def __post_init__(self):
        check_keep(self)
        if self.cuda_kernel not in CUDA_KERNELS:
            raise bad_field(self, "cuda_kernel", self.cuda_kernel, ", ".join(CUDA_KERNELS))
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0
        ):
            raise bad_field(self, "group_size", self.group_size, "null (per output channel) or a positive integer")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise bad_field(self, "compute_dtype", self.compute_dtype, ", ".join(_COMPUTE_DTYPES))
        for name in ("include_lm_head", "share_embedding", "experts"):
            if not isinstance(getattr(self, name), bool):
                raise bad_field(self, name, getattr(self, name), "true or false")
        if self.share_embedding and not self.include_lm_head:
            raise RecipeError("Int8WeightOnly(share_embedding=True) shares the int8 output head's codes with the "
                              "input embedding, so it needs include_lm_head=True")
        if self.activations not in a8.ACTIVATIONS:
            raise bad_field(self, "activations", self.activations, ", ".join(a8.ACTIVATIONS))

    def check(self, model, info, steps):
        check_experts_shapes(model, self, self.group_size, out_multiple=16 if self.activations == "int8" else 1)
        if self.group_size is not None:
            check_group_size(model, self, self.group_size, alternative="group_size=None for one scale per channel")
        if self.activations == "int8":
            for t in quantize_targets(model, self):
                out_f, in_f = t.weight.shape
                reason = LAYOUTS["a8"].fits(out_f, in_f, self.group_size)
                if reason is not None:
                    raise IncompatibleModelError(
                        f"Int8WeightOnly: {t.fqn}: {reason}. Exclude it with exclude=[...] or use activations: float"
                    )
        return []

    def kept_as(self, level: str) -> StepConfig:
        """The config of one layer kept at ``level`` (``float-activations``, or ``int8``: itself; see ``keep``).

        Example:
            >>> Int8WeightOnly(activations="int8").kept_as("float-activations").activations
            'float'
        """
        if level == "float-activations":
            return dataclasses.replace(self, activations="float", keep=(), max_kl=None)
        if level == "int8":
            return dataclasses.replace(self, keep=(), max_kl=None)
        raise ValueError(f"Int8WeightOnly.kept_as: unknown level {level!r}")


def quantize_int8_per_channel(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization per output row, or per group of ``group_size`` input channels.

    Args:
        w: ``[out, in]`` floating-point weight.
        group_size: None for one scale per row.

    Returns:
        ``(q, scale)``: ``q`` int8 ``[out, in]`` in -127..127; ``scale`` fp32 ``[out]`` (``w ~= q * scale[:, None]``),
        or ``[out, in // group_size]`` with a group size; ``absmax / 127``, an all-zero row's absmax taken as 1e-12.

    Example:
        >>> q, s = quantize_int8_per_channel(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
        >>> q.tolist(), s.shape
        ([[64, -127], [127, 64]], torch.Size([2]))
    """
    w32 = w.detach().float()
    block = group_block(w32.shape, group_size)  # (1, group_size or in)
    scale, _ = choose_qparams(w32, block, qmin=-127, qmax=127, symmetric=True, min_range=1e-12)  # [out, G]
    q = quantize(w32, block, scale, qmin=-127, qmax=127, dtype=torch.int8)
    return q, (scale[:, 0] if group_size is None else scale)


def _auto_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """``compute_dtype="auto"`` for a per-channel layer: fp32 for an fp32 model on a CPU whose C++ kernels are built
    with AVX-512 (infopt's int8 x fp32 kernel: exact activations, and measured faster than bf16 activations on
    ``torch._weight_int8pack_mm`` there, in decode and at prompts' TTFT); else bf16 on that fused kernel where torch
    has it, else None (the model's dtype)."""
    if dtype == torch.float32 and torch.device(device).type == "cpu" and a8.isa() == "avx512_vnni":
        return torch.float32
    return torch.bfloat16 if _int8pack_available(device) else None


class Int8Linear(KeepsFormat):
    """A linear layer with int8 weights ``[out, in]`` and per-channel scales.

    Saved (``state_dict``): ``weight_int8`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]`` (or
    ``[out, in // group_size]`` with groups); ``bias`` stays a floating-point parameter. ``activations`` picks the
    layout of the codes in memory, ``layout`` (a small class of :mod:`infopt.quantize.formats.int8_layouts`):
    ``"plain"`` (``"float"``) keeps ``weight_int8`` itself; ``"a8"`` (``"int8"``) the block layout of
    :mod:`infopt.quantize.formats.a8` (buffer ``weight_a8``), converted to ``weight_int8`` when saved
    and from it when loaded.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 compute_dtype: torch.dtype | None, device=None, group_size: int | None = None,
                 activations: str = "float"):
        super().__init__()
        if group_size is not None and in_features % group_size:
            raise ValueError(f"Int8Linear: group_size {group_size} does not divide in_features {in_features}")
        if activations not in BY_ACTIVATIONS:
            raise ValueError(f"Int8Linear: activations must be 'float' or 'int8', got {activations!r}")
        layout = LAYOUTS[BY_ACTIVATIONS[activations]]
        reason = layout.fits(out_features, in_features, group_size)
        if reason is not None:
            raise ValueError(f"Int8Linear: {reason}")
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = dtype
        self.group_size = group_size
        self.layout = layout.name
        self.act_group = act_group(in_features)  # of the int8 activations (the a8 layout's)
        # a layout that does not save its buffers saves and loads weight_int8 (see _save_to_state_dict)
        for name, t in layout.empty(out_features, in_features, device).items():
            self.register_buffer(name, t, persistent=layout.saves_buffers)
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        layout.scales_set(self)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.compute_dtype = compute_dtype
        self.cuda_kernel = "tl_dot"  # or "gemv": see Int8WeightOnly.cuda_kernel
        self._scale_cache: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_float(cls, module: nn.Module, *, compute_dtype: str = "auto", conv1d: bool = False,
                   group_size: int | None = None, activations: str = "float") -> Int8Linear:
        """Build from an ``nn.Linear`` (or a transformers ``Conv1D`` with ``conv1d=True``)."""
        w = module.weight.detach()
        if conv1d:  # Conv1D stores [in, out]
            w = w.t()
        q, s = quantize_int8_per_channel(w, group_size)
        return cls.from_codes(q, s, bias=getattr(module, "bias", None), dtype=w.dtype, compute_dtype=compute_dtype,
                              activations=activations)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, *, bias: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32, compute_dtype: str = "auto",
                   activations: str = "float") -> Int8Linear:
        """Build from int8 codes computed elsewhere (GPTQ, SmoothQuant).

        Args:
            codes: int8 ``[out, in]`` (-128..127).
            scales: ``[out]`` per channel, or ``[out, G]`` per group of ``in // G`` input channels.
            bias: ``[out]`` or None.
            dtype: the model's floating-point dtype.
            compute_dtype: as in :class:`Int8WeightOnly`.
            activations: as in :class:`Int8WeightOnly`.
        """
        out_f, in_f = codes.shape
        group = None if scales.dim() == 1 else in_f // scales.shape[1]
        cd = _COMPUTE_DTYPES[compute_dtype]
        if cd is None and group is None:
            cd = _auto_compute_dtype(dtype, codes.device)
        with filled_next():  # the codes fill the weight buffers below
            new = cls(in_f, out_f, bias=bias is not None, dtype=dtype, compute_dtype=cd, device=codes.device,
                      group_size=group, activations=activations)
        new._set_codes(codes.to(torch.int8))
        new.weight_scale.copy_(scales.float())
        LAYOUTS[new.layout].scales_set(new)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    @classmethod
    def from_a8(cls, weight: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                k6: tuple[torch.Tensor, torch.Tensor] | None = None) -> Int8Linear:
        """Build an ``activations="int8"`` layer from its block-layout weight computed elsewhere (a GGUF file's Q8_0
        blocks transcoded at load: :func:`infopt.quantize.community.gguf_blocks.a8_int8`): ``weight`` uint8
        ``[out/16, in/4, 64]`` (codes plus 128), ``scales`` fp32 ``[out]`` or ``[out, G]`` (per group of ``in // G``
        inputs); no bias. ``k6``: the two levels ``(d, sc)`` of Q6_K scales ``scales`` is the product of (the kernel
        reads them in that form, which the layer would otherwise find by factoring ``scales``)."""
        out_f, in_f = weight.shape[0] * a8.ROWS, weight.shape[1] * 4
        group = None if scales.dim() != 2 or not scales.shape[1] or in_f % scales.shape[1] else in_f // scales.shape[1]
        new = cls(in_f, out_f, bias=False, dtype=dtype, compute_dtype=_auto_compute_dtype(dtype, weight.device),
                  device="meta", activations="int8", group_size=group)
        want = {**LAYOUTS["a8"].empty(out_f, in_f, "meta"), "weight_scale": new.weight_scale}
        for name, t in (("weight_a8", weight), ("weight_scale", scales)):
            if t.shape != want[name].shape or t.dtype != want[name].dtype:
                raise ValueError(f"Int8Linear.from_a8: {name} must be {want[name].dtype} {tuple(want[name].shape)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
            setattr(new, name, t)
        if k6 is not None and group == 16:
            new.register_buffer("wscale", a8.pack_k6_scales(*k6), persistent=False)
        else:
            LAYOUTS["a8"].scales_set(new)
        return new

    @property
    def activations(self) -> str:
        """``"float"`` or ``"int8"``: the activations the layer computes with (what its layout stands for)."""
        return LAYOUTS[self.layout].activations

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[out, in]`` (converted from the block layout with ``activations="int8"``)."""
        return LAYOUTS[self.layout].codes(self)

    def _set_codes(self, codes: torch.Tensor) -> None:
        LAYOUTS[self.layout].set_codes(self, codes)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (any shape) of the dequantized weight: ``[*index.shape, in]`` in ``dtype``, computed in
        fp32 as ``codes * scale`` (the lookups of a :class:`SharedInt8Embedding`). Reads only those rows."""
        codes = LAYOUTS[self.layout].rows(self, index)
        scale = self.weight_scale[index]
        if self.group_size is None:
            w = codes.float() * scale.unsqueeze(-1)
        else:
            w = (codes.float().unflatten(-1, (-1, self.group_size)) * scale.unsqueeze(-1)).flatten(-2)
        return w.to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The float weight ``[out, in]`` these int8 values stand for."""
        codes = self.codes()
        return dequantize(codes, group_block(codes.shape, self.group_size), self.weight_scale)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if LAYOUTS[self.layout].saves_buffers:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight_int8"] = self.codes()
        destination[prefix + "weight_scale"] = self.weight_scale
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        s = self._scale_cache.get(dtype)
        if s is None or s.device != self.weight_scale.device:
            s = self.weight_scale.to(dtype)
            self._scale_cache[dtype] = s
        return s

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._scale_cache.clear()
        if LAYOUTS[self.layout].saves_buffers:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        # the saved weight_int8 is converted into the layout's buffers, which are not saved
        key = prefix + "weight_int8"
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, False, [], [], error_msgs)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
        elif tuple(state_dict[key].shape) != (self.out_features, self.in_features):
            error_msgs.append(f"{key}: shape {tuple(state_dict[key].shape)} != {(self.out_features, self.in_features)}")
        else:
            with torch.no_grad():
                self._set_codes(state_dict[key].to(torch.int8))
        with torch.no_grad():
            LAYOUTS[self.layout].scales_set(self)
        if strict:
            names = {"weight_int8", "weight_scale"} | ({"bias"} if self.bias is not None else set())
            for k in state_dict:
                if k.startswith(prefix) and "." not in k[len(prefix):] and k[len(prefix):] not in names:
                    unexpected_keys.append(k)
            for n in names - {"weight_int8"}:
                if prefix + n not in state_dict:
                    missing_keys.append(prefix + n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        kernel, y = LAYOUTS[self.layout].matmul(self, x)
        if not torch.compiler.is_compiling():  # a count read while tracing would make dynamo guard on it
            _CALLS[kernel] += 1
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        g = "" if self.group_size is None else f", group_size={self.group_size}"
        act = ", activations=int8" if self.activations == "int8" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}{g}{act}")


@register_shared_embedding
class SharedInt8Embedding(KeepsFormat):
    """An input embedding that reads its rows from the int8 output head it is tied to, so one int8 copy serves both
    (``share_embedding``): a lookup is ``codes[id] * scale[id]`` in fp32, cast to the model's dtype, times the
    embedding's own ``embed_scale`` where it has one (Gemma's scaled embeddings).

    The head stays the owner of the codes (this module holds no tensor of its own and is not the head's parent).
    Its ``state_dict`` holds the float weight those codes stand for as ``weight``, so a state dict keeps the layout of
    an untied embedding; loaded, it ignores that tensor (the head's codes are the source). A saved folder
    (:func:`saving_compact`, which infopt's writers use) leaves it out: it would be the largest tensor of the folder
    (113 MB of fp32 for the default model's 97 MiB in memory), and every loader that can rebuild the head can rebuild
    it.
    """

    saves_float_weight = True  # serialization: no quantized spec (its head's says shares_embedding)

    def __init__(self, head: Int8Linear, embedding: nn.Embedding):
        super().__init__()
        self._head = (head,)  # a tuple: not registered as a submodule (the head's parent owns it)
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.out_dtype = embedding.weight.dtype
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = float(scale) if scale is not None else None

    @classmethod
    def for_head(cls, head: nn.Module, embedding: nn.Module) -> SharedInt8Embedding | None:
        """The embedding that stands in for ``embedding`` over ``head``'s codes, or None when ``head`` is no
        :class:`Int8Linear` or :func:`shareable_embedding` says no (the caller checks the tie)."""
        if isinstance(head, Int8Linear) and shareable_embedding(embedding):
            return cls(head, embedding)
        return None

    @property
    def head(self) -> Int8Linear:
        return self._head[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.head.rows(input_ids, self.out_dtype)
        if self.embed_scale is not None:
            out = out * torch.tensor(self.embed_scale, dtype=self.out_dtype)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if _COMPACT.get():
            return  # rebuilt from the head's codes when the folder loads
        ids = torch.arange(self.num_embeddings, device=self.head.weight_scale.device)
        destination[prefix + "weight"] = self.head.rows(ids, self.out_dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict and tuple(state_dict[key].shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"{key}: shape {tuple(state_dict[key].shape)} != "
                              f"{(self.num_embeddings, self.embedding_dim)}")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from the int8 output head"


_COMPACT: contextvars.ContextVar[bool] = contextvars.ContextVar("infopt_saving_compact", default=False)


@contextlib.contextmanager
def saving_compact():
    """Inside, ``state_dict()`` leaves out tensors a loader rebuilds from others (a :class:`SharedInt8Embedding`'s
    float weight): what infopt's writers use for a saved folder."""
    token = _COMPACT.set(True)
    try:
        yield
    finally:
        _COMPACT.reset(token)


def shareable_embedding(embedding: nn.Module) -> bool:
    """Whether :class:`SharedInt8Embedding` reproduces ``embedding``'s lookups: a plain ``nn.Embedding`` without
    ``max_norm``, or a scaled one (Gemma) whose ``embed_scale`` is a scalar."""
    if not isinstance(embedding, nn.Embedding) or embedding.max_norm is not None:
        return False
    if type(embedding) is nn.Embedding:
        return True
    scale = getattr(embedding, "embed_scale", None)
    return type(embedding).__name__.endswith("ScaledWordEmbedding") and scale is not None and \
        (not torch.is_tensor(scale) or scale.numel() == 1)


@register_quantizer(Int8WeightOnly)
def _make(module: nn.Module, config: Int8WeightOnly, conv1d: bool) -> Int8Linear:
    activations = a8.resolve(config.activations, module.weight.device)
    if config.activations == "auto":  # per layer: int8 only where the layer fits the kernel
        out_f, in_f = (module.weight.shape[::-1] if conv1d else module.weight.shape)
        if LAYOUTS["a8"].fits(out_f, in_f, config.group_size) is not None:
            activations = "float"
    layer = Int8Linear.from_float(module, compute_dtype=config.compute_dtype, conv1d=conv1d,
                                  group_size=config.group_size, activations=activations)
    layer.cuda_kernel = config.cuda_kernel
    return layer


@register_experts_quantizer(Int8WeightOnly)
def _make_experts(experts: nn.Module, config: Int8WeightOnly) -> QuantizedExperts:
    return QuantizedExperts.from_experts(experts, lambda w: _make(w, config, False))
