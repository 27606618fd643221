"""The real-model tier on infopt's own pytest plugin (infopt.testing): goldens in tests/golden/.

Re-record after an intended change with ``pytest tests/test_real_model_golden.py --infopt-update-golden``.
"""

import copy

import pytest

import infopt
from infopt.eval import default_text
from infopt.testing import assert_generates_same, assert_quality

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What does a Python list store?"]


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"][0] for q in QUESTIONS]


@pytest.mark.real_model
@pytest.mark.parametrize("recipe", ["cpu-lossless"])
def test_lossless_preset_reproduces_the_recorded_answers(default_model, infopt_golden, recipe):
    model, tok = default_model
    reference = copy.deepcopy(model) if infopt_golden.update else None  # record from the plain model
    infopt.optimize(model, recipe)
    try:
        assert_generates_same(model, tok, _prompts(tok), infopt_golden, max_new_tokens=16, reference=reference)
    finally:
        infopt.undo(model)


@pytest.mark.real_model
@pytest.mark.parametrize("recipe", ["cpu-fast"])
def test_lossy_preset_stays_within_its_gate(default_model, infopt_golden, recipe):
    model, tok = default_model
    reference = copy.deepcopy(model) if infopt_golden.update else None
    infopt.optimize(model, recipe)
    try:
        # measured on this machine: KL ~0.003, top-1 ~0.97 (the gate leaves room for other CPUs)
        assert_quality(model, infopt_golden, text=default_text(), tokenizer=tok, max_tokens=256,
                       max_kl=0.02, min_top1=0.9, reference=reference)
    finally:
        infopt.undo(model)
