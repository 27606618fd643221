"""The int8 weight-only Triton kernel: the custom op (schema, fake, compile), tile table, Triton's CPU interpreter
(when Triton is installed), and on each device (the kernel on CUDA, the op's reference on CPU, counted): numerics
against the exact product, Int8WeightOnly models, torch.compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import infopt
import infopt.ops.triton_int8 as triton_int8
from infopt.models import tiny_model
from infopt.ops.triton_int8 import int8_weight_mm, int8_weight_mm_reference, kernel_calls, tile_config
from infopt.quantize import Int8Linear, Int8WeightOnly
from infopt.quantize.formats.int8 import quantize_int8_per_channel
from tests.devices import DEVICES

# SQNR floors (dB) of the op against the exact product x @ dequantized(w).T in fp32: the output's own rounding
# dominates (bf16 keeps 8 bits: ~49 dB measured with Triton's interpreter, fp16 ~74, fp32 ~133)
FLOORS = {torch.bfloat16: 40.0, torch.float16: 60.0, torch.float32: 100.0}
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def _operands(m: int, n: int, k: int, dtype: torch.dtype, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    return x.to(device), q.to(device), s.to(device)


def _exact(x, q, s) -> torch.Tensor:
    return x.float() @ (q.float() * s[:, None]).T


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in kernel_calls().items()}


# -- CPU: the op's contract ---------------------------------------------------------------------------

def test_import_infopt_neither_imports_triton_nor_initializes_cuda():
    code = ("import sys, json, torch, infopt, infopt.quantize.formats.int8, infopt.ops.triton_int8\n"
            "print(json.dumps({'triton': 'triton' in sys.modules, 'cuda': torch.cuda.is_initialized(),\n"
            "                  'op': hasattr(torch.ops.infopt, 'int8_weight_mm')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"triton": False, "cuda": False, "op": True}


def test_op_on_cpu_is_the_reference_and_checks_its_operands():
    x, q, s = _operands(5, 24, 40, torch.float32)
    before = kernel_calls()
    y = int8_weight_mm(x, q, s)
    assert torch.equal(y, int8_weight_mm_reference(x, q, s))
    assert _delta(before) == {"triton": 0, "reference": 1}
    assert int8_weight_mm(x.reshape(1, 5, 40), q, s).shape == (1, 5, 24)
    with pytest.raises(ValueError, match=r"int8 weight \[N, K\]"):
        int8_weight_mm(x, q.float(), s)
    with pytest.raises(ValueError, match=r"x \(5, 40\) and weight \(24, 39\)"):
        int8_weight_mm(x, q[:, :39], s)
    with pytest.raises(ValueError, match=r"scale \(23,\)"):
        int8_weight_mm(x, q, s[:23])


def test_op_schema_fake_and_compile():
    x, q, s = _operands(3, 48, 64, torch.float32)
    torch.library.opcheck(torch.ops.infopt.int8_weight_mm.default, (x, q, s))
    f = torch.compile(lambda a: int8_weight_mm(a, q, s) + 1, fullgraph=True, backend="aot_eager")
    for rows in (3, 1, 7):  # new row counts retrace through the fake implementation
        a = torch.randn(rows, 64)
        torch.testing.assert_close(f(a), int8_weight_mm_reference(a, q, s) + 1)


def test_int8_linear_on_cpu_does_not_call_the_op():
    """On CPU the layer runs its CPU kernels, counted: bf16 activations (``auto`` on a CPU whose C++ kernels lack
    AVX-512) on ``torch._weight_int8pack_mm``; fp32 on infopt's C++ int8 x fp32 kernel where it builds."""
    from infopt.quantize.formats import a8, int8

    lin = nn.Linear(64, 32)
    before, layer_before = kernel_calls(), int8.kernel_calls()
    want = {}
    for cd in ("auto", "bfloat16", "float32"):
        layer = Int8Linear.from_float(lin, compute_dtype=cd)
        with torch.no_grad():
            layer(torch.randn(2, 64))
        fp32 = "int8_f32_linear" if a8.available() else "dequantized_chunks"
        kernel = fp32 if layer.compute_dtype == torch.float32 else "weight_int8pack_mm"
        want[kernel] = want.get(kernel, 0) + 1
    assert _delta(before) == {"triton": 0, "reference": 0}
    assert {k: v - layer_before[k] for k, v in int8.kernel_calls().items() if v != layer_before[k]} == want


def test_missing_triton_warns_once_and_falls_back(monkeypatch):
    # the warning is for CUDA calls without Triton; TRITON_INTERPRET=1 lets a CPU call take that branch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_int8, "triton_available", lambda: False)
    monkeypatch.setattr(triton_int8, "_WARNED", False)
    x, q, s = _operands(2, 16, 32, torch.float32)
    with pytest.warns(RuntimeWarning, match="Triton is not installed.*pip install triton"):
        y = int8_weight_mm(x, q, s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        int8_weight_mm(x, q, s)  # once only
    assert torch.equal(y, int8_weight_mm_reference(x, q, s))


@pytest.mark.parametrize("x_bytes", [2, 4], ids=["16bit", "fp32"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 11008, 4096), (17, 64, 64), (300, 4096, 14336), (2, 20, 8)])
def test_tile_config_is_valid_for_tl_dot(m, n, k, x_bytes):
    bm, bn, bk, warps, stages = tile_config(m, n, k, x_bytes)
    for block, dim in ((bm, m), (bn, n), (bk, k)):
        assert block >= 16 and block & (block - 1) == 0  # tl.dot: powers of two, at least 16
        assert block <= max(16, 1 << (dim - 1).bit_length())
    assert (bm == 16) == (m <= 16)  # decode rows fit one tile
    assert stages * (bm * bk * x_bytes + bn * bk) <= 100 * 1024  # pipelined tiles within sm_86's shared memory


def test_kernel_compiles_for_ampere_and_hopper_without_a_gpu():
    """Triton compiles to cubin with its bundled ptxas and no device: every dtype and tile shape, for sm_80 and
    sm_90, within 100 KiB of shared memory."""
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA int8 kernel)")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    if not hasattr(compiler, "ASTSource") or not hasattr(backends, "GPUTarget") or triton_int8._interpreting():
        pytest.skip("this Triton has no ASTSource / GPUTarget ahead-of-time API, or it is interpreting")
    import triton

    kernel = triton_int8._kernel()
    ints = ("M", "N", "stride_xm", "stride_wn", "stride_ym")
    for arch in (80, 90):
        for name, x_bytes in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
            for m, n, k in ((1, 4096, 4096), (3, 384, 1000), (33, 4096, 1024), (300, 96, 80)):
                bm, bn, bk, warps, stages = tile_config(m, n, k, x_bytes)
                const = {"stride_xk": 1, "stride_wk": 1, "stride_yn": 1, "K": k, "BLOCK_M": bm, "BLOCK_N": bn,
                         "BLOCK_K": bk, "IEEE": name == "fp32", "VIA_F32": False}
                sig = {"x_ptr": f"*{name}", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": f"*{name}",
                       **dict.fromkeys(ints, "i32"), **dict.fromkeys(const, "constexpr")}
                sig = {arg: sig[arg] for arg in kernel.arg_names}  # in the kernel's argument order
                out = triton.compile(compiler.ASTSource(fn=kernel, signature=sig, constexprs=const),
                                     target=backends.GPUTarget("cuda", arch, 32),
                                     options={"num_warps": warps, "num_stages": stages})
                assert out.asm["cubin"] and out.metadata.shared <= 100 * 1024, (arch, name, m, n, k)


INTERPRETER_SCRIPT = r"""
import json, torch
from infopt.quantize.formats.int8 import quantize_int8_per_channel
from infopt.ops.triton_int8 import int8_weight_mm, kernel_calls

def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))

g = torch.Generator().manual_seed(0)
res = []
for m, n, k in [(1, 48, 80), (3, 64, 256), (16, 32, 512), (17, 40, 96), (70, 130, 64)]:
    q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    for dt in ("float32", "float16", "bfloat16"):
        x = torch.randn(m, k, generator=g).to(getattr(torch, dt))
        y = int8_weight_mm(x, q, s)
        res.append([m, n, k, dt, str(y.dtype), list(y.shape), sqnr(x.float() @ (q.float() * s[:, None]).T, y)])
q, s = quantize_int8_per_channel(torch.randn(48, 80, generator=g))
for x in (torch.randn(2, 3, 160, generator=g)[..., :80], torch.randn(6, 160, generator=g)[:, ::2]):
    y = int8_weight_mm(x, q, s)  # 3-D with padded rows (row stride 160); K stride 2
    ref = x.reshape(6, 80).float() @ (q.float() * s[:, None]).T
    res.append([6, 48, 80, "strided", str(y.dtype), list(y.shape), sqnr(ref, y.reshape(6, 48))])
print(json.dumps({"rows": res, "calls": kernel_calls()}))
"""


@pytest.mark.slow
def test_kernel_numerics_in_tritons_cpu_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA int8 kernel)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["calls"] == {"triton": 17, "reference": 0}  # every call ran the kernel, interpreted
    for m, n, k, dt, out_dtype, shape, db in doc["rows"]:
        dtype = getattr(torch, dt) if dt != "strided" else torch.float32
        assert out_dtype == str(dtype) and shape[-1] == n, (m, n, k, dt)
        assert db > FLOORS[dtype], (m, n, k, dt, db)


# -- on each device: the Triton kernel on CUDA, the op's reference on CPU ------------------------------------


def _expected(path: str, n: int) -> dict[str, int]:
    """``kernel_calls()`` deltas when ``n`` calls took ``path``."""
    return {"triton": 0, "reference": 0, path: n}


@pytest.mark.parametrize("dtype", list(FLOORS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (1, 11008, 4096), (3, 384, 1000), (7, 1000, 768), (16, 512, 4096),
                                   (17, 256, 512), (33, 4096, 1024), (129, 320, 2048), (300, 96, 80)],
                         ids=lambda v: str(v))
def test_op_matches_the_exact_product(dtype, m, n, k, device):
    path = DEVICES[device].triton
    if path == "triton":
        pytest.importorskip("triton")
    x, q, s = _operands(m, n, k, dtype, device=device, seed=m + n + k)
    before = kernel_calls()
    y = int8_weight_mm(x, q, s)
    assert _delta(before) == _expected(path, 1)
    assert y.dtype == dtype and y.shape == (m, n) and y.device == x.device
    exact = _exact(x, q, s)
    assert sqnr_db(exact, y) > FLOORS[dtype]
    if dtype != torch.float32:  # at least as close as dequantize-then-matmul in the same dtype (the path it
        # replaces, which rounds the product and the scaled product): one rounding of the fp32 accumulator
        assert sqnr_db(exact, y) > sqnr_db(exact, int8_weight_mm_reference(x, q, s)) - 1.0


def test_op_takes_strided_and_batched_activations(device):
    path = DEVICES[device].triton
    if path == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    q, s = quantize_int8_per_channel(torch.randn(300, 200, generator=g))
    q, s = q.to(device), s.to(device)
    padded = torch.randn(2, 5, 400, generator=g).to(device).bfloat16()[..., :200]  # row stride 400
    spaced = torch.randn(10, 400, generator=g).to(device).bfloat16()[:, ::2]  # K stride 2
    for x in (padded, spaced):
        before = kernel_calls()
        y = int8_weight_mm(x, q, s)
        assert _delta(before) == _expected(path, 1)
        assert y.shape == (*x.shape[:-1], 300)
        assert sqnr_db(_exact(x.reshape(10, 200), q, s), y.reshape(10, 300)) > FLOORS[torch.bfloat16]


def test_int8_weight_only_runs_the_devices_path_and_keeps_bf16_top1(device):
    """Every int8 linear of a bf16 model goes through the Triton op on CUDA, once per forward; on CPU through none
    (a dequantized ``F.linear``); either way the logits stay the bf16 model's."""
    path, per_call = DEVICES[device].triton, DEVICES[device].int8_mm_layer_calls
    if per_call:
        pytest.importorskip("triton")
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    ids = torch.randint(3, 40_000, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref = m(ids).logits.float()
    infopt.optimize(m, [Int8WeightOnly()])
    layers = [mod for mod in m.modules() if isinstance(mod, Int8Linear)]
    assert len(layers) == 2 * 7 and all(lay.weight_int8.device.type == device for lay in layers)
    before = kernel_calls()
    with torch.no_grad():
        out = m(ids).logits.float()
    assert _delta(before) == _expected(path, per_call * len(layers))  # every linear, once, on the device's path
    lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == out.argmax(-1)).float().mean())
    # CPU int8 weights against fp32 on this model: KL ~1e-6, top-1 1.0 (tests/quantize/test_bnb.py figures)
    assert kl < 1e-4 and top1 >= 0.9, (kl, top1)


def test_int8_linear_compiles_without_graph_breaks(device):
    path, per_call = DEVICES[device].triton, DEVICES[device].int8_mm_layer_calls
    if per_call:
        pytest.importorskip("triton")
    lin = Int8Linear.from_float(nn.Linear(512, 384).to(device).bfloat16())
    x = torch.randn(3, 512, device=device, dtype=torch.bfloat16)
    eager = lin(x)
    compiled = torch.compile(lin, fullgraph=True)
    before = kernel_calls()
    assert torch.equal(compiled(x), eager)  # the same kernel, called from the compiled graph (CUDA)
    assert _delta(before)[path] >= per_call


@pytest.mark.slow
def test_fast_decode_with_int8_weights_is_token_identical(device):
    """Int8 weights + static cache + the decode step compiled as the device's fast preset does (CUDA graphs on CUDA,
    inductor on CPU): the same greedy tokens as the int8 model run eagerly."""
    from infopt.compile import Compile, compile_stats
    from infopt.kvcache import Static

    path, per_call = DEVICES[device].triton, DEVICES[device].int8_mm_layer_calls
    if per_call:
        pytest.importorskip("triton")
    eager, m = tiny_model().to(device), tiny_model().to(device)
    infopt.optimize(eager, [Int8WeightOnly()])
    before = kernel_calls()
    infopt.optimize(m, [Int8WeightOnly(), Static(max_length=128), Compile(mode=DEVICES[device].decode_compile_mode)])
    prompts = [torch.tensor([p], device=device) for p in ([1, 17, 400, 23, 9], [5, 6, 7, 8, 9, 10, 11, 12])]
    outs = [m.generate(ids, max_new_tokens=12, do_sample=False) for ids in prompts]
    # CUDA: prefill (eager) and the graphs' warm-up ran the Triton op; CPU: fp32 takes the C++ int8 kernel, not the op
    assert (_delta(before)[path] > 0) == bool(per_call)
    for ids, out in zip(prompts, outs, strict=True):
        # fp32: the kernel's IEEE dots round alike compiled or not; tokens identical
        assert torch.equal(out, eager.generate(ids, max_new_tokens=12, do_sample=False))
    assert compile_stats(m).compiles_after_warmup == 0
