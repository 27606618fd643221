"""The ``batching`` recipe step: ``model.generate`` on padded batches (and pipelines) served by the engine."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..core.decode import call_generation_config, call_input_ids, nondefault_fields
from ..core.generation import Unsupported, route_generate
from ..core.introspect import ModelInfo
from ..core.patch import record_custom
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..kvcache.paged import Paged, left_padding
from .engine import Engine
from .params import SamplingParams

__all__ = ["Batching", "enable_", "batching_engine"]

# generate() keywords the engine path understands; any other goes to the original generate
_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "max_length", "do_sample", "temperature",
           "top_k", "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "generation_config",
           "stop_strings", "tokenizer", "num_beams", "num_return_sequences", "min_length"}
_SAMPLING_FIELDS = ("do_sample", "stop_strings")


def _pos(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@register_step
@dataclass(frozen=True)
class Batching(StepConfig):
    """Serve ``model.generate`` through a continuous-batching engine (:class:`~infopt.batching.Engine`).

    A padded batch is split into its rows, which decode as independent requests: a row that ends
    early frees its slot instead of decoding padding, and concurrent ``generate`` calls from several
    threads share the engine's steps. Greedy output is token-identical to plain ``generate``.

    Args:
        max_seqs: requests decoding at once at most.
        max_batch_tokens: tokens per forward at most (decode tokens plus prefill chunks).
        chunked_prefill: split long prompts across steps, interleaved with decoding.
        block_size, num_blocks, prefix_caching: the engine's paged KV cache (``num_blocks`` None:
            a 1 GiB pool); a ``kvcache: {kind: paged}`` step in the same recipe supplies them instead.

    Raises:
        RecipeError: a non-positive size or a non-bool flag.

    Example:
        >>> Batching(max_seqs=32).to_dict()['batching']['max_seqs']
        32
    """

    stage: ClassVar[str] = "batching"
    lossless: ClassVar[bool] = True
    max_seqs: int = 64
    max_batch_tokens: int = 512
    chunked_prefill: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    prefix_caching: bool = True

    def __post_init__(self):
        for name in ("max_seqs", "max_batch_tokens", "block_size"):
            if not _pos(getattr(self, name)):
                raise bad_field(self, name, getattr(self, name), "a positive integer")
        if self.num_blocks is not None and not _pos(self.num_blocks):
            raise bad_field(self, "num_blocks", self.num_blocks, "a positive integer, or null for a 1 GiB pool")
        for name in ("chunked_prefill", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise bad_field(self, name, getattr(self, name), "true or false")

    def paged(self) -> Paged:
        return Paged(block_size=self.block_size, num_blocks=self.num_blocks, prefix_caching=self.prefix_caching)

    def check(self, model: nn.Module, info: ModelInfo, steps) -> list[str]:
        kv = next((s for s in steps if isinstance(s, Paged)), None) or self.paged()
        kv.check(model, info, (kv,))
        return []


_ENGINES: weakref.WeakKeyDictionary[nn.Module, Engine] = weakref.WeakKeyDictionary()


def batching_engine(model: nn.Module) -> Engine | None:
    """The :class:`Engine` serving ``model.generate`` after :func:`enable_`, or None."""
    return _ENGINES.get(model)


class _EngineGenerate:
    def __init__(self, model: nn.Module, engine: Engine):
        self.model = model
        self.engine = engine

    def __call__(self, original, *args, **kwargs):
        input_ids = call_input_ids(args, kwargs, _KWARGS)
        if kwargs.get("use_cache") is False:
            raise Unsupported("use_cache=False")
        gc = call_generation_config(self.model, kwargs)
        bad = nondefault_fields(gc, allow=_SAMPLING_FIELDS)
        if bad:
            raise Unsupported(bad[0])
        if getattr(gc, "use_cache", True) is False:
            raise Unsupported("use_cache=False")
        ids = input_ids.detach().cpu()
        rows = [ids[b, p:].tolist() for b, p in enumerate(left_padding(self.model, input_ids, kwargs, gc))]
        width = input_ids.shape[1]
        new = int(gc.max_new_tokens) if gc.max_new_tokens is not None else \
            int(gc.max_length if gc.max_length is not None else 20) - width
        if new <= 0:
            raise Unsupported("no new tokens requested")
        eos = gc.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos.tolist() if torch.is_tensor(eos) else (eos or []))
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
        stop = gc.stop_strings or ()
        if stop and self.engine.tokenizer is None:
            raise Unsupported("stop_strings without a tokenizer given to the batching step")
        sample = bool(gc.do_sample)
        params = SamplingParams(
            max_new_tokens=new, min_new_tokens=min(int(gc.min_new_tokens or 0), new),
            temperature=float(gc.temperature if gc.temperature is not None else 1.0) if sample else 0.0,
            top_k=int(gc.top_k or 0) if sample else 0, top_p=float(gc.top_p or 1.0) if sample else 1.0,
            stop=(stop,) if isinstance(stop, str) else tuple(stop), eos_token_ids=tuple(eos),
        )
        if len(rows) > 1 and pad is None:
            raise Unsupported("a batch without pad_token_id or eos_token_id to pad finished rows")
        try:
            handles = [self.engine.submit(r, params) for r in rows]
        except ValueError as e:
            raise Unsupported(str(e)) from None
        outs = [h.result() for h in handles]
        bad_out = next((o for o in outs if o.finish_reason == "error"), None)
        if bad_out is not None:
            raise RuntimeError(f"the batching engine failed a generate row: {bad_out.error}")
        n = max(len(o.token_ids) for o in outs)
        gen = torch.full((len(rows), n), pad if pad is not None else 0, dtype=input_ids.dtype)
        for b, o in enumerate(outs):
            gen[b, :len(o.token_ids)] = torch.tensor(o.token_ids, dtype=input_ids.dtype)
        return torch.cat([input_ids, gen.to(input_ids.device)], dim=1)


def enable_(model: nn.Module, config: Batching | None = None, *, tokenizer=None, kv: Paged | None = None,
            step: str | None = None) -> Engine:
    """Route ``model.generate`` (and ``pipeline(..., batch_size=N)``) through a continuous-batching engine, in place.

    Each row of a (left-)padded batch becomes one request; the output is laid out as ``generate``'s
    (prompt columns as given, then generated tokens, finished rows padded). Calls the engine does not
    serve (beam search, streamers, logits processors, right padding, ...) go to the original
    ``generate``; :func:`infopt.core.generation.routing_stats` counts them. :func:`infopt.undo` removes it.

    Args:
        model: a transformers causal LM with full causal attention.
        config: :class:`Batching` settings (default ``Batching()``).
        tokenizer: for ``stop_strings`` (optional).
        kv: paged cache settings overriding the config's (a recipe's ``kvcache: paged`` step).

    Returns:
        The :class:`Engine` (also :func:`batching_engine`), for direct ``submit``/``stream`` use.

    Raises:
        IncompatibleModelError: a model the paged cache cannot serve.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> _ = enable_(m, Batching(num_blocks=64))
        >>> m.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([2, 7])
    """
    config = config or Batching()
    key = step or config.key
    engine = Engine(model, tokenizer, max_batch_tokens=config.max_batch_tokens, max_seqs=config.max_seqs,
                    kv=kv or config.paged(), chunked_prefill=config.chunked_prefill)
    route_generate(model, _EngineGenerate(model, engine), step=key)
    _ENGINES[model] = engine

    def close():
        _ENGINES.pop(model, None)
        engine.stop(cancel=True)
        engine.cache.release_all()

    record_custom(model, "batching engine", close, step=key)
    return engine


@register_transform(Batching)
def _apply(model: nn.Module, config: Batching, ctx: ApplyContext) -> None:
    kv = next((s for s in ctx.steps if isinstance(s, Paged)), None)
    engine = enable_(model, config, tokenizer=ctx.tokenizer, kv=kv)
    ctx.notes.append(
        f"continuous batching: up to {config.max_seqs} sequences and {config.max_batch_tokens} tokens per step, "
        f"{engine.cache.allocator.num_blocks} KV blocks of {engine.cache.block_size} tokens, chunked prefill "
        f"{'on' if config.chunked_prefill else 'off'}"
    )
