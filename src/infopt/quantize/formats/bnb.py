"""bitsandbytes quantization (recipe ``quantize: {method: bnb_int8 | bnb_nf4}``): LLM.int8() and NF4 linears.

bitsandbytes is optional (``pip install 'infopt[bnb]'``) and imported only inside the functions
that build layers, so ``import infopt`` never loads it.

Notes measured with bitsandbytes 0.50.2 on CPU (torch 2.13):

- ``Linear8bitLt`` casts activations to float16 before quantizing them (values beyond 65504
  overflow) and, with AVX-512, multiplies with ``torch._int_mm``; ``threshold > 0`` keeps
  activation columns above it in float16 (LLM.int8() outlier decomposition).
- ``Linear4bit`` on a CPU with AVX512-BF16 repacks its weight on the first eval-mode call and then
  computes in bfloat16 whatever ``compute_dtype`` says (bitsandbytes' fused CPU kernel), undoing the
  double quantization of the scales in the process. That kernel needs ``out_features % 32 == 0`` and
  ``in_features % blocksize == 0``; layers that miss either are kept on a generic dequantize-then-matmul
  path instead (listed in the report). That path is infopt's (:func:`nf4_dequantize`), not bitsandbytes':
  bitsandbytes 0.50.2's CPU ``dequantize_4bit`` and ``matmul_4bit`` read a weight whose blocks straddle rows
  wrongly on an AVX-512 CPU (a Gaussian weight came back at 8-15 dB SQNR instead of NF4's ~20 dB, though its
  quantized codes and scales are right).
- Both modules cast their bias to the compute dtype on the first call; it is cast when the layer is
  built so the saved state does not depend on whether a forward ran.
- Saved and reloaded through :func:`infopt.save_optimized` with identical outputs: int8 through
  bitsandbytes' own ``SCB`` state-dict hooks, NF4 through :func:`nf4_linear_class`, which also keeps
  bitsandbytes' lossy CPU ``state_dict()`` from changing a live layer.
"""

from __future__ import annotations

import copy
import functools
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...core.availability import lazy_import
from ...core.errors import MissingBackendError
from ...core.step import StepConfig, bad_field, register_step
from ..api import quantize_targets, register_quantizer

__all__ = ["BnbInt8", "BnbNF4", "NF4_BLOCKSIZES", "nf4_linear_class", "make_bnb_int8", "make_bnb_nf4"]

NF4_BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes bitsandbytes accepts for 4-bit quantization."""

_NF4_COMPUTE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@register_step
@dataclass(frozen=True)
class BnbInt8(StepConfig):
    """bitsandbytes LLM.int8(): int8 weights and activations, outlier activation columns in float16.

    Args:
        threshold: activation magnitude above which a column is computed in float16 instead of
            int8 (LLM.int8()'s mixed-precision decomposition); 0 quantizes every column.

    Raises:
        RecipeError: negative or non-numeric threshold.
        MissingBackendError: bitsandbytes is not installed (``pip install 'infopt[bnb]'``).

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = quantize_(tiny_model(), BnbInt8())  # doctest: +SKIP
        >>> type(m.model.layers[0].mlp.up_proj).__name__  # doctest: +SKIP
        'Linear8bitLt'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "bnb_int8"
    discriminator: ClassVar[str] = "method"
    threshold: float = 6.0

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not float(t) >= 0.0:
            raise bad_field(self, "threshold", t, "a number >= 0 (6.0 is LLM.int8()'s default, 0 disables outliers)")

    def required_backends(self) -> tuple[str, ...]:
        return ("bitsandbytes",)


@register_step
@dataclass(frozen=True)
class BnbNF4(StepConfig):
    """bitsandbytes 4-bit NormalFloat weights (QLoRA's NF4), one absmax scale per block of weights.

    Args:
        compute_dtype: dtype of the matmul: ``bfloat16``, ``float16`` or ``float32`` (on a CPU with
            AVX512-BF16 bitsandbytes' kernel computes in bfloat16 regardless).
        double_quant: quantize the block scales too (saves ~0.4 bits per weight).
        blocksize: weights per scale, one of :data:`NF4_BLOCKSIZES`.

    Raises:
        RecipeError: unknown compute_dtype or blocksize, non-boolean double_quant.
        MissingBackendError: bitsandbytes is not installed (``pip install 'infopt[bnb]'``).

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = quantize_(tiny_model(), BnbNF4())  # doctest: +SKIP
        >>> type(m.model.layers[0].mlp.up_proj).__name__  # doctest: +SKIP
        'NF4Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "bnb_nf4"
    discriminator: ClassVar[str] = "method"
    compute_dtype: str = "bfloat16"
    double_quant: bool = True
    blocksize: int = 64

    def __post_init__(self):
        if self.compute_dtype not in _NF4_COMPUTE:
            raise bad_field(self, "compute_dtype", self.compute_dtype, ", ".join(_NF4_COMPUTE))
        if not isinstance(self.double_quant, bool):
            raise bad_field(self, "double_quant", self.double_quant, "true or false")
        if isinstance(self.blocksize, bool) or self.blocksize not in NF4_BLOCKSIZES:
            raise bad_field(self, "blocksize", self.blocksize, ", ".join(map(str, NF4_BLOCKSIZES)))

    def required_backends(self) -> tuple[str, ...]:
        return ("bitsandbytes",)

    def check(self, model: nn.Module, info, steps) -> list[str]:
        """Report the layers bitsandbytes' fused CPU kernel cannot take (they run its generic path)."""
        if info.device.type != "cpu":
            return []
        odd = [t.fqn for t in quantize_targets(model, self)
               if t.weight.shape[0] % 32 or t.weight.shape[1] % self.blocksize]
        if not odd:
            return []
        return [f"{len(odd)} layer(s) ({odd[0]}, ...) run infopt's generic NF4 dequantize-then-matmul path: "
                f"bitsandbytes' fused CPU kernel needs out_features % 32 == 0 and in_features % blocksize "
                f"({self.blocksize}) == 0"]


def _weight_and_bias(module: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = module.weight.detach()
    return (w.t() if conv1d else w), (module.bias.detach() if module.bias is not None else None)


@register_quantizer(BnbInt8)
def make_bnb_int8(module: nn.Module, config: BnbInt8, conv1d: bool = False) -> nn.Module:
    """Build a ``bitsandbytes.nn.Linear8bitLt`` from a float linear (or a transformers ``Conv1D``).

    Raises:
        MissingBackendError: bitsandbytes is not installed.
    """
    bnb = lazy_import("bitsandbytes", feature="quantize method bnb_int8")
    w, b = _weight_and_bias(module, conv1d)  # w: [out, in]
    device = w.device
    out_f, in_f = w.shape
    new = bnb.nn.Linear8bitLt(in_f, out_f, bias=b is not None, has_fp16_weights=False,
                              threshold=float(config.threshold), device="meta")
    # Int8Params quantizes (row-wise absmax, via float16) when moved off the CPU-held float copy
    new.weight = bnb.nn.Int8Params(w.to("cpu", copy=True).contiguous(), requires_grad=False,
                                   has_fp16_weights=False).to(device)
    if b is not None:
        new.bias = nn.Parameter(b.clone(), requires_grad=False)
    # bitsandbytes picks its kernel by mode: training mode on CPU runs a dequantized float matmul
    return new.train(module.training)


def nf4_dequantize(data: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' NF4 weight (``Params4bit`` data, packed uint8, two codes per byte with the first in the high
    nibble, one absmax per ``state.blocksize`` codes in row-major order, possibly double-quantized) as a dense
    ``[out, in]`` tensor in the state's dtype, with torch operations: ``code[q] * absmax`` per block, for blocks
    that straddle rows too."""
    import bitsandbytes.functional as bnb_functional

    n = state.shape[0] * state.shape[1]
    b = data.reshape(-1).view(torch.uint8)
    codes = torch.stack([b >> 4, b & 15], -1).reshape(-1)[:n].long()
    absmax = state.absmax
    if state.nested:
        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    w = state.code.to(data.device)[codes].view(-1, state.blocksize) * absmax.float().view(-1, 1)
    return w.view(state.shape).to(state.dtype)


@functools.cache
def nf4_linear_class() -> type[nn.Module]:
    """``NF4Linear``: bitsandbytes' ``Linear4bit`` whose state dict is taken without changing the layer.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks an NF4 weight for its fused kernel on the
    first eval-mode call, with the block scales dequantized to bfloat16. Its own ``state_dict()``
    then unpacks the live layer and double-quantizes the scales again: lossy, so the layer's outputs
    change by merely saving it (measured: 2e-3 on the logits of a tiny model). ``NF4Linear`` saves
    the unpacked weight and the scales the kernel actually uses (fp32, not double-quantized), leaves
    the layer as it is, and loads either format back, so a reloaded model gives identical outputs.

    Raises:
        MissingBackendError: bitsandbytes is not installed; when saving, a CPU-repacked weight with a bitsandbytes
            that cannot unpack it (before 0.49).
    """
    bnb = lazy_import("bitsandbytes", feature="quantize method bnb_nf4")
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.functional import QuantState

    # bitsandbytes >= 0.49 repacks NF4 weights for its fused CPU kernel and has this inverse; a version without it
    # has no repacked weights to unpack either, so only the packed branch below needs it
    unpack_for_cpu = getattr(bnb_functional, "_convert_weight_packed_for_cpu_inverse", None)

    class NF4Linear(bnb.nn.Linear4bit):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if getattr(self, "infopt_fallback", None) is None or x.device.type != "cpu":
                return super().forward(x)
            # the generic path (module docstring): the weight dequantized here, then one matmul in the compute dtype
            state = self.weight.quant_state
            cd = self.compute_dtype or x.dtype
            bias = None if self.bias is None else self.bias.to(cd)
            return nn.functional.linear(x.to(cd), nf4_dequantize(self.weight.data, state).to(cd), bias).to(x.dtype)

        def _save_to_state_dict(self, destination, prefix, keep_vars):
            qs = getattr(self.weight, "quant_state", None)
            if qs is None or not getattr(qs, "packing_format_for_cpu", False):
                return super()._save_to_state_dict(destination, prefix, keep_vars)
            if unpack_for_cpu is None:
                raise MissingBackendError(
                    f"bitsandbytes {getattr(bnb, '__version__', '?')} repacked the NF4 weight {prefix}weight for its "
                    "CPU kernel but has no _convert_weight_packed_for_cpu_inverse to unpack it for saving; "
                    "pip install 'bitsandbytes>=0.49'", package="bitsandbytes", extra="bnb")
            view = copy.copy(qs)  # the inverse rewrites the state it is given: give it a copy
            view.original_nested = False  # keep the kernel's scales instead of re-quantizing them
            w, view = unpack_for_cpu(self.weight.data, view)
            n, k = qs.shape
            # packed absmax: bf16 [k / blocksize, n]; saved layout: [n * k / blocksize], one per block in row order
            absmax = view.absmax.T.reshape(-1).float()
            saved = QuantState(absmax=absmax, shape=qs.shape, code=qs.code, blocksize=qs.blocksize,
                               quant_type=qs.quant_type, dtype=qs.original_dtype)
            destination[prefix + "weight"] = w
            if self.bias is not None:
                destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
            for key, v in saved.as_dict(packed=True).items():
                destination[prefix + "weight." + key] = v

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            head = prefix + "weight."
            stats = {k[len(head):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(head)]}
            data = state_dict.get(prefix + "weight")
            if stats and data is not None:
                device = self.weight.device
                self.weight = bnb.nn.Params4bit.from_prequantized(data.to(device), stats, requires_grad=False,
                                                                  device=device, module=self)
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    NF4Linear.__module__ = __name__
    return NF4Linear


@register_quantizer(BnbNF4)
def make_bnb_nf4(module: nn.Module, config: BnbNF4, conv1d: bool = False) -> nn.Module:
    """Build an NF4 ``bitsandbytes.nn.Linear4bit`` (see :func:`nf4_linear_class`) from a float linear (or a transformers ``Conv1D``).

    Raises:
        MissingBackendError: bitsandbytes is not installed.
    """
    bnb = lazy_import("bitsandbytes", feature="quantize method bnb_nf4")
    w, b = _weight_and_bias(module, conv1d)  # w: [out, in]
    device = w.device
    out_f, in_f = w.shape
    cd = _NF4_COMPUTE[config.compute_dtype]
    new = nf4_linear_class()(in_f, out_f, bias=b is not None, compute_dtype=cd,
                             compress_statistics=config.double_quant, quant_type="nf4", quant_storage=torch.uint8,
                             device="meta")
    # Params4bit quantizes on .to(device): packed uint8 [out * in / 2, 1] + absmax per block
    new.weight = bnb.nn.Params4bit(w.detach().clone().contiguous(), requires_grad=False, blocksize=config.blocksize,
                                   compress_statistics=config.double_quant, quant_type="nf4",
                                   quant_storage=torch.uint8, module=new).to(device)
    if b is not None:
        new.bias = nn.Parameter(b.to(cd), requires_grad=False)
    if device.type == "cpu" and (out_f % 32 or in_f % config.blocksize):
        # bitsandbytes' AVX512-BF16 kernel repacks [out, in] in blocks of 32 rows and whole scale blocks per row
        new.support_avx512bf16_for_cpu = False
        new.infopt_fallback = "generic NF4 path (fused CPU kernel needs out % 32 == 0, in % blocksize == 0)"
    return new.train(module.training)  # the fused CPU kernel runs in eval mode only
