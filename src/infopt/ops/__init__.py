"""infopt's kernel floor: every ``torch.ops.infopt`` operator is declared in this package, with its fake (the output
shape a compiled graph traces with), and the callers above import their kernels from here.

=================================  ===============================  =============================================
operator                           declared in                      kernel
=================================  ===============================  =============================================
``packed_linear``                  :mod:`infopt.ops.packed_linear`  oneDNN on a prepacked fp32/bf16 weight (CPU)
``paged_attention_sdpa``           :mod:`infopt.ops.paged_attention` torch gather + SDPA over a block table
``paged_attention_triton``         :mod:`infopt.ops.triton_paged`   Triton over a block table (CUDA; interpreter)
``paged_attention``                :mod:`infopt.ops.cpp`            C++ (``csrc/paged_attention.cpp``, CPU)
``int4_a8_linear``, ``_n``,        :mod:`infopt.ops.cpp`            C++ (``csrc/quant_linear.cpp``, CPU): int4 and
``int8_a8_linear``,                                                 int8 weights x int8 or fp32 activations,
``int4_a8_dense_t``, ``_out``,                                      W8A8, int4 dequantized for prompts,
``int8_f32_linear``, ``w8a8_linear``,                               GGUF blocks transcoded into the a8 layouts
``int4_a8_from_ggml``,
``int8_a8_from_ggml``
``int8_weight_mm``                 :mod:`infopt.ops.triton_int8`    Triton ``tl.dot`` (CUDA; interpreter on CPU)
``w8_gemv``, ``w4_gemv``           :mod:`infopt.ops.triton_gemv`    Triton GEMV, 8-bit and 4-bit weights (CUDA)
``quantized_experts``,             :mod:`infopt.ops.experts`        a live module's method (MoE dispatch)
``expert_parallel``
=================================  ===============================  =============================================

Each module registers its operators when first imported: ``import infopt`` loads all of them but
:mod:`~infopt.ops.packed_linear` (loaded when the compile stage packs a model's linears) and the C++ kernels, which
are built from ``csrc/`` on first use (:mod:`infopt.ops.cpp`) and register their fakes as they load. Callers import
their kernels from these modules. :data:`OPERATORS` is the table above, which ``tests/ops`` holds to what the modules
register.
"""

from __future__ import annotations

__all__ = ["OPERATORS"]

OPERATORS: dict[str, str] = {
    "packed_linear": "infopt.ops.packed_linear",
    "paged_attention_sdpa": "infopt.ops.paged_attention",
    "paged_attention_triton": "infopt.ops.triton_paged",
    "paged_attention": "infopt.ops.cpp",
    "int4_a8_linear": "infopt.ops.cpp",
    "int4_a8_linear_n": "infopt.ops.cpp",
    "int8_a8_linear": "infopt.ops.cpp",
    "int4_a8_dense_t": "infopt.ops.cpp",
    "int4_a8_dense_t_out": "infopt.ops.cpp",
    "int8_f32_linear": "infopt.ops.cpp",
    "w8a8_linear": "infopt.ops.cpp",
    "int4_a8_from_ggml": "infopt.ops.cpp",
    "int8_a8_from_ggml": "infopt.ops.cpp",
    "int8_weight_mm": "infopt.ops.triton_int8",
    "w8_gemv": "infopt.ops.triton_gemv",
    "w4_gemv": "infopt.ops.triton_gemv",
    "quantized_experts": "infopt.ops.experts",
    "expert_parallel": "infopt.ops.experts",
}
"""Every ``torch.ops.infopt`` operator (the C++ kernels' probes ``*_error_probe`` and ``quant_linear_isa`` aside,
which take no tensors and need no fake) and the module that declares it."""
