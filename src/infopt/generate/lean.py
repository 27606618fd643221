"""The greedy/sampling loop: one forward per token, preallocated output, no per-token logits-processor objects.

``transformers``' ``generate`` builds logits processors, stopping criteria and model-input dicts every
token; for a small model on a CPU that bookkeeping is a visible part of each token's time. This loop
does only what greedy decoding needs, with the same arithmetic as ``generate`` (positions from the
attention mask, the mask dropped when it has no padding, fp32 argmax of the last position's logits,
``min_new_tokens`` by masking EOS, finished rows padded), so its output is token-identical. Sampling
calls (temperature, top-k, top-p, min-p) use transformers' own warpers and ``torch.multinomial`` on the
global generator in ``generate``'s order, so a seeded call draws the same tokens. ``repetition_penalty`` and
``no_repeat_ngram_size`` run transformers' own processors (:meth:`GenerateCall.processors`), and ``stop_strings``
its own ``StopStringCriteria`` (a row that ends in one stops, as an EOS stops it), at the same points of the step.
With ``return_dict_in_generate`` it returns ``generate``'s ``GenerateDecoderOnlyOutput``: each step's processed
scores (``output_scores``) and fp32 logits (``output_logits``), and the call's cache.

On a GPU the loop never reads a value back per token: the cache slot is counted on the host, and whether every
row has stopped is read every :data:`EOS_CHECK_EVERY` tokens (each read waits for all queued kernels, so the host
could not queue the next token's step while the GPU runs this one). The steps run past the last EOS are cut from
the output, which stays the tokens ``generate`` returns.
"""

from __future__ import annotations

import torch

from .call import GenerateCall
from .forward import Forward, static_length

__all__ = ["lean_decode", "positions_of", "EOS_CHECK_EVERY"]

EOS_CHECK_EVERY = 8
"""Tokens between reads of "every row stopped" off a CPU (on a CPU, and with a streamer, every token)."""


def positions_of(call: GenerateCall) -> torch.Tensor:
    """``[B, T]`` position ids of the prompt: from the attention mask (left padding counts from each row's first
    real token, as ``generate`` does), else ``0 .. T-1``."""
    ids, mask = call.input_ids, call.attention_mask
    if mask is not None:
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    B, T = ids.shape
    return torch.arange(T, device=ids.device).unsqueeze(0).expand(B, T)


@torch.no_grad()  # not inference_mode: a cache allocated lazily here must stay writable by later calls (reset)
def lean_decode(call: GenerateCall, cache, forward: Forward, eos_check_every: int | None = None) -> torch.Tensor:
    """Greedy or sampled decoding of ``call`` on ``cache`` (empty; filled in place) through ``forward``.

    Args:
        eos_check_every: tokens between reads of "every row stopped"; None: 1 on a CPU or with a streamer,
            :data:`EOS_CHECK_EVERY` elsewhere.

    Returns:
        ``[B, T + n]`` token ids, ``n <= max_new_tokens`` (shorter when every row hit EOS), as ``generate``
        returns them; with ``return_dict_in_generate``, ``generate``'s ``GenerateDecoderOnlyOutput`` of them.

    Raises:
        Unsupported: what :meth:`GenerateCall.warpers`, :meth:`GenerateCall.processors` and
            :meth:`GenerateCall.stopping` refuse.
    """
    warpers = call.warpers()
    processors = call.processors(forward.model)
    stopping = call.stopping()
    ids = call.input_ids
    B, T = ids.shape
    N = call.max_new_tokens
    out = torch.empty(B, T + N, dtype=ids.dtype, device=ids.device)
    out[:, :T] = ids
    positions = positions_of(call)
    full_mask = None
    if call.padded:
        # a fixed width for a static cache (positions past the current token are causally masked anyway)
        width = static_length(cache) or (T + N)
        full_mask = torch.ones(B, max(width, T + N), dtype=call.attention_mask.dtype, device=ids.device)
        full_mask[:, :T] = call.attention_mask
    next_pos = positions[:, -1:] + 1  # [B, 1]
    cache_position = torch.tensor([T], device=ids.device)  # cache slot of the next decode token
    unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
    eos = call.eos_tensor()
    stops = eos is not None or stopping is not None  # rows can finish before max_new_tokens
    as_dict = "return_dict_in_generate" in call.outputs
    kept_scores = [] if as_dict and "output_scores" in call.outputs else None
    kept_logits = [] if as_dict and "output_logits" in call.outputs else None
    pad = call.pad_token_id
    streamer = call.streamer
    if streamer is not None:
        streamer.put(ids.cpu())
    every = eos_check_every or (1 if ids.device.type == "cpu" or streamer is not None else EOS_CHECK_EVERY)
    # steps after which some row was still going: once every row has stopped it stays so, and the output ends
    # at step live + 1 (counted on the device when the loop does not read it every token)
    live = torch.zeros((), dtype=torch.long, device=ids.device) if stops and every > 1 else None

    logits = forward.prefill(ids, positions, full_mask[:, :T] if full_mask is not None else None, cache)[:, -1]
    n = 0
    while True:
        scores = logits.to(dtype=torch.float32, copy=True)  # [B, V]; a copy: processors write in place
        if kept_logits is not None:
            kept_logits.append(scores.clone())
        if processors is not None:
            scores = processors(out[:, : T + n], scores)
        if eos is not None and n < call.min_new_tokens:
            scores[:, eos] = -float("inf")
        if warpers is None:
            tok = scores.argmax(dim=-1)  # [B]
        else:
            scores = warpers(out[:, : T + n], scores)
            tok = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if kept_scores is not None:
            kept_scores.append(scores)
        if eos is not None and pad is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
        out[:, T + n] = tok
        if streamer is not None:
            streamer.put(tok.cpu())
        n += 1
        if stops:
            if eos is not None:
                unfinished &= ~torch.isin(tok, eos)
            if stopping is not None:
                unfinished &= ~stopping(out[:, : T + n], scores)
            if live is None:
                if not bool(unfinished.any()):
                    break
            else:
                live += unfinished.any()
                if n % every == 0 and int(live) < n:
                    break
        if n == N:
            break
        logits = forward.step(tok[:, None], next_pos, cache_position, full_mask, cache, first=T + n - 1)[:, -1]
        cache_position = cache_position + 1
        next_pos = next_pos + 1
    if live is not None:
        n = min(n, int(live) + 1)  # the step at which every row had stopped
    if streamer is not None:
        streamer.end()
    if not as_dict:
        return out[:, : T + n]
    return _as_output(out[:, : T + n], kept_scores, kept_logits, n, cache)


def _as_output(sequences: torch.Tensor, scores: list | None, logits: list | None, n: int, cache):
    """``generate``'s ``GenerateDecoderOnlyOutput``, the steps' scores and logits cut to the ``n`` tokens returned;
    its cache field is ``cache`` in transformers 5.24 and ``past_key_values`` before."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=None if scores is None else tuple(scores[:n]),
                                     logits=None if logits is None else tuple(logits[:n]),
                                     attentions=None, hidden_states=None, **{name: cache})
