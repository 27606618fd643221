"""model.infopt says what the optimized model holds and what the user waited for."""

import sys

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile.packed import packed_bytes
from infopt.generate import decoder_for
from infopt.models import tiny_model
from infopt.ops.packed_linear import can_pack
from infopt.optimize import resident_bytes

IDS = torch.tensor([[3, 17, 9, 41, 5]])


@pytest.mark.slow
def test_resident_counts_packed_copies_the_draft_and_the_kept_cache():
    m = infopt.optimize(tiny_model("llama"), "cpu-lossless")
    before = resident_bytes(m)
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*m.parameters(), *m.buffers())}.values())
    assert before["weights and buffers"] == weights
    if can_pack():
        packed = [x for x in m.modules() if "_infopt_packed" in x.__dict__]
        assert packed and before["prepacked linear copies"] == packed_bytes(packed)
    draft = decoder_for(m).speculative.drafter.draft
    own = {id(t): t for t in (*draft.parameters(), *draft.buffers())}
    shared = {id(t) for t in (*m.parameters(), *m.buffers())}
    # the draft's own tensors, once: what it shares with the target (the embedding) is the target's
    assert 0 < before["speculative draft model"] <= sum(t.untyped_storage().nbytes() for i, t in own.items()
                                                         if i not in shared)
    m.generate(IDS, max_new_tokens=4, do_sample=False)
    after = m.infopt.resident
    assert after["static KV cache (kept for the next call)"] > 0  # the cache kept for the next call
    text = str(m.infopt)
    total = sum(after.values()) / 2**20
    assert f"resident: {total:.1f} MiB" in text and "speculative draft model" in text


def test_a_quantized_model_reports_its_smaller_weights_and_nothing_else():
    m = infopt.optimize(tiny_model("llama"), [{"quantize": {"method": "int8"}}])
    assert list(m.infopt.resident) == ["weights and buffers"]
    assert m.infopt.resident["weights and buffers"] == m.infopt.memory_after < m.infopt.memory_before


def test_step_seconds_include_the_warm_up_the_user_waited_for():
    m = infopt.optimize(tiny_model("llama"), [{"kvcache": "static"},
                                              {"compile": {"warmup_lengths": [64], "pack_linears": False}}])
    step = next(s for s in m.infopt.steps if s.key == "compile")
    stats = compile_stats(m)
    assert stats.compiles >= 1 and step.seconds >= stats.seconds > 0
    if sys.platform.startswith("linux"):  # the process's memory around the apply, read from /proc
        assert m.infopt.rss_before > 0 and m.infopt.rss_after > 0
        assert "process memory (RSS) while applying" in str(m.infopt)


def test_the_gate_can_ask_for_the_originals_chat_answers(default_tokenizer):
    """min_answers: the share of the built-in chat questions answered token for token as the original does."""
    from infopt.core.errors import RecipeError
    from infopt.eval import gate_failures

    m = infopt.optimize(tiny_model("llama"), [{"kvcache": "static"}], gate={"min_answers": 1.0},
                        tokenizer=default_tokenizer)
    assert m.infopt.gate["answers"] == 1.0  # a lossless step keeps every answer of a tiny model
    assert "answers=1" in str(m.infopt)
    with pytest.raises(RecipeError, match=r"min_answers=75 is out of range.*Did you mean 0.75\?"):
        infopt.optimize(tiny_model("llama"), [{"kvcache": "static"}], gate={"min_answers": 75})
    figures = {"kl": 0.0, "top1": 1.0, "ppl": 1.0, "ppl_ref": 1.0, "answers": 0.625}
    assert gate_failures(figures, {"min_answers": 0.75}) == ["chat answers identical 0.625 < min_answers 0.75"]
    assert gate_failures(figures, {"min_answers": 0.5}) == []
