"""The ``batching`` recipe step: ``model.generate`` on padded batches (and pipelines) served by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.introspect import ModelInfo
from ..core.patch import ModelSlot, record_custom
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import LoopPart, Unsupported, set_part, tensors_bytes
from ..kvcache.paged import Paged
from .engine import Engine
from .params import SamplingParams

__all__ = ["Batching", "enable_", "batching_engine"]

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
        batch_invariant: each request's logits are the same bits whatever shares its steps, so a served request
            reproduces exactly run to run (``Engine(batch_invariant=True)``: eager steps, CPU, float layers; it
            costs throughput).
        cuda_graphs: decode steps replayed as CUDA graphs per batch-size bucket (``Engine(cuda_graphs=...)``):
            ``"auto"`` (on for a CUDA model), ``true`` (a CUDA model required) or ``false``.

    A ``compile`` step in the same recipe compiles the engine's steps (``Engine(compile=...)`` with its settings):
    their two graphs are compiled while the recipe is applied (a minute or so for a small model on a small CPU).

    Raises:
        RecipeError: a non-positive size or a non-bool flag.

    Example:
        >>> Batching(max_seqs=32).to_dict()['batching']['max_seqs']
        32
    """

    stage: ClassVar[str] = "batching"
    fidelity: ClassVar[str] = "lossless"  # rows share batched kernels; batch_invariant pins each row's order
    max_seqs: int = 64
    max_batch_tokens: int = 512
    chunked_prefill: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    prefix_caching: bool = True
    batch_invariant: bool = False
    cuda_graphs: bool | str = "auto"
    removed: ClassVar[dict[str, str]] = {
        "compile": "the compile stage decides: add a compile step to the recipe (e.g. {'compile': {}}) to compile "
                   "the engine's steps, as the throughput preset does"}

    def __post_init__(self):
        for name in ("max_seqs", "max_batch_tokens", "block_size"):
            if not _pos(getattr(self, name)):
                raise bad_field(self, name, getattr(self, name), "a positive integer")
        if self.num_blocks is not None and not _pos(self.num_blocks):
            raise bad_field(self, "num_blocks", self.num_blocks, "a positive integer, or null for a 1 GiB pool")
        for name in ("chunked_prefill", "prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise bad_field(self, name, getattr(self, name), "true or false")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise bad_field(self, "cuda_graphs", self.cuda_graphs, "auto, true or false")

    def paged(self) -> Paged:
        return Paged(block_size=self.block_size, num_blocks=self.num_blocks, prefix_caching=self.prefix_caching)

    def check(self, model: nn.Module, info: ModelInfo, steps) -> list[str]:
        kv = next((s for s in steps if isinstance(s, Paged)), None) or self.paged()
        kv.check(model, info, (kv,))
        if self.cuda_graphs is True and info.device.type != "cuda":
            raise IncompatibleModelError(f"batching cuda_graphs: true needs a model on a CUDA device; this one is on "
                                         f"{info.device}. Use cuda_graphs: auto (graphs on CUDA only)")
        return []


_ENGINES = ModelSlot("engine")


def batching_engine(model: nn.Module) -> Engine | None:
    """The :class:`Engine` serving ``model.generate`` after :func:`enable_`, or None."""
    return _ENGINES.get(model)


class EnginePart(LoopPart):
    """The batching engine as a part of the model's decoder: each row of a call becomes one request."""

    def __init__(self, engine: Engine, key: str):
        self.engine, self.key = engine, key

    def resident(self, seen: set) -> dict[str, int]:
        pool = getattr(self.engine.cache, "pool", None)
        n = tensors_bytes([*getattr(pool, "keys", ()), *getattr(pool, "values", ())], seen)
        return {"batching engine KV pool": n} if n else {}

    def serve(self, call, decoder) -> torch.Tensor:
        if call.lean_reason is not None:
            raise Unsupported(call.lean_reason)
        if call.streamer is not None:
            raise Unsupported("a streamer (the engine streams through Engine.stream)")
        if call.left_pads is None:
            raise Unsupported("attention_mask is not left padding (or pad tokens without an attention_mask)")
        if call.min_p is not None:
            raise Unsupported(f"min_p={call.min_p}")
        if call.penalties:
            raise Unsupported(call.penalties[0])
        if call.outputs:
            raise Unsupported(f"{min(call.outputs)}=True (the engine returns tokens)")  # output_logits/_scores first
        if call.stop_strings and self.engine.tokenizer is None:
            raise Unsupported("stop_strings without a tokenizer given to the batching step")
        input_ids = call.input_ids
        ids = input_ids.detach().cpu()
        rows = [ids[b, p:].tolist() for b, p in enumerate(call.left_pads)]
        pad = call.pad_token_id
        if len(rows) > 1 and pad is None:
            raise Unsupported("a batch without pad_token_id or eos_token_id to pad finished rows")
        sample = call.do_sample
        params = SamplingParams(
            max_new_tokens=call.max_new_tokens, min_new_tokens=call.min_new_tokens,
            temperature=call.temperature if sample else 0.0, top_k=(call.top_k or 0) if sample else 0,
            top_p=call.top_p if sample else 1.0, stop=call.stop_strings, eos_token_ids=call.eos_token_ids,
        )
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
            compile=None, step: str | None = None) -> Engine:
    """Route ``model.generate`` (and ``pipeline(..., batch_size=N)``) through a continuous-batching engine, in place.

    Each row of a (left-)padded batch becomes one request; the output is laid out as ``generate``'s
    (prompt columns as given, then generated tokens, finished rows padded). Calls the engine does not
    serve (beam search, streamers, logits processors, right padding, ...) go to the original
    ``generate``; :func:`infopt.generate.routing_stats` counts them. :func:`infopt.undo` removes it.

    Args:
        model: a transformers causal LM with full causal attention.
        config: :class:`Batching` settings (default ``Batching()``).
        tokenizer: for ``stop_strings`` (optional).
        kv: paged cache settings overriding the config's (a recipe's ``kvcache: paged`` step).
        compile: a recipe's :class:`~infopt.compile.Compile` step: the engine's steps compiled with its settings
            (None: eager).

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
                    kv=kv or config.paged(), chunked_prefill=config.chunked_prefill, compile=compile or False,
                    batch_invariant=config.batch_invariant, cuda_graphs=config.cuda_graphs)
    set_part(model, "engine", EnginePart(engine, key), step=key)
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
    compile = next((s for s in ctx.steps if s.stage == "compile"), None)
    engine = enable_(model, config, tokenizer=ctx.tokenizer, kv=kv, compile=compile)
    stats = engine.core.metrics().get("compile")
    ctx.notes.append(
        f"continuous batching: up to {config.max_seqs} sequences and {config.max_batch_tokens} tokens per step, "
        f"{engine.cache.allocator.num_blocks} KV blocks of {engine.cache.block_size} tokens, chunked prefill "
        f"{'on' if config.chunked_prefill else 'off'}"
        + (f"; steps compiled ({stats['compiles']} graphs, {stats['seconds']:.0f} s)" if stats is not None else "")
    )
