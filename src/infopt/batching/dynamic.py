"""Micro-batching for non-generative forwards: :class:`DynamicBatcher` gathers calls from many threads into one
padded forward (a batch closes when it is full or its first request has waited ``timeout_ms``);
:class:`StaticBatcher` is the naive generation baseline (fixed batches, each decoded until its longest row ends)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from .params import RequestMetrics, RequestOutput, SamplingParams

__all__ = ["DynamicBatcher", "StaticBatcher", "pad_collate", "trim_split"]


def pad_collate(items: Sequence[Any], pad_token_id: int = 0, *, side: str = "right") -> dict[str, torch.Tensor]:
    """Pad 1-D token-id items (lists or tensors) into ``{"input_ids", "attention_mask"}`` ``[B, T]``, on the right
    (forwards that score every position) or on the ``left`` (``generate``).

    Example:
        >>> pad_collate([[5, 6, 7], [8]])["attention_mask"].tolist()
        [[1, 1, 1], [1, 0, 0]]
    """
    if side not in ("right", "left"):
        raise ValueError(f"pad_collate side={side!r} is invalid; allowed: right, left")
    rows = [torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in items]
    if any(r.numel() == 0 for r in rows):
        raise ValueError("an item has no tokens; every item needs at least one token id")
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(0, r.numel()) if side == "right" else slice(width - r.numel(), width)
        ids[i, cols] = r
        mask[i, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


def trim_split(output: Any, items: Sequence[Any]) -> list[Any]:
    """Split a batched output back into per-item results: row ``i`` of the output tensor (its ``logits`` for a
    model output), trimmed to the item's length when the second dimension is the padded sequence."""
    t = output.logits if hasattr(output, "logits") else output
    lengths = [torch.as_tensor(x).numel() for x in items]
    width = max(lengths)
    if t.dim() >= 2 and t.shape[1] == width:
        return [t[i, :n] for i, n in enumerate(lengths)]
    return [t[i] for i in range(len(items))]


class DynamicBatcher:
    """Gather single-item calls from many threads into batched calls of ``fn``.

    Args:
        fn: the batched function; gets ``collate(items)`` (keyword arguments when that is a dict).
        max_batch_size: items per call at most.
        timeout_ms: how long the first item of a batch waits for company before the batch runs.
        collate: items -> batch (default :func:`pad_collate`: right-padded token ids + attention mask).
        split: (output, items) -> per-item results (default :func:`trim_split`).
        device: where the collated tensors go before ``fn`` sees them (a CUDA model's device: :func:`pad_collate`
            builds CPU tensors); None leaves them where ``collate`` put them.

    Raises:
        ValueError: a non-positive ``max_batch_size`` or a negative ``timeout_ms``.

    Example:
        >>> from infopt.models import tiny_model
        >>> model = tiny_model()
        >>> with DynamicBatcher(lambda **b: model(**b).logits, max_batch_size=4, timeout_ms=2) as score:
        ...     score([1, 2, 3]).shape[0]  # this item's logits, padding trimmed
        3
    """

    def __init__(self, fn: Callable[..., Any], max_batch_size: int = 8, timeout_ms: float = 5.0, *,
                 collate: Callable[[Sequence[Any]], Any] | None = None,
                 split: Callable[[Any, Sequence[Any]], Sequence[Any]] | None = None,
                 device: torch.device | str | None = None):
        if not isinstance(max_batch_size, int) or max_batch_size <= 0:
            raise ValueError(f"DynamicBatcher max_batch_size={max_batch_size!r} is invalid; allowed: an integer > 0")
        if not isinstance(timeout_ms, (int, float)) or timeout_ms < 0:
            raise ValueError(f"DynamicBatcher timeout_ms={timeout_ms!r} is invalid; allowed: a number >= 0")
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.timeout = timeout_ms / 1000
        self.collate = collate or pad_collate
        self.split = split or trim_split
        self.device = torch.device(device) if device is not None else None
        self._queue: list[tuple[Any, Future]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0
        self.items = 0
        self._worker = threading.Thread(target=self._run, name="infopt-dynamic-batcher", daemon=True)
        self._worker.start()

    def submit(self, item: Any) -> Future:
        """Queue one item; the returned future resolves to its result (or the batch's exception)."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this DynamicBatcher is closed")
            self._queue.append((item, fut))
            self._cond.notify()
        return fut

    def __call__(self, item: Any, timeout: float | None = None) -> Any:
        """Run ``item`` in the next batch and return its result (blocks the calling thread)."""
        return self.submit(item).result(timeout)

    def _take(self) -> list[tuple[Any, Future]] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            deadline = time.monotonic() + self.timeout
            while len(self._queue) < self.max_batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._queue = self._queue[:self.max_batch_size], self._queue[self.max_batch_size:]
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            items = [it for it, _ in batch]
            try:
                collated = self._to_device(self.collate(items))
                with torch.no_grad():
                    out = self.fn(**collated) if isinstance(collated, dict) else self.fn(collated)
                results = list(self.split(out, items))
                if len(results) != len(items):
                    raise ValueError(f"split returned {len(results)} results for {len(items)} items")
            except BaseException as e:  # every caller in the batch gets the error; the batcher keeps serving
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            self.batches += 1
            self.items += len(items)
            for (_, fut), r in zip(batch, results, strict=True):
                fut.set_result(r)

    def _to_device(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        if torch.is_tensor(batch):
            return batch.to(self.device)
        if isinstance(batch, dict):
            return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        return batch

    def close(self) -> None:
        """Finish the queued items, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    def __enter__(self) -> DynamicBatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0


class StaticBatcher:
    """The naive generation baseline: requests in fixed batches of ``batch_size`` in arrival order, left-padded,
    each batch decoded with ``model.generate`` until its longest request ends (kept for comparison with
    :class:`~infopt.batching.Engine` in benchmarks).

    Args:
        model: a transformers causal LM. tokenizer: for string prompts and output text (optional).
        batch_size: requests per batch.
        pad_token_id: padding id (default: the model's pad or first end-of-sequence id).

    Example:
        >>> from infopt.models import tiny_model
        >>> outs = StaticBatcher(tiny_model(), batch_size=2).generate([[1, 2], [3, 4, 5]], SamplingParams(4))
        >>> [len(o.token_ids) for o in outs]
        [4, 4]
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, batch_size: int = 8, pad_token_id: int | None = None):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"StaticBatcher batch_size={batch_size!r} is invalid; allowed: an integer > 0")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        gc = model.generation_config
        eos = gc.eos_token_id if gc is not None else None
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.pad = pad_token_id if pad_token_id is not None else (gc.pad_token_id if gc.pad_token_id is not None
                                                                  else (eos if eos is not None else 0))

    @torch.no_grad()
    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | None = None) -> list[RequestOutput]:
        """Greedy or sampled generation for every prompt, ``batch_size`` at a time; outputs in prompt order."""
        p = sampling or SamplingParams()
        rows = [self.tokenizer(x)["input_ids"] if isinstance(x, str) else torch.as_tensor(x).reshape(-1).tolist()
                for x in prompts]
        device = next(self.model.parameters()).device
        eos = self.model.generation_config.eos_token_id
        eos = set([eos] if isinstance(eos, int) else (eos or []))
        outs = []
        for start in range(0, len(rows), self.batch_size):
            group = rows[start:start + self.batch_size]
            arrival = time.perf_counter()
            batch = pad_collate(group, self.pad, side="left")
            ids, mask = batch["input_ids"], batch["attention_mask"]
            kw = {"do_sample": p.do_sample, "max_new_tokens": p.max_new_tokens, "min_new_tokens": p.min_new_tokens,
                  "pad_token_id": self.pad}
            if p.do_sample:
                kw.update(temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p)
            if p.ignore_eos:
                kw["min_new_tokens"] = p.max_new_tokens
            gen = self.model.generate(ids.to(device), attention_mask=mask.to(device), **kw)[:, ids.shape[1]:].cpu()
            done = time.perf_counter()
            for j, r in enumerate(group):
                toks = gen[j].tolist()
                cut = None if p.ignore_eos else next((i + 1 for i, t in enumerate(toks) if t in eos), None)
                toks = toks[:cut]
                m = RequestMetrics(arrival, arrival, None, done, len(r), 0, len(toks), 0)
                text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
                outs.append(RequestOutput(start + j, list(r), toks, text, "length" if cut is None else "stop", None, m))
        return outs
