"""Pick the attention kernel a model uses (eager, SDPA, FlashAttention-2, flex), in place and undoable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..core.availability import fast_bf16_gemm, require
from ..core.errors import IncompatibleModelError
from ..core.introspect import FAMILIES, ModelInfo, inspect_model
from ..core.patch import record_custom, set_attr
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from .gqa import GQA_SDPA_IMPL, PROMPT_DTYPE_ATTR, PROMPT_MIN_ROWS, register_gqa_sdpa
from .paged import PAGED_IMPL, register_paged_attention

__all__ = ["Attention", "BACKENDS", "PROMPT_DTYPES", "set_backend_"]

# recipe spelling -> transformers attn_implementation name
BACKENDS: dict[str, str] = {
    "eager": "eager",
    "sdpa": "sdpa",
    "sdpa_gqa": GQA_SDPA_IMPL,
    "flash_attention_2": "flash_attention_2",
    "flex": "flex_attention",
    "paged": PAGED_IMPL,
}

PROMPT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}
"""``Attention(prompt_dtype=...)`` spellings."""


@register_step
@dataclass(frozen=True)
class Attention(StepConfig):
    """Select the attention backend.

    Args:
        backend: ``eager`` (reference, returns attention weights), ``sdpa``
            (``torch.nn.functional.scaled_dot_product_attention``), ``sdpa_gqa`` (SDPA given grouped K/V heads
            unrepeated on CPU, see :mod:`infopt.attention.gqa`; the compile step switches SDPA models to it),
            ``flash_attention_2`` (CUDA,
            fp16/bf16, needs ``infopt[flash]``), ``flex`` (``torch.nn.attention.flex_attention``, CUDA) or
            ``paged`` (reads the block tables of ``kvcache.Paged``; SDPA for calls without a paged cache,
            see :mod:`infopt.attention.paged`).
        prompt_dtype: ``"bfloat16"``: with ``sdpa_gqa``, an fp32 model's prompts of 64 tokens or more
            (:data:`~infopt.attention.gqa.PROMPT_MIN_ROWS`) attend in bf16 on a CPU that multiplies bf16 natively
            (AVX512-BF16 or AMX): query, keys and values rounded to bf16, the softmax and sums in fp32, the output
            back in fp32; decode and verify steps keep the model's dtype. Lossy (the step's ``fidelity`` says so):
            measured on the default model, see docs/attention.md. Where the CPU has no native bf16 (there bf16 is
            slower than fp32), on other devices, or on a model that is not fp32, nothing changes and the report says
            why. None (default): the model's dtype throughout.

    Raises:
        RecipeError: unknown backend, a prompt dtype other than bfloat16, or one with a backend other than sdpa_gqa.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [Attention("eager")])
        >>> m.config._attn_implementation
        'eager'
    """

    stage: ClassVar[str] = "attention"
    discriminator: ClassVar[str] = "backend"
    fidelity: ClassVar[str] = "lossless"  # another attention kernel: the same math
    backend: str = "sdpa"
    prompt_dtype: str | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise bad_field(self, "backend", self.backend, ", ".join(BACKENDS))
        if self.prompt_dtype is not None:
            if self.prompt_dtype not in PROMPT_DTYPES:
                raise bad_field(self, "prompt_dtype", self.prompt_dtype,
                                f"{', '.join(PROMPT_DTYPES)}, or null for the model's own dtype")
            if self.backend != "sdpa_gqa":
                raise bad_field(self, "prompt_dtype", self.prompt_dtype,
                                "null with this backend: only backend 'sdpa_gqa' reads a prompt dtype "
                                f"(write {{'backend': 'sdpa_gqa', 'prompt_dtype': {self.prompt_dtype!r}}})")
            object.__setattr__(self, "fidelity", "lossy")  # the prompt's query, keys and values rounded to bf16

    def required_backends(self) -> tuple[str, ...]:
        return ("flash_attn",) if self.backend == "flash_attention_2" else ()

    def check(self, model: nn.Module, info: ModelInfo, steps) -> list[str]:
        can = getattr(model, "_can_set_attn_implementation", None)
        if callable(can) and not can():
            raise IncompatibleModelError(
                f"{type(model).__name__} does not route attention through transformers' attention interface, "
                "so its backend cannot be switched; leave out the attention step"
            )
        if self.backend == "flash_attention_2":
            if info.device.type != "cuda":
                raise IncompatibleModelError(
                    f"attention backend flash_attention_2 runs on CUDA only; the model is on {info.device}. "
                    "Use backend 'sdpa' on this device"
                )
            if info.dtype not in (torch.float16, torch.bfloat16):
                raise IncompatibleModelError(
                    f"attention backend flash_attention_2 needs fp16 or bf16 weights; the model is {info.dtype}. "
                    "Load it with dtype=torch.bfloat16, or use backend 'sdpa'"
                )
        if self.backend == "flex" and not getattr(model, "_supports_flex_attn", False):
            raise IncompatibleModelError(
                f"{type(model).__name__} does not support flex attention; use backend 'sdpa' or 'eager'"
            )
        if self.backend == "flex" and info.device.type == "cpu":
            # Inductor's C++ flex-attention kernel (flex attention always compiles) reads key rows past the cache's
            # end on some one-token decode shapes (torch 2.13: 8 and 24 keys with static shapes; now and then with
            # dynamic ones): the softmax takes in whatever memory follows the keys, so decoded tokens are garbage or
            # NaN depending on the allocator. benchmarks/studies/flex_cpu_probe.py shows it with poisoned memory.
            raise IncompatibleModelError(
                "attention backend flex on CPU: Inductor's C++ flex-attention kernel reads key rows past the end of "
                "the cache on some one-token decode shapes (torch 2.13), so generated tokens can be garbage. Use "
                "backend 'sdpa' (the default) or 'sdpa_gqa' on CPU; flex runs on CUDA"
            )
        return []


def set_backend_(model: nn.Module, config: Attention | str, *, step: str | None = None) -> nn.Module:
    """Switch ``model`` to another attention backend in place (undo with :func:`infopt.undo`).

    Args:
        model: a transformers causal LM.
        config: an :class:`Attention` config or a backend name.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError, MissingBackendError: see :meth:`Attention.check`.

    Example:
        >>> from infopt.models import tiny_model
        >>> set_backend_(tiny_model(), "eager").config._attn_implementation
        'eager'
    """
    if isinstance(config, str):
        config = Attention(config)
    for mod in config.required_backends():
        require(mod, feature=f"attention backend {config.backend}")
    info = inspect_model(model)
    config.check(model, info, (config,))
    old = model.config._attn_implementation
    if config.backend == "paged":
        register_paged_attention()
    elif config.backend == "sdpa_gqa":
        register_gqa_sdpa()
    model.set_attn_implementation(BACKENDS[config.backend])
    record_custom(model, f"attn_implementation {old} -> {config.backend}",
                  lambda: model.set_attn_implementation(old), step=step or config.key)
    if config.prompt_dtype is not None and _prompt_dtype_skipped(info) is None:
        for module in _attention_modules(model, info):
            set_attr(model, module, PROMPT_DTYPE_ATTR, PROMPT_DTYPES[config.prompt_dtype], step=step or config.key)
    return model


def _prompt_dtype_skipped(info: ModelInfo) -> str | None:
    """Why a prompt dtype would not pay on this model, or None where it does."""
    if info.device.type != "cpu":
        return f"the model is on {info.device} (the option is for CPUs)"
    if info.dtype != torch.float32:
        return f"the model computes in {info.dtype}, not float32"
    if not fast_bf16_gemm():
        return "this CPU has no native bf16 matmul (AVX512-BF16 or AMX), where bf16 attention is slower than fp32"
    return None


def _attention_modules(model: nn.Module, info: ModelInfo) -> list[nn.Module]:
    family = FAMILIES[info.model_type]
    return [model.get_submodule(f"{fqn}.{family.attn}") for fqn in info.layer_fqns]


@register_transform(Attention)
def _apply(model: nn.Module, config: Attention, ctx: ApplyContext) -> None:
    before = model.config._attn_implementation
    set_backend_(model, config)
    ctx.notes.append(f"attention {before} -> {BACKENDS[config.backend]}")
    if config.prompt_dtype is not None:
        why = _prompt_dtype_skipped(inspect_model(model))
        ctx.notes.append(f"prompts of {PROMPT_MIN_ROWS}+ tokens attend in {config.prompt_dtype}" if why is None else
                         f"prompt_dtype {config.prompt_dtype} not applied: {why}; prompts attend in the model's dtype")

