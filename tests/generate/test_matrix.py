"""Stacked steps add up: every pair and triple of decoding-relevant steps the rules allow, on two architectures.

For each stack: greedy output equals plain ``generate`` of the model with only the stack's lossy steps applied
(so lossless stacks are token-identical to the untouched model), ``routing_stats`` counts exactly one served call
per user call, and ``undo`` restores the model bit-exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import infopt
from infopt.attention import Attention
from infopt.batching import Batching
from infopt.compile import Compile
from infopt.core.errors import RecipeError
from infopt.generate import routing_stats
from infopt.kvcache import Paged, Quantized, Sinks, Static
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.recipe import check_rules
from infopt.speculative import PromptLookup, SelfDraft

# one candidate per name; stacks take at most one step per stage
CANDIDATES = {
    "eager": Attention("eager"),
    "int8": Int8WeightOnly(),
    "int4": Int4WeightOnly(group_size=32),
    "static": Static(max_length=128),
    "kv-int8": Quantized(bits=8, group_size=16, residual_length=16),
    "paged": Paged(block_size=8),
    "sinks": Sinks(window=96, num_sink_tokens=4),  # the window holds every token of these calls: no eviction
    "compile": Compile(backend="eager"),
    "lookup": PromptLookup(num_tokens=3),
    "self-draft": SelfDraft(quantize="int8", num_tokens=3),
    "batching": Batching(num_blocks=64, block_size=8),
}
LOSSY = {"int8", "int4", "kv-int8"}  # output compared with the lossy steps alone
DECODING = {"kvcache", "compile", "speculative", "batching"}  # stages that serve generate calls


def _allowed(names) -> bool:
    steps = [CANDIDATES[n] for n in names]
    if len({s.stage for s in steps}) < len(steps):
        return False
    try:
        check_rules(steps)
    except RecipeError:
        return False
    return True


STACKS = [names for r in (2, 3) for names in itertools.combinations(CANDIDATES, r) if _allowed(names)]


def _prompts():
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 900, (1, 9), generator=g)
    return [base, torch.cat([base, base[:, :6]], dim=1)]  # the second repeats itself: prompt lookup drafts


def test_the_matrix_covers_the_compositions_the_structure_used_to_forbid():
    keys = {frozenset(s) for s in STACKS}
    assert {"static", "compile", "lookup"} in keys and {"static", "compile", "self-draft"} in keys
    assert {"int8", "self-draft"} in keys and {"int4", "static", "compile"} in keys and {"int4", "batching"} in keys
    assert len(STACKS) >= 40, len(STACKS)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("names", STACKS, ids=["+".join(s) for s in STACKS])
def test_stack_matches_its_lossy_steps_alone_counts_once_and_undoes(arch, names):
    m = tiny_model(arch)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ref = tiny_model(arch)
    lossy = [CANDIDATES[n] for n in names if n in LOSSY]
    if lossy:
        infopt.optimize(ref, lossy)
    infopt.optimize(m, [CANDIDATES[n] for n in names])
    prompts = _prompts()
    for p in prompts:
        kw = dict(max_new_tokens=16, do_sample=False)
        assert torch.equal(m.generate(p, **kw), ref.generate(p, **kw)), names
    stats = routing_stats(m)
    served = len(prompts) if any(CANDIDATES[n].stage in DECODING for n in names) else 0
    assert (stats.infopt, stats.original) == (served, 0), stats.as_dict()
    assert sum(stats.loops.values()) == served
    infopt.undo(m)
    assert "generate" not in m.__dict__ and routing_stats(m).infopt == 0
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
