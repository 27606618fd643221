"""A continuous-batching engine for a Hugging Face causal LM, in process: submit, stream, cancel, generate.

This is the front-end: request handles, streaming, stop strings, cancellation and the background thread. The
model's side, one packed forward per step over a paged KV cache (the decoding sequences' next tokens and chunks
of prompts still in prefill, flattened into one ``[1, N]`` row, no padding), is :class:`~infopt.batching.core.
EngineCore`'s; requests join and leave between steps (see :mod:`infopt.batching.scheduler`). The engine is driven
either by a background thread (:meth:`Engine.start`, ``with Engine(...)``, :meth:`Engine.run_forever`) or, with no
thread running, by whoever waits for a result (so a notebook needs no thread at all).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..compile import Compile, engine_forward
from ..generate.sampling import make_generator
from ..kvcache.paged import Paged
from .core import DEFAULT_KV_BUDGET, CoreEvent, EngineCore
from .invariant import InvariantForward, check_invariant_model
from .params import RequestMetrics, RequestOutput, SamplingParams
from .scheduler import SeqState

__all__ = ["Engine", "RequestHandle", "DEFAULT_KV_BUDGET"]

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
            (:mod:`infopt.compile.packed`, scoped to the engine's steps; recorded, undone by :func:`infopt.undo`). None (default): where the
            model is fp32, or bf16 on a CPU whose oneDNN runs bf16 matmuls, on a CPU. False: the plain weights,
            even where an earlier engine packed them. The packed copies take as much memory again as the weights.
        compile: run the steps through one ``torch.compile``-d forward with dynamic shapes
            (:meth:`infopt.compile.CompiledForward.packed`; True, or a :class:`~infopt.compile.Compile` step whose
            ``pack_linears`` and ``fuse_projections`` apply, as a recipe's compile step does): its two graphs are
            compiled here, by a warm-up of a few tokens, so building the engine takes a minute or two longer on a
            small CPU model (less with Inductor's cache filled by an earlier process), and no step compiles while
            serving. ``metrics()["compile"]`` reports the graphs (the model's compile step's
            :class:`~infopt.compile.CompileStats`, where it has one). If compiling fails, the engine says so once and
            runs its steps eagerly.
        batch_invariant: a request's logits are the same bits whatever shares its steps (alone, beside 63 others,
            its prompt chunked otherwise, preempted and recomputed): matrix products in fixed blocks of rows and
            one summation order per attention row (:mod:`infopt.batching.invariant`), so a served request
            reproduces exactly from run to run. Eager steps on plain weights on a CPU (not with ``compile`` or
            ``prepack=True``; float layers only); it costs throughput (``benchmarks/batch_invariant.py``).
        cuda_graphs: replay decode steps (one new token per sequence) as CUDA graphs, one per bucket of batch size
            and block-table width (:mod:`infopt.batching.graphs`; ``metrics()["cuda_graphs"]`` reports them).
            ``"auto"`` (default): on for a CUDA model, off elsewhere. ``True`` requires CUDA. ``"replay"``: the same
            buffers, padding and buckets with the step's forward called again instead of a graph (any device; what
            the CPU tests run).
        graph_batch_sizes: the batch buckets (default :data:`infopt.batching.graphs.DEFAULT_BATCH_SIZES`, cut at
            ``max_seqs``).

    Attributes:
        core: the :class:`~infopt.batching.core.EngineCore` that runs the steps (its ``cache``, ``scheduler``,
            ``stats``, ``model`` and ``device`` are reachable from the engine too).
        device: the model's device, where each step's inputs, logits and sampled requests' generators live.

    Raises:
        ValueError: a non-positive size, ``batch_invariant`` with ``compile``, ``prepack=True``, a model off the CPU
            or quantized layers; IncompatibleModelError: a model the paged cache cannot serve.

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
                 max_skips: int = 16, default_sampling: SamplingParams | None = None, prepack: bool | None = None,
                 compile: bool = False, batch_invariant: bool = False, cuda_graphs: bool | str = "auto",
                 graph_batch_sizes: Sequence[int] | None = None):
        from ..compile.packed import can_pack_model  # registers infopt::packed_linear: only where an engine is made

        packable = can_pack_model(model)
        if prepack and not packable:
            raise ValueError("Engine prepack=True needs an fp32 model, or a bf16 one on a CPU whose oneDNN runs bf16 "
                             "matmuls, on a CPU torch build with oneDNN; use prepack=None (automatic) or False")
        if not isinstance(compile, (bool, Compile)):
            raise ValueError(f"Engine compile={compile!r} is invalid; allowed: True, False or an infopt.compile.Compile")
        if isinstance(compile, Compile) and compile.pack_linears is True and not packable and prepack is None:
            raise ValueError("Engine compile=Compile(pack_linears=True) needs an fp32 model, or a bf16 one on a CPU "
                             "whose oneDNN runs bf16 matmuls, on a CPU torch build with oneDNN; use pack_linears auto")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"Engine batch_invariant={batch_invariant!r} is invalid; allowed: True or False")
        if batch_invariant:
            if compile:
                raise ValueError("Engine batch_invariant=True runs its steps eagerly (a compiled step's matrix products "
                                 "are Inductor's, sized by the batch); use compile=False")
            if prepack:
                raise ValueError("Engine batch_invariant=True multiplies the plain weights in fixed-size row blocks; "
                                 "prepacked weights take oneDNN's own kernels: use prepack=None or False")
            check_invariant_model(model)
        self.batch_invariant = batch_invariant
        self.prepacked = 0

        def forward():  # called by the core once it has checked its own arguments
            if batch_invariant:
                return InvariantForward(model)
            fwd, self.prepacked = engine_forward(model, compile, prepack)
            return fwd

        if batch_invariant and cuda_graphs is True:
            raise ValueError("Engine batch_invariant=True runs on a CPU; cuda_graphs=True needs a CUDA model")
        self.core = EngineCore(model, forward, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs, kv=kv,
                               chunked_prefill=chunked_prefill, prefill_chunk=prefill_chunk, max_skips=max_skips,
                               cuda_graphs=cuda_graphs, graph_batch_sizes=graph_batch_sizes)
        self.tokenizer = tokenizer
        self.default_sampling = default_sampling or SamplingParams()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._step_lock = threading.RLock()
        self._incoming: list[SeqState] = []
        self._handles: dict[int, RequestHandle] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if compile or (self.core.graphs is not None and self.core.graphs.backend == "cuda"):
            self.warmup()

    # the core's parts, for callers and tests that look inside
    model = property(lambda self: self.core.model)
    cache = property(lambda self: self.core.cache)
    scheduler = property(lambda self: self.core.scheduler)

    @property
    def device(self) -> torch.device:
        """The model's device: each step's inputs, logits and sampled requests' generators live there."""
        return self.core.device

    @device.setter
    def device(self, value: torch.device) -> None:
        self.core.device = value

    stats = property(lambda self: self.core.stats)
    capacity_tokens = property(lambda self: self.core.capacity_tokens)

    def warmup(self) -> None:
        """Compile the compiled step's graphs and capture the CUDA-graph decode steps now (``Engine(compile=True)``
        and a CUDA engine with graphs call this when they are built), so no step compiles or captures while serving.
        Compiling: one two-token request alone (its prompt runs eagerly and allocates the KV pools, then a
        single-token step), then two together (a step of several tokens). Capturing: every bucket of
        :mod:`infopt.batching.graphs`, the largest first. The engine's statistics start afresh afterwards. Nothing
        to do without either.

        Raises:
            RuntimeError: a warm-up request failed (the model cannot run in this engine; the reason is given).
        """
        fwd = self.core.forward
        graphs = self.core.graphs
        compiling = fwd.compiled and not (fwd.engine_graph is not None and fwd.engine_graph.warmed_up)
        capturing = graphs is not None and graphs.backend == "cuda" and graphs.enabled
        if not compiling and not capturing:
            return
        vocab = self.core.vocab_size or 2
        ids = [[1 % vocab, 2 % vocab], [3 % vocab, 4 % vocab]]
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        if compiling or not self.cache.pool.allocated():
            # a cold compile of each graph takes seconds to a minute or more (Inductor caches them on disk after)
            runs = (ids[:1], ids) if compiling else (ids[:1],)
            with tqdm(total=len(runs), desc="infopt batching: compiling the engine's steps" if compiling else
                      "infopt batching: allocating the KV pools", unit="run") as bar:
                for prompts in runs:
                    for out in self.generate(prompts, sp):
                        if out.finish_reason == "error":
                            raise RuntimeError(f"the engine's warm-up request failed: {out.error}")
                    bar.update()
        if compiling:
            if fwd.engine_graph is not None:
                fwd.engine_graph.warmed_up = True
            fwd.stats.warmed_up = True
        if capturing:
            try:
                with torch.inference_mode():
                    graphs.capture()
            except Exception as e:  # a step that cannot be captured runs as before
                graphs.disable(f"capture failed: {type(e).__name__}: {e}")
        self.core.reset_stats()

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
        self.core.check_request(ids, params)
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
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.core.eos
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
            return bool(self._incoming) or self.core.has_work()

    def _intake(self) -> None:
        with self._lock:
            new, self._incoming = self._incoming, []
        for seq in new:
            self.core.add(seq)
        for seq in self.core.requests():
            if self._handles[seq.rid]._cancel:
                self.core.finish(seq, "cancelled")
                self._emit(seq, "cancelled")

    def step(self) -> bool:
        """Run one step: take in new requests and cancellations, then the core's schedule -> execute -> update
        (at most one forward), then hand each request's new token or result to its handle. Thread-safe.

        Returns:
            True while requests remain queued or running.
        """
        with self._step_lock:
            self._intake()
            for event in self.core.step():
                self._dispatch(event)
            return self.has_work()

    def _dispatch(self, event: CoreEvent) -> None:
        seq, reason = event.seq, event.finish
        if event.token is not None:
            self._handles[seq.rid]._put(event.token)
            if reason in (None, "length") and seq.params.stop and self._stop_hit(seq):
                if reason is None:
                    self.core.finish(seq, "stop")
                reason = "stop"
        if reason is not None:
            self._emit(seq, reason, error=event.error)

    def _stop_hit(self, seq: SeqState) -> bool:
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.extra["text"] = text[:cut]
        return True

    def _emit(self, seq: SeqState, reason: str, *, error: str | None = None) -> None:
        """Hand a finished request's :class:`RequestOutput` to its handle (the core has released it)."""
        text = seq.extra.get("text")
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        out = RequestOutput(seq.rid, seq.prompt, list(seq.output), text, reason, error, seq.metrics)
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
        return self.core.metrics()
