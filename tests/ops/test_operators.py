"""The kernel floor's table holds: every operator registered under ``torch.ops.infopt`` is declared in
``infopt.ops`` (``OPERATORS`` names its module) and has a fake, so a compiled graph can trace it."""

import importlib

import torch
from torch._library.simple_registry import singleton

from infopt.ops import OPERATORS, cpp

PROBES = {"paged_attention_error_probe", "quant_linear_error_probe", "quant_linear_isa"}  # no tensors, no fake


def _registered() -> set[str]:
    return {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("infopt::")}


def test_every_operator_is_in_the_table_and_has_a_fake():
    for module in set(OPERATORS.values()):
        importlib.import_module(module)
    cpp.build_all()
    cpp_ops = {op for kernel in cpp.KERNELS for op in cpp.operators(kernel)}
    unloaded = {op for kernel in cpp.KERNELS if not cpp.loaded(kernel) for op in cpp.operators(kernel)}
    assert cpp_ops == {op for op, module in OPERATORS.items() if module == "infopt.ops.cpp"}
    assert _registered() - PROBES == set(OPERATORS) - unloaded
    for op in set(OPERATORS) - unloaded:
        assert singleton.find(f"infopt::{op}").fake_impl.kernel is not None, f"infopt::{op} has no fake"

