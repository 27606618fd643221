"""Every infopt operator a compiled graph calls keeps the contract its fake kernel states (``torch.library.opcheck``):
the real output has the fake's shape, dtype and strides, and the schema's aliasing and mutation claims hold.

Compiled CPU decode steps run without Inductor's per-call size asserts (``infopt.compile.decoder.mode_options``):
these checks, with dynamo's guards on the step's inputs and the per-call module check, are what stand in for them.
"""

import pytest
import torch

from infopt.attention import paged
from infopt.compile import packed
from infopt.ops import packed_linear
from infopt.ops.paged_attention import packed_sdpa, split_packed
from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import quantize_int4_grouped

CHECKS = ("test_schema", "test_faketensor")
kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")


def _int4(n, k, group=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return a8.pack_blocked_int4(*quantize_int4_grouped(torch.randn(n, k, generator=g), group, zero_point="float"))


def _check(op, *args):
    torch.library.opcheck(op, args, test_utils=CHECKS)


@kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_ops_match_their_fakes(rows, dtype):
    x = torch.randn(rows, 64).to(dtype)
    w, sm = _int4(48, 64)
    w2, sm2 = _int4(16, 64, seed=1)
    _check(torch.ops.infopt.int4_a8_linear.default, x, w, sm, 32)
    _check(torch.ops.infopt.int4_a8_linear_n.default, x, [w, w2], [sm, sm2], 32)
    codes = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    w8 = a8.pack_blocked_int8(codes)
    _check(torch.ops.infopt.int8_a8_linear.default, x, w8, torch.rand(32) / 50, 32)
    if dtype == torch.float32:
        _check(torch.ops.infopt.int8_f32_linear.default, x, codes, torch.rand(32) / 50)
        _check(torch.ops.infopt.int8_f32_linear.default, x, codes, torch.rand(32, 2) / 50)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dense_copy_matches_its_fake(dtype):
    w, sm = _int4(32, 64)
    _check(torch.ops.infopt.int4_a8_dense_t.default, w, sm, 32, dtype)


@kernel
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_linear_matches_its_fake(bias):
    x = torch.randn(33, 64)
    w = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    _check(torch.ops.infopt.w8a8_linear.default, x, w, torch.rand(48) / 50, torch.randn(48) if bias else None)


def _paged_inputs(dtype, news, extra=20):
    g = torch.Generator().manual_seed(0)
    block, h, h_kv, d = 16, 6, 2, 32
    kv_lens = [n + extra for n in news]
    blocks = [-(-n // block) for n in kv_lens]
    k = torch.randn(sum(blocks) + 1, block, h_kv, d, generator=g).to(dtype)
    v = torch.randn_like(k)
    table = torch.zeros(len(news), max(blocks), dtype=torch.int32)
    used = 1
    for s, nb in enumerate(blocks):
        table[s, :nb] = torch.arange(used, used + nb)
        used += nb
    q = torch.randn(sum(news), h, d, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    return q, k, v, table, starts, torch.tensor(kv_lens)


@pytest.mark.skipif(not paged.load_cpu_kernel(), reason="the C++ paged-attention kernel cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("news", [[1], [1, 1, 1], [5, 1]])
def test_paged_attention_matches_its_fake(dtype, news):
    _check(torch.ops.infopt.paged_attention.default, *_paged_inputs(dtype, news), 0.2, 0)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("news", [[1], [1, 1, 1], [5, 1], [3, 1, 9]])
def test_paged_attention_sdpa_op_matches_its_fake_and_a_dense_softmax(news, window):
    # the operator a compiled forward calls where no C++ kernel or flash-attn applies (CUDA without flash-attn)
    q, k, v, table, starts, kv_lens = _paged_inputs(torch.float32, news, extra=21)
    _check(torch.ops.infopt.paged_attention_sdpa.default, q, k, v, table, starts, kv_lens, 0.2, window)
    out = torch.ops.infopt.paged_attention_sdpa(q, k, v, table, starts, kv_lens, 0.2, window)
    for s, n in enumerate(news):  # each sequence's queries are its last n positions, over its own blocks only
        kv_len = int(kv_lens[s])
        keys = k[table[s].long()].reshape(-1, 2, 32)[:kv_len].repeat_interleave(3, 1)  # [L, H, D]
        vals = v[table[s].long()].reshape(-1, 2, 32)[:kv_len].repeat_interleave(3, 1)
        for i in range(n):
            pos = kv_len - n + i
            lo = max(0, pos - window + 1) if window else 0
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[starts[s] + i], keys[lo:pos + 1]) * 0.2, -1)
            torch.testing.assert_close(out[starts[s] + i], torch.einsum("hl,lhd->hd", w, vals[lo:pos + 1]))


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_sdpa_op_decodes_without_reading_the_layout_back(monkeypatch, window):
    """A step of one token per sequence (sequences of different lengths, a table padded past the shorter ones)
    attends with no value read back to the host (on CUDA, a sync per layer), as the general split computes it."""
    g = torch.Generator().manual_seed(1)
    block, h, h_kv, d = 16, 6, 2, 32
    kv_lens = torch.tensor([3, 40, 17, 64])
    table = torch.tensor([[1, 0, 0, 0], [2, 3, 4, 0], [5, 6, 0, 0], [7, 8, 9, 10]], dtype=torch.int32)
    k = torch.randn(11, block, h_kv, d, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(4, h, d, generator=g)
    starts = torch.arange(5)
    split = split_packed([1, 1, 1, 1], kv_lens.tolist(), starts.tolist(), block, q.device)
    want = packed_sdpa(q, k, v, table, kv_lens, *split, 0.2, window or None)

    def refuse(self):
        raise AssertionError("read back to the host")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    got = torch.ops.infopt.paged_attention_sdpa(q, k, v, table, starts, kv_lens, 0.2, window)
    monkeypatch.undo()
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not packed_linear.can_pack(), reason="this torch build has no oneDNN prepacked linear")
@pytest.mark.parametrize("shape", [(1, 64), (2, 3, 64)])
def test_packed_linear_matches_its_fake(shape):
    lin = torch.nn.Linear(64, 48)
    packed.pack_linears_(lin, min_elements=0)
    handle = lin.__dict__["_infopt_packed"]
    with torch.no_grad():
        _check(torch.ops.infopt.packed_linear.default, torch.randn(shape), lin.weight, lin.bias, handle)


def test_a_fake_that_disagrees_with_its_kernel_is_caught():
    """The check these tests rely on fails for an operator whose fake states other strides than its kernel gives."""
    lib = torch.library.Library("infopt_contract_probe", "FRAGMENT")
    lib.define("f(Tensor x) -> Tensor")
    lib.impl("f", lambda x: x.clone(), "CPU")
    torch.library.register_fake("infopt_contract_probe::f", lambda x: x.new_empty(x.shape[1], x.shape[0]).t(),
                                lib=lib)
    with pytest.raises(Exception, match="Stride mismatch"):
        _check(torch.ops.infopt_contract_probe.f.default, torch.randn(3, 4))
