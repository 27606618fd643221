"""A continuous-batching engine for a Hugging Face causal LM, in process: submit, stream, cancel, generate.

Every step runs one packed forward over a paged KV cache: the decoding sequences' next tokens and
chunks of prompts still in prefill, flattened into one ``[1, N]`` row (no padding). Requests join
and leave between steps (see :mod:`infopt.batching.scheduler`). The engine is driven either by a
background thread (:meth:`Engine.start`, ``with Engine(...)``, :meth:`Engine.run_forever`) or, with
no thread running, by whoever waits for a result (so a notebook needs no thread at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..attention.paged import PAGED_IMPL, load_cpu_kernel
from ..core.introspect import inspect_model
from ..generate import takes_logits_to_keep
from ..kvcache.paged import Paged
from ..kvcache.paged_cache import PagedCache
from ..kvcache.pool import num_blocks_for_budget
from .params import RequestMetrics, RequestOutput, SamplingParams
from .prepack import packed_forwards, prepack_linears_, supported
from .sampler import choose_tokens, make_generator
from .scheduler import Scheduler, SeqState, SequenceTooLarge

__all__ = ["Engine", "RequestHandle", "DEFAULT_KV_BUDGET"]

DEFAULT_KV_BUDGET = 2**30
"""KV-cache bytes an engine's pool gets when ``kv.num_blocks`` is not given (1 GiB)."""

_DONE = object()


class RequestHandle:
    """A submitted request: stream its tokens, wait for its result, or cancel it.

    Returned by :meth:`Engine.submit`. Thread-safe; several threads may wait on the same handle.
    """

    def __init__(self, engine: Engine, seq: SeqState):
        self._engine = engine
        self._seq = seq
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._cancel = False

    @property
    def request_id(self) -> int:
        return self._seq.rid

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Ask the engine to stop this request at its next step (its output so far is kept, ``finish_reason
        "cancelled"``). Returns False when it had already finished."""
        if self._done.is_set():
            return False
        self._cancel = True
        self._engine._wake.set()
        return True

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish and return its :class:`RequestOutput`.

        With no background thread running, the waiting caller drives the engine.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if self._engine.is_running():
                self._done.wait(0.5 if left is None else min(0.5, left))
            else:
                self._engine.step()  # no background thread: the waiting caller drives the engine
        if self._output is None:
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._output

    def stream(self, *, text: bool = False) -> Iterator[int | str]:
        """Yield the request's tokens as they are generated (token ids, or with ``text=True`` text pieces
        decoded incrementally; needs the engine's tokenizer). Ends when the request finishes."""
        tok = self._engine.tokenizer
        if text and tok is None:
            raise ValueError("stream(text=True) needs the engine to have a tokenizer: Engine(model, tokenizer)")
        ids: list[int] = []
        shown = ""
        while True:
            try:
                item = self._events.get(timeout=0.5) if self._engine.is_running() else self._events.get_nowait()
            except queue.Empty:
                if not self._engine.is_running():
                    self._engine.step()
                continue
            if item is _DONE:
                if text and self._output is not None and self._output.text is not None and \
                        len(self._output.text) > len(shown):
                    yield self._output.text[len(shown):]
                return
            if not text:
                yield item
                continue
            ids.append(item)
            full = tok.decode(ids, skip_special_tokens=True)
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                continue
            stop = self._seq.params.stop
            if stop:  # hold back a tail that could still become a stop string
                full = full[:max(len(shown), len(full) - max(len(s) for s in stop) + 1)]
            if len(full) > len(shown) and full.startswith(shown):
                yield full[len(shown):]
                shown = full

    async def aresult(self) -> RequestOutput:
        """``await`` the result (needs the engine's background thread: :meth:`Engine.start`)."""
        self._engine._require_thread("aresult")
        return await asyncio.to_thread(self.result)

    async def astream(self) -> AsyncIterator[int]:
        """Async iterator over the request's token ids (needs the background thread)."""
        self._engine._require_thread("astream")
        while True:
            item = await asyncio.to_thread(self._events.get)
            if item is _DONE:
                return
            yield item

    # engine side
    def _put(self, token: int) -> None:
        self._events.put(token)

    def _finish(self, output: RequestOutput) -> None:
        self._output = output
        self._done.set()
        self._events.put(_DONE)


class Engine:
    """Continuous batching over a paged KV cache for an existing Hugging Face causal LM.

    Args:
        model: a transformers causal LM with full causal attention (switched to the ``paged`` attention
            backend if it is not on it; recorded, so :func:`infopt.undo` reverts it — forwards with no
            paged cache bound run SDPA).
        tokenizer: for string prompts, stop strings and output text (optional).
        max_batch_tokens: tokens per forward at most (decode tokens plus prefill chunks).
        max_seqs: requests decoding at once at most.
        kv: the paged cache settings (:class:`~infopt.kvcache.Paged`); ``num_blocks=None`` sizes the pool
            to :data:`DEFAULT_KV_BUDGET` bytes, or to ``max_seqs`` sequences of the model's full length when
            that is less.
        chunked_prefill: split long prompts across steps, interleaved with decoding.
        prefill_chunk: prompt tokens one sequence gets per step at most (None: ``max_batch_tokens // 8``, at
            least 16), so a long prompt leaves room in every step for newcomers and keeps steps short: a short
            request's time to first token behind a long prompt is bounded by a small step, not the long prefill.
        max_skips: the starvation bound: how often later requests may be admitted ahead of a waiting one.
        default_sampling: :class:`SamplingParams` for requests submitted without any.
        prepack: pack the linear weights once into oneDNN's blocked layout and use them in the engine's steps
            (:mod:`infopt.batching.prepack`; recorded, undone by :func:`infopt.undo`). None (default): where the
            model is fp32, or bf16 on a CPU whose oneDNN runs bf16 matmuls, on a CPU. False: the plain weights,
            even where an earlier engine packed them. The packed copies take as much memory again as the weights.

    Attributes:
        device: the model's device, where each step's inputs, logits and sampled requests' generators live.

    Raises:
        ValueError: a non-positive size; IncompatibleModelError: a model the paged cache cannot serve.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> engine = Engine(tiny_model(), max_batch_tokens=64, max_seqs=4, kv=Paged(num_blocks=32))
        >>> outs = engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True))
        >>> [len(o.token_ids) for o in outs], engine.cache.allocator.num_used
        ([5, 5], 0)
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, max_batch_tokens: int = 512, max_seqs: int = 64,
                 kv: Paged | None = None, chunked_prefill: bool = True, prefill_chunk: int | None = None,
                 max_skips: int = 16, default_sampling: SamplingParams | None = None, prepack: bool | None = None):
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_seqs", max_seqs), ("max_skips", max_skips + 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Engine {name}={v!r} is invalid; allowed: a positive integer")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk <= 0):
            raise ValueError(f"Engine prefill_chunk={prefill_chunk!r} is invalid; allowed: a positive integer or None")
        packable = supported(model)
        if prepack and not packable:
            raise ValueError("Engine prepack=True needs an fp32 model, or a bf16 one on a CPU whose oneDNN runs bf16 "
                             "matmuls, on a CPU torch build with oneDNN; use prepack=None (automatic) or False")
        kv = kv or Paged()
        if not isinstance(kv, Paged):
            raise ValueError(f"Engine kv={kv!r} is invalid; allowed: an infopt.kvcache.Paged config")
        info = inspect_model(model)
        kv.check(model, info, (kv,))
        if model.config._attn_implementation != PAGED_IMPL:
            from ..attention.backends import set_backend_

            set_backend_(model, "paged", step="batching")
        self._packed_steps = bool(packable if prepack is None else prepack)
        self.prepacked = prepack_linears_(model) if self._packed_steps else 0
        self.model = model
        self.tokenizer = tokenizer
        max_positions = getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                                "max_position_embeddings", None)
        num_blocks = kv.num_blocks
        if num_blocks is None:  # the budget, but no more than max_seqs full-length sequences need
            num_blocks = max(1, num_blocks_for_budget(model, DEFAULT_KV_BUDGET, kv.block_size))
            if max_positions:
                num_blocks = min(num_blocks, -(-max_seqs * max_positions // kv.block_size))
        self.cache = PagedCache.for_model(model, num_blocks, kv.block_size, prefix_caching=kv.prefix_caching)
        self.device = self.cache.device or torch.device("cpu")  # the model's: batches, logits, generators
        if self.device.type == "cpu":
            load_cpu_kernel()  # now, not in the first step: a compiled forward cannot load it while tracing
        self.scheduler = Scheduler(self.cache.blocks, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens,
                                   chunked_prefill=chunked_prefill,
                                   prefill_chunk=prefill_chunk or min(max_batch_tokens, max(16, max_batch_tokens // 8)),
                                   max_skips=max_skips)
        self.default_sampling = default_sampling or SamplingParams()
        self.capacity_tokens = num_blocks * kv.block_size
        self.max_positions = max_positions
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0]) \
            if model.get_output_embeddings() is not None else None
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self._eos = tuple([eos] if isinstance(eos, int) else (eos or ()))
        self._logits_to_keep = takes_logits_to_keep(model)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._step_lock = threading.RLock()
        self._incoming: list[SeqState] = []
        self._handles: dict[int, RequestHandle] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats: dict[str, Any] = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "finished": 0,
                                      "cancelled": 0, "errors": 0, "busy_s": 0.0, "kv_util_sum": 0.0,
                                      "kv_util_max": 0.0}

    # -- submission ----------------------------------------------------------------------------------
    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer: Engine(model, tokenizer)")
            ids = self.tokenizer(prompt)["input_ids"]
        elif torch.is_tensor(prompt):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1 or prompt.dtype.is_floating_point:
                raise ValueError(f"a tensor prompt must be 1-D (or [1, T]) token ids; got shape {tuple(prompt.shape)} "
                                 f"{prompt.dtype}")
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a tensor of ids; got "
                             f"{type(prompt).__name__}")
        return [int(t) for t in ids]

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        need = len(ids) + params.max_new_tokens
        if need > self.capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} tokens exceeds the KV "
                f"cache ({self.capacity_tokens} tokens); shorten the request or build the engine with "
                "kv=Paged(num_blocks=...) large enough")
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} exceeds "
                             f"the model's max_position_embeddings ({self.max_positions})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: Engine(model, tokenizer)")

    def submit(self, prompt: Any, sampling: SamplingParams | None = None) -> RequestHandle:
        """Queue one request; thread-safe.

        Args:
            prompt: a string (needs the tokenizer), a list of token ids, or a 1-D / ``[1, T]`` tensor of ids.
            sampling: :class:`SamplingParams` (default: the engine's ``default_sampling``).

        Returns:
            A :class:`RequestHandle`.

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, a request longer than the KV cache or
                the model's positions, stop strings without a tokenizer. Nothing was queued; the engine
                keeps serving the other requests.
        """
        return self._enqueue(*self._checked(prompt, sampling))

    def _checked(self, prompt: Any, sampling: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        params = sampling if sampling is not None else self.default_sampling
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling must be an infopt.batching.SamplingParams; got {type(params).__name__}")
        ids = self._encode(prompt)
        self._validate(ids, params)
        return ids, params

    def _enqueue(self, ids: list[int], params: SamplingParams) -> RequestHandle:
        with self._lock:
            rid = next(self._ids)
        seq = SeqState(rid, ids, params, RequestMetrics(time.perf_counter(), prompt_tokens=len(ids)))
        if params.do_sample:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            seq.generator = make_generator(self.device, seed)  # where the logits are: CUDA cannot draw from CPU's
        eos = params.eos_token_ids if params.eos_token_ids is not None else self._eos
        if eos and not params.ignore_eos:
            seq.eos = tuple(int(t) for t in eos)
        handle = RequestHandle(self, seq)
        with self._lock:
            self._handles[rid] = handle
            self._incoming.append(seq)
        self._wake.set()
        return handle

    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion and return their outputs in the same order.

        Args:
            prompts: strings, token-id lists or tensors (see :meth:`submit`).
            sampling: one :class:`SamplingParams` for all, or one per prompt.

        Raises:
            ValueError: a bad prompt or sampling setting (checked for all prompts before any is queued).
        """
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        checked = [self._checked(p, s) for p, s in zip(prompts, params, strict=True)]  # all, before any is queued
        handles = [self._enqueue(ids, sp) for ids, sp in checked]
        return [h.result() for h in handles]

    async def agenerate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> list[RequestOutput]:
        """``await`` version of :meth:`generate`; starts the background thread if it is not running."""
        self.start()
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        handles = [self.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        return list(await asyncio.gather(*(h.aresult() for h in handles)))

    # -- the loop ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming) or self.scheduler.has_work()

    def _intake(self) -> None:
        with self._lock:
            new, self._incoming = self._incoming, []
        for seq in new:
            self.scheduler.add(seq)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if self._handles[seq.rid]._cancel:
                self._finish(seq, "cancelled")

    # inference_mode: about 1 ms less per step than no_grad on the default model (each op skips the autograd and
    # version-counter work); the KV pools are made with inference_mode off (kvcache.pool), so they stay writable
    # by paths outside the engine
    @torch.inference_mode()
    def step(self) -> bool:
        """Run one scheduling step: schedule, execute (at most one forward), update. Thread-safe.

        Returns:
            True while requests remain queued or running.
        """
        with self._step_lock:
            self._intake()
            scheduled = self._schedule()
            if scheduled is not None:
                plan, batch = scheduled
                t0 = time.perf_counter()
                executed = self._execute(plan, batch)
                if executed is not None:
                    self._update(plan, *executed, t0)
            return self.has_work()

    def _schedule(self) -> tuple[list[tuple[SeqState, int]], Any] | None:
        """The scheduler's next step (its blocks allocated), laid out in the paged cache's tensors; None when nothing
        runs this step."""
        try:
            step = self.scheduler.next_step()
        except SequenceTooLarge as e:  # one sequence larger than the pool: fail it, serve the rest
            self._finish(e.seq, "error", error=f"out of KV blocks: {e}")
            return None
        if step is None:
            return None
        return step.plan, self.cache.layout_step(step.entries, step.starts)

    def _execute(self, plan: list[tuple[SeqState, int]], batch) -> tuple[list[int], torch.Tensor] | None:
        """One packed forward; returns the plan rows whose next token is due and their logits, or None when the
        forward failed (the step is rolled back and its requests fail; the engine keeps serving the rest)."""
        due_rows = [i for i, (s, n) in enumerate(plan) if s.pending == n]
        keep = batch.logits_indices[due_rows] if due_rows else batch.logits_indices[:1]
        if keep.numel() in (2, 3) and keep.device.type == "cpu":
            # fp32 CPU matmuls take a slow path for 2-3 rows (benchmarks/small_m_matmul.py: 3 rows of the
            # default model's head cost 2.3x 4 rows); repeat the last row to make 4, and drop the copies below
            keep = torch.cat([keep, keep[-1:].expand(4 - keep.numel())])
        kwargs = {"logits_to_keep": keep} if self._logits_to_keep else {}
        try:
            with packed_forwards() if self._packed_steps else contextlib.nullcontext():
                out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                                 paged_step=self.cache.step_inputs(), **kwargs)
        except Exception as e:
            self.cache.abort_step()
            self.scheduler.abort(plan)
            for seq, _ in plan:
                self._finish(seq, "error", error=f"forward failed: {type(e).__name__}: {e}")
            return None
        logits = out.logits[0, :len(due_rows)] if self._logits_to_keep else \
            out.logits[0, batch.logits_indices[due_rows]]
        return due_rows, logits

    def _update(self, plan: list[tuple[SeqState, int]], due_rows: list[int], logits: torch.Tensor,
                t0: float) -> None:
        """Record the finished forward: progress and metrics, the next token of each due sequence, stats."""
        for seq, n in plan:
            if seq.metrics.first_scheduled is None:
                seq.metrics.first_scheduled = t0
            self.stats["prefill_tokens" if n > 1 or seq.computed < len(seq.prompt) else "decode_tokens"] += n
        self.cache.end_step()
        due = self.scheduler.complete(plan)
        if due:
            seqs = [plan[i][0] for i in due_rows]
            eos_masks = [s.eos if s.eos is not None and len(s.output) < s.params.min_new_tokens else None
                         for s in seqs]
            tokens = choose_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], eos_masks)
            now = time.perf_counter()
            for seq, tok in zip(seqs, tokens, strict=True):
                self._append(seq, tok, now)
        alloc = self.cache.allocator
        util = alloc.num_used / max(1, alloc.num_blocks)
        self.stats["steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        self.stats["kv_util_sum"] += util
        self.stats["kv_util_max"] = max(self.stats["kv_util_max"], util)

    def _append(self, seq: SeqState, tok: int, now: float) -> None:
        seq.output.append(tok)
        if seq.metrics.first_token is None:
            seq.metrics.first_token = now
        self._handles[seq.rid]._put(tok)
        if seq.eos is not None and tok in seq.eos:  # masked while under min_new_tokens
            self._finish(seq, "stop")
        elif seq.params.stop and self._stop_hit(seq):
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.params.max_new_tokens:
            self._finish(seq, "length")

    def _stop_hit(self, seq: SeqState) -> bool:
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.extra["text"] = text[:cut]
        return True

    def _finish(self, seq: SeqState, reason: str, *, error: str | None = None) -> None:
        self.scheduler.drop(seq)
        seq.metrics.finished = time.perf_counter()
        seq.metrics.output_tokens = len(seq.output)
        text = seq.extra.get("text")
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        out = RequestOutput(seq.rid, seq.prompt, list(seq.output), text, reason, error, seq.metrics)
        key = {"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")
        self.stats[key] += 1
        with self._lock:
            handle = self._handles.pop(seq.rid)
        handle._finish(out)

    # -- background thread ------------------------------------------------------------------------
    def is_running(self) -> bool:
        """True while the background thread (or :meth:`run_forever`) drives the engine."""
        return self._thread is not None and self._thread.is_alive()

    def _require_thread(self, what: str) -> None:
        if not self.is_running():
            raise RuntimeError(f"{what} needs the engine's background thread: call engine.start() first "
                               "(or use `with engine:`)")

    def run_forever(self) -> None:
        """Drive the engine in the calling thread until :meth:`stop` is called from another thread."""
        if self._thread is None:
            self._thread = threading.current_thread()
        try:
            while not self._stop.is_set():
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        finally:
            if self._thread is threading.current_thread():
                self._thread = None

    def start(self) -> Engine:
        """Start the background thread that drives the engine (idempotent); returns the engine."""
        if not self.is_running():
            self._stop.clear()
            self._thread = threading.Thread(target=self.run_forever, name="infopt-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, cancel: bool = False) -> None:
        """Stop the background thread (after finishing queued work unless ``cancel``)."""
        if cancel:
            with self._lock:
                handles = list(self._handles.values())
            for h in handles:
                h.cancel()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            while not cancel and self.has_work() and thread.is_alive():
                time.sleep(0.01)
            self._stop.set()
            self._wake.set()
            thread.join()
        self._stop.set()
        if cancel:
            self.step()  # apply the cancellations
        self._thread = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(cancel=exc[0] is not None)

    # -- metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Aggregate figures: steps, tokens (prefill / decode), requests finished / cancelled / failed,
        preemptions, busy seconds and tokens per busy second, KV block utilization (mean and max
        fraction of the pool in use per step) and the pool's block counts."""
        s = dict(self.stats)
        steps = max(1, s["steps"])
        s["kv_util_mean"] = s.pop("kv_util_sum") / steps
        s["preemptions"] = self.scheduler.preemptions
        s["tokens_per_busy_s"] = (s["prefill_tokens"] + s["decode_tokens"]) / s["busy_s"] if s["busy_s"] else 0.0
        s["kv_blocks"] = self.cache.allocator.stats()
        return s
