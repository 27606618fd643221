"""The default model: greedy speculative output equals plain generate, with fewer target forwards per token."""

import pytest
import torch

import infopt
from infopt.speculative import PromptLookup, SelfDraft


@pytest.mark.real_model
@pytest.mark.parametrize("cfg", [PromptLookup(num_tokens="adaptive"), SelfDraft(quantize="int4")],
                         ids=["lookup", "self-int4"])
def test_default_model_exact_and_fewer_forwards(default_model, cfg):
    model, tok = default_model
    msgs = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, "
                                        "then the lazy dog sleeps."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        infopt.optimize(model, [cfg])
        try:
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
            st = model.infopt.steps[-1].stats
        finally:
            infopt.undo(model)
    assert torch.equal(out, plain)
    assert st["target_forwards_per_token"] < 0.8 and st["acceptance_rate"] > 0.3
