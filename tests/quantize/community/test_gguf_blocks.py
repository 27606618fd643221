"""GGUF block decoding: every type against gguf-py's own dequantizer, on arbitrary bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infopt.quantize.community.gguf_blocks import BLOCKS, decode_int4, decode_int8, decode_q4_0, dequantize_blocks

gguf = pytest.importorskip("gguf")

# byte offsets of each block's fp16 scale fields, which must be finite for the block to mean numbers
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(kind: str, rows: int, per_row: int, seed: int, zero_scale: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, per_row, nbytes), dtype=np.uint8)
    for off in _HALVES[kind]:
        vals = (rng.standard_normal((rows, per_row)) * 0.01).astype(np.float16)
        if zero_scale and off == 0:
            vals[:, 0] = 0  # a block with scale 0 (Q4_1/Q4_K: its codes do not matter, only the min)
        raw[..., off:off + 2] = vals.view(np.uint8).reshape(rows, per_row, 2)
    return raw.reshape(rows, per_row * nbytes)


def _reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).copy())


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(sorted(BLOCKS)), rows=st.integers(1, 4), per_row=st.integers(1, 3),
       seed=st.integers(0, 2**16), zero_scale=st.booleans())
def test_decode_matches_gguf_dequantize(kind, rows, per_row, seed, zero_scale):
    raw = _blocks(kind, rows, per_row, seed, zero_scale)
    ref = _reference(raw, kind)
    t = torch.from_numpy(raw)
    if kind in ("Q4_0", "Q4_1", "Q4_K"):
        codes, scales, zeros = decode_int4(t, kind)
        assert codes.dtype == torch.uint8 and 0 <= int(codes.min()) and int(codes.max()) <= 15
        assert scales.shape == zeros.shape == (rows, ref.shape[1] // 32)
        assert bool((scales != 0).all())  # the int4 layout recovers its zero points through the scales
        w = (codes.float().view(rows, -1, 32) - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)
    else:
        codes, scales, group = decode_int8(t, kind)
        assert codes.dtype == torch.int8 and group == (32 if kind == "Q8_0" else 16)
        w = codes.float().view(rows, -1, group) * scales.unsqueeze(-1)
    w = w.reshape(rows, -1)
    assert w.shape == ref.shape
    # fp32 arithmetic in another order: a few ulp of the block's largest term
    torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-12)
    torch.testing.assert_close(dequantize_blocks(t, kind, torch.float32), w, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"], ids=["q4_0", "q8_0"])
def test_blocks_from_gguf_quantize_round_trip_to_the_same_weights(kind):
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    ref = _reference(raw, kind)
    out = dequantize_blocks(torch.from_numpy(raw), kind, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


def test_partial_block_rows_are_refused():
    with pytest.raises(ValueError, match="whole number of 18-byte blocks"):
        decode_int4(torch.zeros(2, 20, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="not an int4 block type"):
        decode_int4(torch.zeros(1, 34, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="not an int8 block type"):
        decode_int8(torch.zeros(1, 18, dtype=torch.uint8), "Q4_0")


# -- the C++ transcoder into the a8 layouts: the decoded path's layers, bit for bit ----------------------------------
from infopt.quantize.community.gguf_blocks import a8_int4, a8_int8, q6_k_parts, q6_k_scales, q8_0_scales  # noqa: E402
from infopt.quantize.formats import a8  # noqa: E402

kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")

# scales a file may hold: ordinary, subnormal, negative, zero (one value per block), large
_SPECIAL = np.array([0.0, -0.0, 6e-8, -3e-5, 1.5, 65504.0, -2.0], np.float16)


def _file_blocks(kind: str, rows: int, per_row: int, seed: int, specials: bool) -> torch.Tensor:
    raw = _blocks(kind, rows, per_row, seed, zero_scale=True)
    if specials:
        view = raw.reshape(rows, per_row, BLOCKS[kind][1])
        rng = np.random.default_rng(seed + 1)
        for off in _HALVES[kind]:
            pick = rng.integers(0, len(_SPECIAL), (rows, per_row))
            keep = rng.random((rows, per_row)) < 0.3
            vals = np.where(keep, _SPECIAL[pick], view[..., off:off + 2].copy().view(np.float16)[..., 0])
            view[..., off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(rows, per_row, 2)
    return torch.from_numpy(raw)


def _perm(rows: int, seed: int, permute: bool) -> torch.Tensor | None:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed)) if permute else None


@kernel
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q4_K"]), blocks_of_rows=st.integers(1, 3), per_row=st.integers(1, 4),
       seed=st.integers(0, 2**16), specials=st.booleans(), permute=st.booleans())
def test_int4_transcoder_writes_the_decoded_layers_bits(kind, blocks_of_rows, per_row, seed, specials, permute):
    rows = 16 * blocks_of_rows
    raw = _file_blocks(kind, rows, per_row, seed, specials)
    perm = _perm(rows, seed, permute)
    codes, scales, zeros = decode_int4(raw, kind)
    if perm is not None:
        codes, scales, zeros = codes[perm], scales[perm], zeros[perm]
    want = a8.pack_blocked_int4(codes, scales, zeros)
    got = a8_int4(raw, kind, perm)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))  # bits: -0.0 and +0.0 differ


@kernel
@settings(max_examples=40, deadline=None)
@given(blocks_of_rows=st.integers(1, 3), per_row=st.integers(1, 4), seed=st.integers(0, 2**16),
       specials=st.booleans(), permute=st.booleans())
def test_q4_0_transcoder_keeps_the_files_scales_bit_for_bit(blocks_of_rows, per_row, seed, specials, permute):
    """Q4_0 into the symmetric a8 layout (``a8_sym``): the file's fp16 scales as they are (subnormal, negative, zero
    and negative zero included), the codes those of :func:`decode_q4_0`, the weights exactly the file's."""
    rows = 16 * blocks_of_rows
    raw = _file_blocks("Q4_0", rows, per_row, seed, specials)
    perm = _perm(rows, seed, permute)
    codes, scales = decode_q4_0(raw)
    if perm is not None:
        codes, scales = codes[perm], scales[perm]
    want = a8.pack_blocked_int4_sym(codes, scales)
    got = a8_int4(raw, "Q4_0", perm, symmetric=True)
    assert got[1].dtype == torch.float16 and got[1].shape == (rows // 16, per_row, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
    file_scales = raw.reshape(rows, per_row, 18)[..., :2].contiguous().view(torch.float16)[..., 0]
    file_scales = file_scales if perm is None else file_scales[perm]
    assert torch.equal(a8.scale_min_rows(got[1])[0].half().view(torch.int16), file_scales.view(torch.int16))
    w = (codes.float() - 8).reshape(rows, per_row, 32) * scales[..., None]
    ref = dequantize_blocks(raw, "Q4_0", torch.float32)
    ref = ref if perm is None else ref[perm]
    assert torch.equal(w.reshape(rows, -1), ref.float())


@kernel
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["Q8_0", "Q6_K"]), blocks_of_rows=st.integers(1, 3), per_row=st.integers(1, 6),
       seed=st.integers(0, 2**16), permute=st.booleans())
def test_int8_transcoder_writes_the_decoded_layers_bits(kind, blocks_of_rows, per_row, seed, permute):
    rows = 16 * blocks_of_rows
    raw = _file_blocks(kind, rows, per_row, seed, specials=kind == "Q6_K")
    perm = _perm(rows, seed, permute)
    codes, scales, _ = decode_int8(raw, kind)
    if perm is not None:
        codes = codes[perm]
    got = a8_int8(raw, perm, kind)
    assert got.dtype == torch.uint8 and torch.equal(got, a8.pack_blocked_int8(codes))
    # the scales read apart from the codes are decode_int8's (Q6_K's also from its two levels read once)
    reads = [q8_0_scales(raw)] if kind == "Q8_0" else [q6_k_scales(raw), q6_k_scales(raw, q6_k_parts(raw))]
    for read in reads:
        assert torch.equal(read.view(torch.int32), scales.view(torch.int32))


@kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q8_0", "Q6_K"])
def test_transcoders_write_the_same_bytes_on_one_thread_and_on_several(kind):
    """Enough blocks of rows (24) that torch's threads split them: the same bytes as one thread writes."""
    raw = _file_blocks(kind, 16 * 24, 2, seed=3, specials=True)
    perm = _perm(16 * 24, 3, True)

    def transcode():
        if kind in ("Q8_0", "Q6_K"):
            return [a8_int8(raw, perm, kind)]
        return [t.view(torch.uint8) for t in a8_int4(raw, kind, perm, two_level=kind == "Q4_K")]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = transcode()
        torch.set_num_threads(max(2, threads))
        several = transcode()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, several, strict=True))


@kernel
def test_transcoders_refuse_what_they_cannot_read():
    ops = torch.ops.infopt
    with pytest.raises(RuntimeError, match="rows divisible by 16"):
        ops.int4_a8_from_ggml(torch.zeros(8, 18, dtype=torch.uint8), 0, None)
    with pytest.raises(RuntimeError, match="whole number of 20-byte blocks"):
        ops.int4_a8_from_ggml(torch.zeros(16, 18, dtype=torch.uint8), 1, None)
    with pytest.raises(RuntimeError, match="kind must be 0"):
        ops.int4_a8_from_ggml(torch.zeros(16, 18, dtype=torch.uint8), 5, None)
    with pytest.raises(RuntimeError, match="whole number of 144-byte blocks"):
        ops.int4_a8_from_ggml(torch.zeros(16, 18, dtype=torch.uint8), 4, None)
    with pytest.raises(ValueError, match="symmetric=True takes Q4_0 blocks only, got Q4_1"):
        a8_int4(torch.zeros(16, 20, dtype=torch.uint8), "Q4_1", symmetric=True)
    with pytest.raises(ValueError, match="two_level=True takes Q4_K blocks only, got Q4_0"):
        a8_int4(torch.zeros(16, 18, dtype=torch.uint8), "Q4_0", two_level=True)
    with pytest.raises(RuntimeError, match="is not a row"):
        ops.int4_a8_from_ggml(torch.zeros(16, 18, dtype=torch.uint8), 0, torch.full((16,), 16))
    with pytest.raises(RuntimeError, match="perm must be"):
        ops.int8_a8_from_ggml(torch.zeros(16, 34, dtype=torch.uint8), torch.arange(8))
    with pytest.raises(RuntimeError, match="needs rows divisible by 16"):
        ops.int8_a8_from_ggml(torch.zeros(8, 34, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="kind must be 0 .Q8_0. or 1 .Q6_K., got 2"):
        ops.int8_a8_from_ggml(torch.zeros(16, 34, dtype=torch.uint8), None, 2)
    with pytest.raises(RuntimeError, match="whole number of 210-byte blocks"):
        ops.int8_a8_from_ggml(torch.zeros(16, 34, dtype=torch.uint8), None, 1)
    assert a8_int4(torch.zeros(16, 210, dtype=torch.uint8), "Q6_K") is None  # not a transcoded type


@kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_transcoders_fakes_give_their_outputs_shapes(kind):
    from torch._subclasses.fake_tensor import FakeTensorMode

    raw = torch.from_numpy(_file_blocks(kind, 32, 3, 0, specials=False).numpy())
    run = (lambda r: [torch.ops.infopt.int8_a8_from_ggml(r, None, {"Q8_0": 0, "Q6_K": 1}[kind])]) \
        if kind in ("Q8_0", "Q6_K") else (
        lambda r: torch.ops.infopt.int4_a8_from_ggml(r, {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2}[kind], None))
    real = run(raw)
    with FakeTensorMode() as mode:
        fake = run(mode.from_tensor(raw))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
