"""Speculative decoding three ways (prompt lookup, an int4 self-draft, a separate draft model): same greedy
output as plain generate, fewer target forwards per token; the report shows acceptance and the draft's memory.

Run: python examples/speculative_decoding.py [--tiny]
(--tiny uses small random models so it runs in seconds; the default is the embedded SmolLM2-135M.)
"""

import argparse

import torch

import infopt
from infopt.models import load_default, load_default_tokenizer, tiny_model
from infopt.speculative import DraftModel, PromptLookup, SelfDraft

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
args = parser.parse_args()

if args.tiny:
    model, tok = tiny_model("llama", num_layers=4), load_default_tokenizer()
    draft = tiny_model("llama", num_layers=1, seed=1)
else:
    model, tok = load_default()
    draft = None  # a separate draft needs a smaller model with the same tokenizer; none is embedded

text = ("Repeat the following text exactly:\n\nThe with statement is used to wrap the execution of a block "
        "with methods defined by a context manager. This allows common try/except/finally usage patterns "
        "to be encapsulated for convenient reuse.")
msgs = [{"role": "user", "content": text}]
prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
plain = model.generate(prompt, max_new_tokens=40, do_sample=False)

drafters = [PromptLookup(num_tokens="adaptive"), SelfDraft(quantize="int4", num_tokens="adaptive")]
if draft is not None:
    drafters.append(DraftModel(draft, num_tokens=3))
for cfg in drafters:
    infopt.optimize(model, [cfg])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, plain), f"{cfg.kind}: greedy output must match plain generate"
    st = model.infopt.steps[-1].stats
    print(model.infopt)
    print(f"{cfg.kind}: identical to plain greedy; acceptance {st['acceptance_rate']:.2f}, "
          f"{st['mean_accepted_length']:.2f} drafted tokens kept per round, "
          f"{st['target_forwards_per_token']:.2f} target forwards per token")
    # sampling: the rejection rule keeps the target's distribution
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.95)
    print("sampled:", tok.decode(sampled[0, prompt.shape[1]:], skip_special_tokens=True)[:80])
    infopt.undo(model)

print("output:", tok.decode(plain[0, prompt.shape[1]:], skip_special_tokens=True)[:120])
