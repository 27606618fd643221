"""The weight-only GEMV Triton kernels (8-bit int8/fp8 per channel, 4-bit grouped): the custom ops (operand checks,
schema, fake, compile), the tile table, numerics in Triton's CPU interpreter, 16-byte weight loads in the code
compiled for sm_80 and sm_90 (when Triton is installed), and on each device (the kernel on CUDA, the op's reference
on CPU, counted): numerics, the same weights as the device's int4 kernel, the layers that call the ops; CUDA graph
capture on CUDA."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import infopt.ops.triton_gemv as tg
from infopt.ops.triton_gemv import gemv_tiles, w4_gemv, w4_gemv_reference, w8_gemv, w8_gemv_reference
from infopt.quantize.formats.int4 import quantize_int4_grouped
from infopt.quantize.formats.int8 import quantize_int8_per_channel
from infopt.quantize.formats.primitives import pack_int4
from tests.devices import DEVICES

FP8 = getattr(torch, "float8_e4m3fn", None)
# SQNR floors (dB) against the exact product in fp32: the output's rounding dominates (interpreter, measured:
# bf16 48-53, fp16 71-78, fp32 126-139)
FLOORS = {torch.bfloat16: 40.0, torch.float16: 60.0, torch.float32: 100.0}


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def w4_operands(n: int, k: int, gs: int, seed: int = 0, device="cpu"):
    """Codes packed as the op takes them and the bf16 (scale, offset) pairs of the CUDA int4 layout."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    codes, scales, zeros = quantize_int4_grouped(w, gs, zero_point="float")
    s16 = scales.to(torch.bfloat16).float()
    so = torch.stack([s16, (8.0 - zeros) * s16], dim=-1).to(torch.bfloat16).contiguous()
    return pack_int4(codes).to(device), so.to(device), codes, scales, zeros


def test_ops_on_cpu_are_their_references_and_check_operands():
    q, s = quantize_int8_per_channel(torch.randn(24, 64))
    x = torch.randn(2, 3, 64)
    before = tg.kernel_calls()["reference"]
    y = w8_gemv(x, q, s)
    assert y.shape == (2, 3, 24) and torch.equal(y, w8_gemv_reference(x.reshape(6, 64), q, s).reshape(2, 3, 24))
    qw, so, codes, scales, zeros = w4_operands(32, 128, 32)
    y4 = w4_gemv(x[..., :32].repeat(1, 1, 4), qw, so, 32)
    assert y4.shape == (2, 3, 32)
    assert tg.kernel_calls()["reference"] == before + 2
    with pytest.raises(ValueError, match="weight"):
        w8_gemv(x, q.float(), s)
    with pytest.raises(ValueError, match="scale"):
        w8_gemv(x, q, s[:3])
    with pytest.raises(ValueError, match="K=64"):
        w8_gemv(torch.randn(1, 63), q, s)
    with pytest.raises(ValueError, match="group_size"):
        w4_gemv(torch.randn(1, 128), qw, so, 48)
    with pytest.raises(ValueError, match="scale_offset"):
        w4_gemv(torch.randn(1, 128), qw, so[:, :2].contiguous(), 32)
    with pytest.raises(ValueError, match="qweight"):
        w4_gemv(torch.randn(1, 128), qw.to(torch.int8), so, 32)


def test_w4_reference_is_the_int4_layers_weight():
    """(code - 8) * scale + offset with the bf16 pairs is the weight Int4Linear's CUDA layout computes with: within the
    bf16 rounding of scale and offset (relative 2^-9 each, times |code - 8| + |8 - zero| <= 16) of (code - zero) *
    scale; a swapped nibble or group would be off by whole scales."""
    qw, so, codes, scales, zeros = w4_operands(16, 64, 32, seed=1)
    eye = torch.eye(64)
    w_op = w4_gemv_reference(eye, qw, so, 32).t()  # [N, K]
    w_exact = (codes.float() - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    assert (w_op - w_exact).abs().max() <= 16 * 2**-9 * scales.max()


def test_ops_schema_fake_and_compile():
    q, s = quantize_int8_per_channel(torch.randn(16, 32))
    qw, so, *_ = w4_operands(16, 64, 32)
    torch.library.opcheck(tg.w8_gemv, (torch.randn(2, 32), q, s))
    torch.library.opcheck(tg.w4_gemv, (torch.randn(2, 64), qw, so, 32))
    fn = torch.compile(lambda x: w8_gemv(x, q, s) + w4_gemv(x.repeat(1, 2), qw, so, 32), fullgraph=True)
    x = torch.randn(3, 32)
    assert torch.allclose(fn(x), w8_gemv(x, q, s) + w4_gemv(x.repeat(1, 2), qw, so, 32))


@pytest.mark.parametrize("n,k,gs", [(4096, 4096, 128), (1024, 4096, 64), (14336, 4096, 32), (4096, 14336, 128),
                                    (576, 576, 64), (1536, 576, 32), (192, 960, 32), (64, 256, 256)])
def test_tile_table(n, k, gs):
    for bits in (8, 4):
        bn, bk, warps, stages, split = gemv_tiles(n, k, bits, gs)
        assert split == 1  # the table never splits K
        for block in (bn, bk):
            assert block & (block - 1) == 0  # tl.arange takes powers of two
        assert -(-n // bn) >= 128 or bn == 4  # enough programs per row, unless the rows are too few
        assert bk * bits // 8 <= max(256, gs // 2)  # bytes of each weight row per step
        assert bk // 2 <= max(16, k, gs)  # no more than the next power of two of K
        assert warps * 32 * 16 <= max(32 * 16, bn * bk * bits // 8)  # 16 bytes per thread where the tile has them
        if bits == 4:
            assert bk % gs == 0  # whole groups per chunk
    with pytest.raises(ValueError, match="group_size"):
        gemv_tiles(64, 96, 4, 64)
    with pytest.raises(ValueError, match="group_size"):
        gemv_tiles(64, 96, 4, 1)


def test_hopper_rule_gives_the_tiles_the_h200_sweep_found_fastest():
    """On sm_90 parts (``sms`` given) the rule splits K on the 8B Llama's 4,096-output layers as the seventh lane
    run's sweep found fastest at one row (``benchmarks/results/gpu/2026-11-28-h200-seventh-run-gemv.json``), keeps
    16 unsplit rows where there are programs enough, and leaves layers under 16M weights to the first table."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "gpu",
                        "2026-11-28-h200-seventh-run-gemv.json")
    with open(path) as f:
        sweep = json.load(f)["sweep"]
    best = {}
    for r in sweep:
        if r.get("rows") == 1 and "gbs" in r:
            key = (r["n"], r["k"], 4 if r["kernel"] == "gemv_int4" else 8)
            if key not in best or r["gbs"] > best[key]["gbs"]:
                best[key] = r
    for n, k in ((4096, 4096), (4096, 14336)):  # o: both widths; down: the 8-bit kernel (4-bit: a tie within 1%)
        assert gemv_tiles(n, k, 8, sms=132) == tuple(best[(n, k, 8)]["tiles"])
    assert gemv_tiles(4096, 4096, 4, 64, sms=132) == tuple(best[(4096, 4096, 4)]["tiles"])
    for (n, k, bits), r in best.items():  # elsewhere within 15% of the fastest tile measured
        mine = gemv_tiles(n, k, bits, 64 if bits == 4 else None, sms=132)
        got = next(x["gbs"] for x in sweep if x.get("rows") == 1 and x["n"] == n and x["k"] == k
                   and (x["kernel"] == "gemv_int4") == (bits == 4) and tuple(x["tiles"]) == mine)
        assert got >= 0.85 * r["gbs"], (n, k, bits, mine, got, r)
    assert gemv_tiles(28672, 4096, 8, sms=132)[::4] == (16, 1)  # gate/up: 1,792 blocks of 16 rows, unsplit
    assert gemv_tiles(1024, 4096, 8, sms=132) == gemv_tiles(1024, 4096, 8)  # under 16M weights: the first table
    assert tg._sms(torch.device("cpu")) is None


def test_set_gemv_tiles_takes_measured_tiles_and_refuses_what_the_kernel_cannot_run():
    try:
        tg.set_gemv_tiles(4096, 14336, 4, (8, 512, 4, 3, 4), group_size=64)
        assert gemv_tiles(4096, 14336, 4, 64) == (8, 512, 4, 3, 4)
        assert gemv_tiles(4096, 14336, 4, 128) == (16, 512, 4, 3, 1)  # another group size: the table
        tg.set_gemv_tiles(4096, 4096, 8, (32, 512, 8, 1))
        assert gemv_tiles(4096, 4096, 8) == (32, 512, 8, 1, 1)  # split 1 when left out
    finally:
        tg.set_gemv_tiles(4096, 14336, 4, None, group_size=64)
        tg.set_gemv_tiles(4096, 4096, 8, None)
    assert gemv_tiles(4096, 14336, 4, 64) == (16, 512, 4, 3, 1) and gemv_tiles(4096, 4096, 8) == (16, 256, 4, 3, 1)
    for bits, tiles, gs, match in [(6, (16, 256, 4, 3), None, "bits=6"), (8, (16, 256, 4), None, "tiles"),
                                   (8, (12, 256, 4, 3), None, "powers of two"), (8, (16, 256, 0, 3), None, "positive"),
                                   (4, (16, 32, 4, 3), 64, "multiple of group_size=64"),
                                   (4, (16, 512, 4, 3), 48, "group_size")]:
        with pytest.raises(ValueError, match=match):
            tg.set_gemv_tiles(4096, 4096, bits, tiles, group_size=gs)
    assert not tg._TUNED


INTERPRETER_SCRIPT = r"""
import json, torch
from infopt.quantize.formats.int8 import quantize_int8_per_channel
from infopt.ops.triton_gemv import kernel_calls, w4_gemv, w4_gemv_reference, w8_gemv
from tests.quantize.test_triton_gemv import sqnr_db, w4_operands

g = torch.Generator().manual_seed(0)
rows = []
for m, n, k in [(1, 48, 80), (3, 64, 256), (2, 40, 512), (1, 32, 1000)]:
    w = torch.randn(n, k, generator=g)
    q, s = quantize_int8_per_channel(w)
    s8 = w.abs().amax(1) / 448
    f8 = (w / s8[:, None]).to(torch.float8_e4m3fn)
    for dt in ("float32", "float16", "bfloat16"):
        x = torch.randn(m, k, generator=g).to(getattr(torch, dt))
        for wq, sc in ((q, s), (f8, s8)):
            y = w8_gemv(x, wq, sc)
            exact = x.float() @ (wq.float() * sc[:, None]).T
            rows.append(["w8", str(wq.dtype), m, n, k, dt, str(y.dtype), list(y.shape), sqnr_db(exact, y)])
for m, n, k, gs in [(1, 48, 128, 32), (2, 64, 576, 64), (3, 32, 1024, 128), (1, 16, 512, 256), (1, 24, 96, 32)]:
    qw, so, *_ = w4_operands(n, k, gs, seed=m + n)
    for dt in ("float32", "bfloat16"):
        x = torch.randn(m, k, generator=g).to(getattr(torch, dt))
        y = w4_gemv(x, qw, so, gs)
        rows.append(["w4", gs, m, n, k, dt, str(y.dtype), list(y.shape), sqnr_db(w4_gemv_reference(x.float(), qw, so, gs), y)])
x = torch.randn(6, 160, generator=g)[:, ::2]  # a column stride of 2: the op makes it contiguous
q, s = quantize_int8_per_channel(torch.randn(24, 80, generator=g))
rows.append(["w8", "strided", 6, 24, 80, "float32", str(w8_gemv(x, q, s).dtype), [6, 24],
             sqnr_db(x @ (q.float() * s[:, None]).T, w8_gemv(x, q, s))])
print(json.dumps({"rows": rows, "calls": kernel_calls()}))
"""


@pytest.mark.slow
def test_kernels_numerics_in_tritons_cpu_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA weight-only kernels)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["calls"] == {"triton": 36, "reference": 0}  # every call ran a kernel, interpreted
    for kind, _w, m, n, k, dt, out_dtype, shape, db in doc["rows"]:
        dtype = getattr(torch, dt)
        assert out_dtype == str(dtype) and shape == [m, n], (kind, m, n, k, dt)
        assert db > FLOORS[dtype], (kind, _w, m, n, k, dt, db)


ROUTING_SCRIPT = r"""
import json, torch
from torch import nn
import infopt.quantize.formats.int8 as q8
from infopt.ops.triton_gemv import kernel_calls as gemv_calls
from infopt.ops.triton_int8 import kernel_calls as tl_dot_calls
from tests.quantize.test_triton_gemv import sqnr_db

lin = nn.Linear(256, 128, dtype=torch.bfloat16)
weight, bias = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
layer = q8.Int8Linear.from_float(lin)
layer.cuda_kernel = "gemv"
rows = []
for m in (1, 8, 9):
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    before = (gemv_calls(), tl_dot_calls(), q8.kernel_calls())
    with torch.no_grad():
        y = layer(x)
    after = (gemv_calls(), tl_dot_calls(), q8.kernel_calls())
    delta = [{k: a[k] - b[k] for k in a if a[k] != b[k]} for a, b in zip(after, before)]
    rows.append([m, delta, sqnr_db(x.float() @ weight.T + bias, y)])
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_int8_gemv_routing_in_tritons_cpu_interpreter():
    """The CPU twin of the int8 layer's CUDA routing (``test_int8_gemv_kernel_serves_decode_rows``): under Triton's
    interpreter a bf16 ``Int8Linear`` with ``cuda_kernel="gemv"`` sends up to 8 rows to the GEMV kernel and more to the
    tl.dot kernel, each counted as a kernel run (not its reference), within the int8 weights' rounding."""
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA weight-only kernels)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", ROUTING_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(m, gemv, tl_dot, layer) for m, (gemv, tl_dot, layer), _ in rows] == [
        (1, {"triton": 1}, {}, {"w8_gemv": 1}),
        (8, {"triton": 1}, {}, {"w8_gemv": 1}),
        (9, {}, {"triton": 1}, {"int8_weight_mm": 1}),
    ]
    assert all(db > 40 for *_, db in rows), rows  # as on CUDA: int8 weights and a bf16 output, bias included


SPLIT_SCRIPT = r"""
import json, sys, torch
import infopt.ops.triton_gemv as tg
from infopt.quantize.formats.int8 import quantize_int8_per_channel
from tests.quantize.test_triton_gemv import sqnr_db, w4_operands

device = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)
rows = []
for m, n, k, tiles in [(1, 40, 1024, (16, 128, 1, 1, 4)), (3, 24, 1000, (8, 64, 1, 1, 3)),
                       (2, 16, 512, (8, 128, 1, 1, 8)), (1, 4096, 4096, (16, 256, 4, 3, 4))][: 3 + (device.type == "cuda")]:
    w = torch.randn(n, k, generator=g)
    q, s = quantize_int8_per_channel(w)
    x = torch.randn(m, k, generator=g)
    q, s, x = q.to(device), s.to(device), x.to(device)
    y1, y2 = tg.launch_w8(x, q, s, tiles), tg.launch_w8(x, q, s, tiles)
    rows.append([sqnr_db(x @ (q.float() * s[:, None]).T, y1), bool(torch.equal(y1, y2)),
                 int(tg._COUNTERS[x.device].abs().sum())])
# tiles set for a shape reach the op's own launches (and leave with None): split four ways, its bits differ from
# the table's unsplit sum and equal an explicit launch of the same tiles
w = torch.randn(40, 1024, generator=g)
q, s = (t.to(device) for t in quantize_int8_per_channel(w))
x = torch.randn(1, 1024, generator=g).to(device)
tg.set_gemv_tiles(40, 1024, 8, (16, 128, 1, 1, 4))
y_set = tg.w8_gemv(x, q, s)
tg.set_gemv_tiles(40, 1024, 8, None)
y_table = tg.w8_gemv(x, q, s)
rows.append([sqnr_db(x @ (q.float() * s[:, None]).T, y_set),
             bool(torch.equal(y_set, tg.launch_w8(x, q, s, (16, 128, 1, 1, 4))) and not torch.equal(y_set, y_table)),
             int(tg._COUNTERS[x.device].abs().sum())])
for m, n, k, gs, tiles in [(1, 40, 1024, 64, (16, 128, 1, 1, 4)), (2, 24, 1088, 64, (8, 128, 1, 1, 3)),
                           (1, 4096, 4096, 64, (16, 512, 4, 3, 4))][: 2 + (device.type == "cuda")]:
    qw, so, *_ = w4_operands(n, k, gs, seed=n, device=device)
    x = torch.randn(m, k, generator=g).to(device)
    y1, y2 = tg.launch_w4(x, qw, so, gs, tiles), tg.launch_w4(x, qw, so, gs, tiles)
    rows.append([sqnr_db(tg.w4_gemv_reference(x, qw, so, gs), y1), bool(torch.equal(y1, y2)),
                 int(tg._COUNTERS[x.device].abs().sum())])
print(json.dumps(rows))
"""


def test_split_k_kernels(device):
    """The 8-bit and 4-bit kernels with K split among several programs per output block (what
    ``benchmarks/gpu_gemv.py --sweep-kernels gemv_w8_split,gemv_w4_split`` measures, and tiles set with
    ``set_gemv_tiles`` reach the op with): the
    last program to arrive adds the partial
    sums in a fixed order, so the product is the exact one to fp32 rounding, two calls give the same bits, and every
    ticket counter is back at zero for the next call (or CUDA-graph replay); uneven K slices included. On CPU the
    kernel runs in Triton's interpreter (a child process), on CUDA compiled."""
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA weight-only kernels)")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", SPLIT_SCRIPT, device], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == (6 if device == "cpu" else 8)
    assert all(db > 100 and same and left == 0 for db, same, left in rows), rows


@pytest.mark.slow
def test_kernels_compile_for_ampere_and_hopper_with_16_byte_weight_loads():
    """Triton compiles both kernels to cubin with its bundled ptxas and no device (fp8 weights for sm_90 only), and,
    given 16-byte aligned pointers (what Triton specializes a launch on for torch's allocations), reads the weights
    in 16-byte vector loads: a matrix-vector product lives on its weight loads."""
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA weight-only kernels)")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    if not hasattr(compiler, "ASTSource") or not hasattr(backends, "GPUTarget") or tg._interpreting():
        pytest.skip("this Triton has no ASTSource / GPUTarget ahead-of-time API, or it is interpreting")
    import triton

    w8, w4 = tg._kernels()
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # x, weight, scales, y
    ints = dict.fromkeys(("N", "stride_xm", "stride_ym"), "i32")
    for arch in (80, 90):
        for x in ("bf16", "fp16", "fp32"):
            cases = [(w8, {"x_ptr": f"*{x}", "w_ptr": f"*{wd}", "s_ptr": "*fp32", "y_ptr": f"*{x}", "ws_ptr": "*fp32",
                           "cnt_ptr": "*i32"}, n, k, None)
                     for wd in ("i8", "fp8e4nv")[: 2 if arch >= 89 else 1] for n, k in ((4096, 4096), (1024, 14336))]
            cases += [(w4, {"x_ptr": f"*{x}", "q_ptr": "*u8", "so_ptr": "*bf16", "y_ptr": f"*{x}", "ws_ptr": "*fp32",
                            "cnt_ptr": "*i32"}, n, k, gs)
                      for n, k, gs in ((4096, 4096, 128), (14336, 4096, 32), (1536, 576, 64))]
            for kernel, ptrs, n, k, gs in cases:
                bn, bk, warps, stages, _ = gemv_tiles(n, k, 8 if gs is None else 4, gs)
                # whole, and split four ways along K on the 4,096-output layers (as gpu_gemv.py --sweep tries it)
                split = 4 if n == 4096 else 1
                const = {"K": k, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split,
                         "KS": ((k + split - 1) // split + bk - 1) // bk * bk, **({"GS": gs} if gs else {})}
                sig = {**ptrs, **ints, **dict.fromkeys(const, "constexpr")}
                sig = {arg: sig[arg] for arg in kernel.arg_names}
                out = triton.compile(compiler.ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=aligned),
                                     target=backends.GPUTarget("cuda", arch, 32),
                                     options={"num_warps": warps, "num_stages": stages})
                assert out.asm["cubin"], (arch, x, n, k, gs)
                loads = re.findall(r"ld\.global(?:\.\w+)*", out.asm["ptx"])
                assert any(".v4" in ld for ld in loads), (arch, x, n, k, gs, loads)
                assert not any(ld.endswith(".b8") or ld.endswith(".u8") for ld in loads), (arch, x, n, k, gs, loads)


# -- on each device: the kernel on CUDA, the op's reference on CPU -------------------------------------------

@pytest.mark.parametrize("dtype", list(FLOORS), ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 1024, 4096), (2, 14336, 4096), (4, 4096, 14336),
                                   (8, 1536, 576), (3, 130, 200)], ids=lambda v: str(v))
def test_w8_op_matches_the_exact_product(dtype, m, n, k, device):
    path = DEVICES[device].triton
    torch.manual_seed(0)
    w = torch.randn(n, k, device=device)
    q, s = quantize_int8_per_channel(w)
    x = torch.randn(m, k, device=device).to(dtype)
    before = tg.kernel_calls()[path]
    y = w8_gemv(x, q, s)
    assert tg.kernel_calls()[path] == before + 1
    assert y.dtype == dtype and sqnr_db(x.float() @ (q.float() * s[:, None]).T, y) > FLOORS[dtype]
    if DEVICES[device].fp8_weights():
        s8 = w.abs().amax(1) / 448
        f8 = (w / s8[:, None]).to(FP8)
        y8 = w8_gemv(x, f8, s8)
        assert tg.kernel_calls()[path] == before + 2
        assert sqnr_db(x.float() @ (f8.float() * s8[:, None]).T, y8) > FLOORS[dtype]


@pytest.mark.parametrize("m,n,k,gs", [(1, 4096, 4096, 128), (1, 14336, 4096, 32), (2, 4096, 14336, 64),
                                      (8, 1536, 576, 64), (1, 576, 576, 32)], ids=lambda v: str(v))
def test_w4_op_matches_the_devices_int4_kernel_on_the_same_weights(m, n, k, gs, device):
    from infopt.quantize.formats.int4 import Int4Linear

    path = DEVICES[device].triton
    qw, so, codes, scales, zeros = w4_operands(n, k, gs, device=device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    before = tg.kernel_calls()[path]
    y = w4_gemv(x, qw, so, gs)
    assert tg.kernel_calls()[path] == before + 1
    ref = w4_gemv_reference(x.float(), qw, so, gs)
    assert sqnr_db(ref, y) > FLOORS[torch.bfloat16]
    layer = Int4Linear.from_codes(codes.to(device), scales.to(device), zeros.to(device), group_size=gs,
                                  dtype=torch.bfloat16)
    assert layer.layout == DEVICES[device].int4_layout  # tinygemm on CUDA, torch's int4 CPU kernel on CPU
    # the same bf16 (scale, offset) pairs: the same weights, through the device's int4 kernel
    assert torch.equal(layer.scale_offset.transpose(0, 1).contiguous(), so)
    assert sqnr_db(layer(x).float(), y) > FLOORS[torch.bfloat16]


@pytest.mark.gpu
def test_kernels_replay_in_a_cuda_graph():
    q, s = quantize_int8_per_channel(torch.randn(512, 1024, device="cuda"))
    qw, so, *_ = w4_operands(512, 1024, 64, device="cuda")
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w8_gemv(x, q, s), w4_gemv(x, qw, so, 64)  # compile the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y8, y4 = w8_gemv(x, q, s), w4_gemv(x, qw, so, 64)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y8, w8_gemv(x, q, s)) and torch.equal(y4, w4_gemv(x, qw, so, 64))


# -- the layers that call the kernels ------------------------------------------------------------------

def test_int4_gemv_layout_computes_the_kernel_layouts_weights_and_saves_portably():
    """Int4WeightOnly(cuda_kernel="gemv") keeps the portable codes and tinygemm's bf16 (scale, offset) pairs: its
    layers compute what the default layout computes (to bf16 rounding of the offsets), through the op at up to
    eight rows and a dequantized matmul above, and save the same portable tensors."""
    import copy

    from infopt.models import tiny_model
    from infopt.quantize import Int4WeightOnly, quantize_
    from infopt.quantize.formats.int4 import Int4Linear

    base = tiny_model("llama")
    gemv = quantize_(copy.deepcopy(base), Int4WeightOnly(group_size=32, cuda_kernel="gemv"))
    kern = quantize_(copy.deepcopy(base), Int4WeightOnly(group_size=32))
    layers = [m for m in gemv.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.layout == "gemv" for m in layers)
    a, b = gemv.model.layers[0].mlp.up_proj, kern.model.layers[0].mlp.up_proj
    assert b.layout != "gemv"
    for rows in (1, 8, 12):
        x = torch.randn(rows, a.in_features)
        before = dict(tg.kernel_calls())
        ya, yb = a(x), b(x)
        ops = sum(tg.kernel_calls().values()) - sum(before.values())
        assert ops == (1 if rows <= tg.GEMV_MAX_ROWS else 0), (rows, ops)
        assert (ya - yb).abs().max() <= 0.01 * yb.abs().max(), rows
    sa, sb = gemv.state_dict(), kern.state_dict()
    for name in ("qweight", "scales", "zeros"):
        key = f"model.layers.0.mlp.up_proj.{name}"
        assert torch.equal(sa[key], sb[key]), name
    again = quantize_(copy.deepcopy(base), Int4WeightOnly(group_size=32, cuda_kernel="gemv"))
    again.load_state_dict(sb)  # the kernel layout's save loads into the gemv layout, exactly
    assert torch.equal(again.model.layers[0].mlp.up_proj.scale_offset, a.scale_offset)
    ids = torch.randint(0, 100, (1, 10))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, gemv(ids).logits)


def test_int4_gemv_layout_compiles_without_graph_breaks():
    from infopt.quantize.formats.int4 import Int4Linear

    lin = torch.nn.Linear(128, 64)
    layer = Int4Linear.from_float(lin, group_size=32, layout="gemv")
    fn = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in (1, 12):
        x = torch.randn(rows, 128)
        assert torch.allclose(fn(x), layer(x), atol=1e-5, rtol=1e-5)


def test_fp8_weight_only_layer_takes_the_gemv_op_for_decode_rows():
    from torch import nn

    from infopt.core.errors import RecipeError
    from infopt.quantize.formats.fp8 import FP8, FP8Linear

    lin = nn.Linear(64, 32)
    for granularity in ("row", "tensor"):
        q = FP8Linear.from_float(lin, granularity=granularity, activations="none")
        with torch.no_grad():
            for rows, kernel in ((1, "gemv"), (8, "gemv"), (9, "dequantized")):
                x = torch.randn(rows, 64)
                y = q(x)
                assert q.last_kernel == kernel
                assert torch.allclose(y, q.reference_forward(x), atol=1e-5, rtol=1e-5), (granularity, rows)
                # weight-only: only the weight's rounding, well within the dynamic-activation path's error
                assert (y - lin(x)).abs().max() <= 0.1 * lin(x).abs().max()
        # bf16 prompt rows: the codes cast to bf16, the scales on the product; within bf16's rounding of the reference
        qb = FP8Linear.from_float(nn.Linear(64, 32, bias=False).to(torch.bfloat16), granularity=granularity,
                                  activations="none")
        xb = torch.randn(12, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            yb, ref = qb(xb).float(), qb.reference_forward(xb).float()
        assert qb.last_kernel == "dequantized"
        assert (yb - ref).abs().max() <= 0.02 * ref.abs().max(), granularity
    assert FP8(activations="none").to_dict()["quantize"]["activations"] == "none"
    with pytest.raises(RecipeError, match="activations"):
        FP8(activations="static")
    with pytest.raises(ValueError, match="activations"):
        FP8Linear(16, 16, bias=False, activations="int8")


@pytest.mark.slow
def test_fast_decode_with_gemv_int4_weights_runs_the_op_and_matches_eager_greedy(device):
    """fp32: the device's fast decode path (a compiled step: CUDA graphs on CUDA, inductor on CPU) over gemv-layout
    int4 layers decodes the same greedy tokens as the same layers run eagerly, and the op ran (the Triton kernel in
    CUDA's eager warm-up before capture; the reference, called from the compiled graph, on CPU)."""
    import copy

    import infopt
    from infopt.models import tiny_model
    from infopt.quantize import Int4WeightOnly, quantize_

    path = DEVICES[device].triton
    base = tiny_model("llama").to(device)
    eager = quantize_(copy.deepcopy(base), Int4WeightOnly(group_size=32, cuda_kernel="gemv"))
    fast = copy.deepcopy(base)
    before = tg.kernel_calls()[path]
    infopt.optimize(fast, {"steps": [{"quantize": {"method": "int4", "group_size": 32, "cuda_kernel": "gemv"}},
                                     {"kvcache": {"kind": "static"}},
                                     {"compile": {"mode": DEVICES[device].decode_compile_mode}}]})
    ids = torch.randint(3, 100, (1, 9), device=device)
    want = eager.generate(ids, max_new_tokens=12, do_sample=False)
    got = fast.generate(ids, max_new_tokens=12, do_sample=False)
    assert tg.kernel_calls()[path] > before
    assert torch.equal(got, want)


def test_fp8_weight_only_layer_runs_the_op(device):
    from torch import nn

    from infopt.quantize.formats.fp8 import FP8Linear

    if not DEVICES[device].fp8_weights():
        pytest.skip("fp8 weights need compute capability 8.9+")
    path = DEVICES[device].triton
    lin = nn.Linear(4096, 1024, device=device, dtype=torch.bfloat16)
    q = FP8Linear.from_float(lin, activations="none")
    x = torch.randn(2, 4096, device=device, dtype=torch.bfloat16)
    before = tg.kernel_calls()[path]
    with torch.no_grad():
        y = q(x)
    assert q.last_kernel == "gemv" and tg.kernel_calls()[path] == before + 1
    assert sqnr_db(q.reference_forward(x), y) > FLOORS[torch.bfloat16]


def test_int8_cuda_kernel_field_reaches_the_layers_and_the_int4_head():
    from infopt.core.errors import RecipeError
    from infopt.models import tiny_model
    from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_
    from infopt.quantize.formats.int8 import Int8Linear

    m = quantize_(tiny_model("llama"), Int8WeightOnly(cuda_kernel="gemv"))
    layers = [x for x in m.modules() if isinstance(x, Int8Linear)]
    assert layers and all(x.cuda_kernel == "gemv" for x in layers)
    assert Int4WeightOnly(include_lm_head=True, cuda_kernel="gemv").head_config().cuda_kernel == "gemv"
    assert Int4WeightOnly(include_lm_head=True).head_config().cuda_kernel == "tl_dot"
    with pytest.raises(RecipeError, match="cuda_kernel"):
        Int8WeightOnly(cuda_kernel="gemm")


def test_int8_gemv_kernel_serves_decode_rows(device):
    """An int8 layer with ``cuda_kernel="gemv"``: on CUDA decode rows (up to 8) take the GEMV kernel and more rows the
    tl.dot kernel; on CPU neither Triton op runs for a bf16 layer (the dequantized ``F.linear``). Every output is the
    float layer's within the int8 weights' rounding."""
    from torch import nn

    from infopt.ops.triton_int8 import kernel_calls as tl_dot_calls
    from infopt.quantize.formats.int8 import Int8Linear

    path, per_call = DEVICES[device].triton, DEVICES[device].int8_mm_layer_calls
    lin = nn.Linear(1024, 512, device=device, dtype=torch.bfloat16)
    weight, bias = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
    layer = Int8Linear.from_float(lin)
    layer.cuda_kernel = "gemv"  # what Int8WeightOnly(cuda_kernel="gemv") sets (tested on CPU above)
    for rows, gemv in ((1, 1), (8, 1), (9, 0)):
        x = torch.randn(rows, 1024, device=device, dtype=torch.bfloat16)
        g0, t0 = tg.kernel_calls()[path], tl_dot_calls()[path]
        with torch.no_grad():
            y = layer(x)
        assert (tg.kernel_calls()[path] - g0, tl_dot_calls()[path] - t0) == (gemv * per_call,
                                                                           (1 - gemv) * per_call), rows
        # the float layer, bias included: int8 weights and a bf16 output measure 46 dB (CPU); a reference without the
        # bias is off by the bias itself and reads 29.5-30 dB whatever the kernel does
        assert sqnr_db(x.float() @ weight.T + bias, y) > 40, rows
