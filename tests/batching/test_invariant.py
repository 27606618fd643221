"""Batch-invariant engine steps (``Engine(batch_invariant=True)``): a request's logits are the same bits alone, beside
63 other requests and when preempted and recomputed; the settings it cannot serve are refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import infopt
from infopt.batching import Batching, Engine, SamplingParams, batching_engine
from infopt.batching.invariant import ROWS, InvariantForward, invariant_linear, invariant_steps
from infopt.core.errors import RecipeError
from infopt.kvcache import Paged
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_


def _served_logits(model, prompts: list[list[int]], num_blocks: int, new_tokens: int, preempt: int | None = None,
                   preempt_after: tuple[int, ...] = ()):
    """Each request's logits at each of its steps (copies of the rows the engine chose its tokens from) and its
    outputs, every request queued before the first step; request ``preempt`` is preempted (its KV dropped, to be
    recomputed) once it has each of ``preempt_after`` tokens."""
    engine = Engine(model, max_batch_tokens=256, max_seqs=64, batch_invariant=True,
                    kv=Paged(num_blocks=num_blocks, prefix_caching=False))
    seen: dict[int, list[torch.Tensor]] = {}
    update = engine.core._update

    def record(plan, due_rows, logits, t0, events):
        for i, row in enumerate(due_rows):
            seen.setdefault(plan[row][0].rid, []).append(logits[i].clone())
        return update(plan, due_rows, logits, t0, events)

    engine.core._update = record
    handles = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    pending = list(preempt_after)
    while pending and not handles[preempt].done():
        engine.step()
        seq = next((s for s in engine.scheduler.running if s.rid == handles[preempt].request_id), None)
        if seq is not None and len(seq.output) >= pending[0]:
            engine.scheduler.preempt(seq)
            pending.pop(0)
    outs = [h.result() for h in handles]
    infopt.undo(model)
    return [seen[h.request_id] for h in handles], outs


def _requests(vocab: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    # 300 prompt tokens: alone, the attention kernel would split its keys over the threads (few items to share),
    # beside 63 others it would not
    target = torch.randint(3, vocab, (300,), generator=g).tolist()
    others = [torch.randint(3, vocab, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()
              for _ in range(63)]
    return target, others


def _invariance(model):
    vocab = model.config.vocab_size
    target, others = _requests(vocab)
    alone, alone_out = _served_logits(model, [target], 512, 8)
    batch, batch_out = _served_logits(model, [target, *others], 2048, 8)
    # preempted twice beside 20 others (after its 3rd and 6th tokens): its prompt and tokens are recomputed, in other
    # prefill chunks than the first time
    again, again_out = _served_logits(model, [*others[:10], target, *others[10:20]], 2048, 8, preempt=10,
                                      preempt_after=(3, 6))
    assert again_out[10].metrics.preemptions == 2
    for step, (a, b, c) in enumerate(zip(alone[0], batch[0], again[10], strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ beside 63 other requests"
        assert torch.equal(a, c), f"step {step}: logits differ after preemption"
    assert alone_out[0].token_ids == batch_out[0].token_ids == again_out[10].token_ids


def test_request_logits_bit_identical_alone_in_a_batch_and_preempted_tiny():
    _invariance(tiny_model(dtype=torch.float32).eval())


@pytest.mark.slow
@pytest.mark.real_model
def test_request_logits_bit_identical_alone_in_a_batch_and_preempted_default_model():
    from infopt.models import load_default

    model, _ = load_default(dtype=torch.float32)
    _invariance(model.eval())


@pytest.mark.parametrize("rows", [1, 2, 3, ROWS - 1, ROWS, ROWS + 1, 3 * ROWS + 5])
def test_invariant_linear_row_is_the_same_whatever_shares_the_call(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 80), torch.randn(96)
    x = torch.randn(rows, 80)
    alone = invariant_linear(x[-1:], w, b)
    together = invariant_linear(x, w, b)
    assert torch.equal(together[-1:], alone)
    # the same product as F.linear up to rounding
    torch.testing.assert_close(together, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_invariant_steps_route_linear_and_addmm_through_fixed_row_blocks():
    torch.manual_seed(1)
    w, b, x = torch.randn(48, 64), torch.randn(48), torch.randn(7, 64)
    with invariant_steps():
        lin = F.linear(x, w, b)
        lin_one = F.linear(x[3:4], w, b)
        mm = torch.addmm(b, x, w.t())  # transformers' Conv1D form
        mm_one = torch.addmm(b, x[3:4], w.t())
    assert torch.equal(lin[3:4], lin_one) and torch.equal(mm[3:4], mm_one)
    torch.testing.assert_close(lin, F.linear(x, w, b))
    # outside the context F.linear is torch's own again
    assert torch.equal(F.linear(x[3:4], w, b), torch.ops.aten.linear(x[3:4], w, b))


def test_engine_refuses_what_it_cannot_make_invariant_and_leaves_the_model_alone():
    model = tiny_model(dtype=torch.float32)
    backend = model.config._attn_implementation
    with pytest.raises(ValueError, match="batch_invariant=True runs its steps eagerly"):
        Engine(model, batch_invariant=True, compile=True, kv=Paged(num_blocks=16))
    with pytest.raises(ValueError, match="prepack=None or False"):
        Engine(model, batch_invariant=True, prepack=True, kv=Paged(num_blocks=16))
    with pytest.raises(ValueError, match="batch_invariant='yes' is invalid"):
        Engine(model, batch_invariant="yes", kv=Paged(num_blocks=16))
    for config, layer in ((Int8WeightOnly(), "Int8Linear"), (Int4WeightOnly(group_size=32), "Int4Linear")):
        quantized = quantize_(tiny_model(dtype=torch.float32), config)
        with pytest.raises(ValueError, match=f"this model has {layer} layers"):
            Engine(quantized, batch_invariant=True, kv=Paged(num_blocks=16))
        assert quantized.config._attn_implementation == backend
    assert model.config._attn_implementation == backend


def test_batching_step_batch_invariant_serves_eagerly_and_validates():
    with pytest.raises(RecipeError, match="batch-invariant steps run eagerly"):
        infopt.Recipe.parse([{"compile": {}}, {"batching": {"batch_invariant": True}}])
    with pytest.raises(RecipeError, match="batch_invariant"):
        Batching(batch_invariant=1)
    model = tiny_model(dtype=torch.float32)
    infopt.optimize(model, [Batching(batch_invariant=True, num_blocks=64)])
    engine = batching_engine(model)
    assert engine.batch_invariant and not engine.core.forward.compiled and engine.prepacked == 0
    assert isinstance(engine.core.forward, InvariantForward)
    out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
    infopt.undo(model)
    plain = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain)


def test_engine_steps_multiply_in_fixed_row_blocks_and_keep_one_key_order():
    """What the mode does, seen at the operator level (the same on any CPU, whatever its BLAS does with row
    counts): every matrix product of a step has :data:`ROWS` rows, and the attention kernel never splits keys."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows, splits = [], []
    aten = torch.ops.aten

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten.linear.default:
                rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            elif func in (aten.mm.default, aten.addmm.default):
                rows.append(args[-2].shape[0])
            elif func is torch.ops.infopt.paged_attention.default:
                splits.append(kwargs.get("split_keys", args[8] if len(args) > 8 else True))
            return func(*args, **kwargs)

    model = tiny_model(dtype=torch.float32)
    engine = Engine(model, max_batch_tokens=64, max_seqs=8, batch_invariant=True, kv=Paged(num_blocks=64))
    handles = [engine.submit(list(range(3, 3 + n)), SamplingParams(max_new_tokens=3, ignore_eos=True))
               for n in (5, 37, 90)]
    with Log():
        for h in handles:
            h.result()
    infopt.undo(model)
    assert len(rows) > 20 and set(rows) == {ROWS}
    assert splits and not any(splits)
