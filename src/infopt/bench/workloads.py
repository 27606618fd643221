"""Seeded, deterministic benchmark workloads: lists of (prompt ids, output length) requests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

__all__ = ["Request", "WORKLOADS", "make_workload"]

WORKLOADS: dict[str, str] = {
    "decode": "batch 1, one 32-token prompt, 128 new tokens, greedy",
    "batch": "64 chat requests, prompt lengths 16-512 (median 64) and output lengths 16-256 (median 24), "
             "seeded long-tailed (log-normal, clipped)",
    "throughput": "64 chat requests arriving at once, chat-templated prompts of 53-512 tokens and 16-256 new tokens "
                  "(seeded uniform draws: 16,002 prompt and 9,094 output tokens at seed 0), EOS ignored: an engine's "
                  "sustained throughput",
    "grounded": "8 edit/summarize prompts whose answers copy from the input (for speculative decoding)",
    "prefix": "a ~1,000-token shared system prompt, then 8 short questions",
    "long": "long-context decode: a 2,048-token prompt, 64 new tokens (KV-cache memory)",
    "prompt512": "time to first token: one 512-token prompt, 16 new tokens",
}


THROUGHPUT_DRAW = 8


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        input_ids: ``[1, prompt_len]`` token ids.
        max_new_tokens: exact output length (end-of-sequence is ignored so the work is fixed).
    """

    input_ids: torch.Tensor
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


def _corpus_ids(tokenizer, n_tokens: int) -> list[int]:
    from ..eval import default_text

    ids = tokenizer(default_text(max_chars=max(60_000, n_tokens * 6)), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"the benchmark text has {len(ids)} tokens, fewer than the {n_tokens} needed")
    return ids


def _chat(tokenizer, user: str, system: str | None = None) -> torch.Tensor:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    text = (system + "\n\n" if system else "") + user
    return tokenizer(text, return_tensors="pt")["input_ids"]


def _long_tailed(rng: random.Random, median: int, lo: int, hi: int, sigma: float = 0.8) -> int:
    """A log-normal draw around ``median``, clipped to ``[lo, hi]``: most requests short, a few long,
    as in chat traffic."""
    return int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))


def make_workload(name: str, tokenizer, *, seed: int = 0, num_requests: int | None = None) -> list[Request]:
    """Build a workload's requests.

    Args:
        name: one of :data:`WORKLOADS`.
        tokenizer: the model's tokenizer.
        seed: the same seed gives the same requests.
        num_requests: override the workload's request count (for quick runs).

    Returns:
        A list of :class:`Request`.

    Raises:
        ValueError: unknown workload.

    Example:
        >>> from infopt.models import load_default_tokenizer  # doctest: +SKIP
        >>> make_workload("decode", load_default_tokenizer())[0].prompt_len  # doctest: +SKIP
        32
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r}; allowed: {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    if name == "decode":
        ids = _corpus_ids(tokenizer, 4000)
        start = rng.randrange(0, len(ids) - 32)
        reqs = [Request(torch.tensor([ids[start:start + 32]]), 128)]
    elif name == "long":
        ids = _corpus_ids(tokenizer, 2048 + 10)
        reqs = [Request(torch.tensor([ids[:2048]]), 64)]
    elif name == "prompt512":
        ids = _corpus_ids(tokenizer, 6000)
        start = rng.randrange(0, len(ids) - 512)
        reqs = [Request(torch.tensor([ids[start:start + 512]]), 16)]
    elif name == "batch":
        n = num_requests or 64
        ids = _corpus_ids(tokenizer, 20_000)
        reqs = []
        for _ in range(n):
            plen = _long_tailed(rng, 64, 16, 512)
            start = rng.randrange(0, len(ids) - plen)
            text = tokenizer.decode(ids[start:start + plen])
            prompt = _chat(tokenizer, "Explain this passage briefly:\n" + text)
            reqs.append(Request(prompt, _long_tailed(rng, 24, 16, 256)))
        return reqs
    elif name == "throughput":
        # draw 8 of this generator gives 16,002 prompt and 9,094 output tokens: the prompt/output ratio (1.76) of
        # the reference measurement of a CPU serving engine this workload compares with (16,799 / 9,538)
        rng = random.Random(seed + THROUGHPUT_DRAW)
        n = num_requests or 64
        ids = _corpus_ids(tokenizer, 20_000)
        ask = "Explain this passage briefly:\n"
        overhead = int(_chat(tokenizer, ask).shape[1])  # the template and the instruction around the passage
        reqs = []
        for _ in range(n):
            target = rng.randint(overhead + 16, 512)
            start = rng.randrange(0, len(ids) - target)
            take = target - overhead
            prompt = _chat(tokenizer, ask + tokenizer.decode(ids[start:start + take]))
            while prompt.shape[1] > target:  # re-tokenizing the passage can merge or split a few tokens
                take -= prompt.shape[1] - target
                prompt = _chat(tokenizer, ask + tokenizer.decode(ids[start:start + take]))
            reqs.append(Request(prompt, rng.randint(16, 256)))
        return reqs
    elif name == "grounded":
        from ..eval import default_text

        paras = [p for p in default_text().split("\n\n") if 300 < len(p) < 900]
        rng.shuffle(paras)
        asks = ["Repeat the following text exactly, fixing any typos:\n\n",
                "Rewrite the following paragraph in plain English, keeping its wording where you can:\n\n",
                "Summarize the following text, quoting its key sentence:\n\n"]
        reqs = [Request(_chat(tokenizer, asks[i % len(asks)] + paras[i]), 96) for i in range(num_requests or 8)]
    elif name == "prefix":
        from ..eval import default_text

        system_ids = tokenizer(default_text(), add_special_tokens=False)["input_ids"][:1000]
        system = "You answer questions about Python. Reference:\n" + tokenizer.decode(system_ids)
        qs = ["What does the with statement do?", "How do I define a class?", "What is a generator?",
              "Explain try/except.", "What does lambda create?", "How do imports work?",
              "What is a decorator?", "What are f-strings?"]
        reqs = [Request(_chat(tokenizer, qs[i % len(qs)], system=system), 32) for i in range(num_requests or 8)]
    if num_requests is not None and name in ("decode", "long", "prompt512"):
        reqs = (reqs * num_requests)[:num_requests]
    return reqs
