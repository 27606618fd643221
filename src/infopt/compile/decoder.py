"""The compiled forward: ``torch.compile`` of the model's decode and verify steps over a static cache, and of the
batching engine's packed step (:mod:`infopt.compile.packed_step`).

Only the decode step is compiled. The prompt (prefill) runs eagerly: its length changes from call to
call and a compiled prefill would recompile for each one, while the decode step has the same shapes
for every token of every call that lands in the same cache bucket. Each distinct shape, ``(batch,
cache length, padded or not)``, gets its own compiled graph; :class:`CompileStats` counts them, and
the compiles that happened after :func:`warmup` (which should be none when the warm-up covered the
shapes the calls use).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..attention import paged
from ..attention.gqa import GQA_SDPA_IMPL, KV_LEN_KWARG
from ..core.compat import CACHE_KWARG
from ..generate import Forward, decoder_for, rollback, static_length
from ..generate.forward import head_rows
from ..kvcache.static import BUCKET
from . import aot  # by module: a test replaces aot.export_step
from .aot import (
    aot_available,
    batch_free,
    find_indexed,
    fingerprint,
    index_package,
    local_key,
)
from .guard_free import GuardFreeStep, _GraphNotHeld, _shape_name, isolated_compile, mark_free_sizes, weak_backend
from .options import mode_options, module_signature
from .packed_step import PackedGraph, is_compile_error

log = logging.getLogger("infopt.compile")

MAX_GRAPHS_PER_SHAPE = 2
"""Graphs one decode shape may compile before its step runs eagerly instead: one, plus one recompile (a change of
global state such as grad mode). More means the graph cannot hold: dynamo guards on a value that changes every
token (some models' sliding-window masks do), and each token would otherwise recompile until a hard error."""

MAX_TOKENS = 16
"""Widest call compiled: one-token decode and verify/draft-catch-up widths up to this bucket. Wider calls (a draft
model's first pass over the prompt) change width from call to call and run eagerly, like the prompt."""

MIN_VERIFY_WIDTH = 4
"""The narrowest multi-token graph a speculative target's warm-up compiles: a verify of 2-4 tokens runs the 4-token
graph, padded. A decode step of a few rows streams the same weights whatever its rows, so a 2-token graph would cost
a compile and save no time: on the default model under ``cpu-lossless`` (2-core AVX-512 CPU) a 2-token step took
36.5 ms on its own graph, the 4-token one 32.2 ms, the 8-token one 37.1 ms (medians of 3 processes), and leaving the 2-token AOTInductor package out took the
first apply from 300 to 277 s (``benchmarks/studies/verify_widths.py``). A draft model keeps its 2-token catch-up
step."""

__all__ = ["CompileStats", "CompiledForwards", "CompiledForward", "compile_stats", "mode_options", "isolated_compile",
           "token_bucket", "weak_backend", "MIN_VERIFY_WIDTH"]


@dataclass
class CompileStats:
    """What a model's compiled decode step did since it was set up.

    Attributes:
        compiles: graphs compiled (one per decode shape).
        seconds: wall time spent compiling them.
        shapes: the decode shapes compiled, ``"batch B, cache L, padded|unpadded"``, in order.
        calls: decode steps run through compiled graphs.
        warmed_up: True once :func:`infopt.compile.warmup` (or the step's own warm-up) ran.
        compiles_after_warmup: graphs compiled by calls after the warm-up; each cost ``seconds / compiles``
            of a user's call. Warm up the shapes your calls use to keep it at 0.
        eager_shapes: shapes whose step could not hold a compiled graph and runs eagerly, with the reason
            (one warning per model says so, for the first such shape).
        eager_calls: decode steps run eagerly for those shapes.
        loaded: shapes whose compiled step was loaded from a saved model's folder instead of compiled
            (:mod:`infopt.compile.saved`).
        aot: shapes that run as AOTInductor packages (``Compile(aot=...)``, :mod:`infopt.compile.aot`).
        aot_cached: of those, packages loaded from the disk cache instead of compiled.
        aot_indexed: of those, packages found by describing the model, without exporting the step
            (:func:`infopt.compile.aot.find_indexed`).
        aot_failed: shapes whose package could not be built, with the reason (they run ``torch.compile``'s graph).
        cold_shapes: shapes a call brought after the warm-up that it did not compile, run eagerly instead of waiting
            for a compiler (``Compile(cold_shapes="eager")``, the default on CPU).
        cold_eager_calls: decode steps run eagerly for those shapes.
    """

    compiles: int = 0
    seconds: float = 0.0
    shapes: list[str] = field(default_factory=list)
    calls: int = 0
    warmed_up: bool = False
    compiles_after_warmup: int = 0
    eager_shapes: dict[str, str] = field(default_factory=dict)
    eager_calls: int = 0
    loaded: int = 0
    aot: int = 0
    aot_cached: int = 0
    aot_indexed: int = 0
    aot_failed: dict[str, str] = field(default_factory=dict)
    cold_shapes: list[str] = field(default_factory=list)
    cold_eager_calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "seconds": round(self.seconds, 2), "shapes": list(self.shapes),
                "calls": self.calls, "warmed_up": self.warmed_up, "compiles_after_warmup": self.compiles_after_warmup,
                "eager_shapes": dict(self.eager_shapes), "eager_calls": self.eager_calls,
                "loaded": self.loaded, "aot": self.aot, "aot_cached": self.aot_cached,
                "aot_failed": dict(self.aot_failed), "cold_shapes": list(self.cold_shapes),
                "cold_eager_calls": self.cold_eager_calls}


def compile_stats(model: nn.Module) -> CompileStats | None:
    """The :class:`CompileStats` of a model optimized with a ``compile`` step, or None."""
    dec = decoder_for(model)
    forwards = dec.forwards if dec is not None else None
    return forwards.stats if isinstance(forwards, CompiledForwards) else None


def step_options(config, device: torch.device) -> dict[str, Any]:
    """Inductor config for a decode step compiled under ``config`` (a :class:`~infopt.compile.Compile`) on
    ``device``: :func:`mode_options`, and on CPU with ``module_guards="per_call"`` no size asserts.

    Inductor's generated wrapper checks the size and stride of each input and of each custom operator's output on
    every call: about 450 Python calls per token for the default model, 0.4 ms of a 4.7 ms ``cpu-fast`` token on 2
    cores (decode 1.10x faster without them, interleaved in one process). What they check is held otherwise: the
    inputs by dynamo's guards on the step's arguments and by the per-call module check (parameters' shapes, dtypes
    and devices), the operators' outputs by their fake kernels, which ``torch.library.opcheck`` holds to the real
    kernels' shapes and strides in the tests. A ``TORCHINDUCTOR_SIZE_ASSERTS`` environment variable, set either way,
    is left in charge."""
    asserts = None
    if (device.type == "cpu" and getattr(config, "module_guards", None) == "per_call"
            and "TORCHINDUCTOR_SIZE_ASSERTS" not in os.environ):
        asserts = False
    return mode_options(config.mode, device, config.cpp_wrapper, size_asserts=asserts)


def token_bucket(k: int) -> int:
    """The compiled width for ``k`` new tokens: the next power of two (a verify of ``k`` tokens runs the graph of
    its bucket, padded; so adaptive draft lengths compile a few graphs, not one per length).

    Example:
        >>> [token_bucket(k) for k in (1, 2, 3, 5, 9)]
        [1, 2, 4, 8, 16]
    """
    return 1 << max(0, k - 1).bit_length()


class CompiledForwards:
    """The ``forwards`` part a compile step gives a model's decoder: one :class:`CompiledForward` per module
    (the model, and a speculative draft beside it), sharing one :class:`CompileStats`.

    Args:
        config: the :class:`~infopt.compile.Compile` step.
    """

    def __init__(self, config):
        self.config = config
        self.stats = CompileStats()
        self._told_cold = False
        self._told_eager = False  # one warning per model when a shape falls back to eager, whatever the count
        self.warming = 0  # inside infopt.compile.warmup: shapes compile whatever cold_shapes says

    def __call__(self, model: nn.Module) -> CompiledForward:
        return CompiledForward(model, self)


class CompiledForward(Forward):
    """A :class:`~infopt.generate.forward.Forward` whose fixed-shape calls run compiled graphs.

    ``step`` over a static cache (one-token decode, k-token verify, a draft model's steps) runs one graph per
    ``(batch, token bucket, cache length, padded or not)``; a verify of ``k`` tokens is padded to its
    :func:`token_bucket` (the padding slots are rolled back after the forward). The prompt, and anything over a
    cache that is not static, runs eagerly.
    """

    compiled = True

    def __init__(self, model: nn.Module, owner: CompiledForwards):
        super().__init__(model)
        self.owner = owner
        self.config = owner.config
        self.stats = owner.stats
        self._fns: dict[tuple, Any] = {}
        self._device = next(model.parameters()).device
        self._graphs: dict[tuple, int] = {}  # compiles per shape
        self._eager: set[tuple] = set()  # shapes that run eagerly (their graph did not hold)
        # shapes that have had a graph (warmed, or compiled on first use): compiled again, whatever cold_shapes says,
        # when a change to the model or a length the step fixes drops their graphs
        self._known: set[tuple] = set()
        self._key: tuple | None = None  # the shape being called, for the compiler callback
        # Where shapes compile guard-free (Inductor on CPU), each graph or AOTInductor package keeps the cache length
        # symbolic and serves every whole bucket, and from two rows up the batch too: _class(key), (batch, or 2 for
        # any batch of aot.FREE_BATCH, token bucket, padded) -> the key of the graph made for it, whose length and
        # batch are those it was traced at. torch.export proves a package for every length it declares, or fails; a torch.compile graph keeps the guards on its arguments, so a length its trace fixed recompiles
        # instead of running it. Either way the model fixes the length: _fix_length, one graph per bucket. Not on
        # CUDA, whose graphs are captured per shape.
        self.free_length = self._guard_free()
        self._classes: dict[tuple, tuple] = {}
        self._signature: int | None = None  # module_signature at compile time (module_guards "per_call")
        self.timings: dict[tuple[int, int, int], float] = {}  # (batch, token bucket, cache length) -> seconds
        self.engine_graph: PackedGraph | None = None  # the batching engine's packed step, made on its first call
        # unpadded steps tell the attention layers how many keys they hold (see attention.gqa.KV_LEN_KWARG): with
        # the GQA backend on CPU they then read only those keys, in place, on the C++ kernel
        self._pass_kv_len = (self._device.type == "cpu"
                             and getattr(model.config, "_attn_implementation", None) == GQA_SDPA_IMPL
                             and any(p.kind is inspect.Parameter.VAR_KEYWORD
                                     for p in inspect.signature(type(model).forward).parameters.values())
                             and paged.load_cpu_kernel())

    @property
    def cold_eager(self) -> bool:
        """Whether a call that brings a shape the warm-up did not compile runs it eagerly (``Compile(cold_shapes=
        "eager")``, or ``"auto"`` on a CPU) instead of waiting for its compile."""
        policy = getattr(self.config, "cold_shapes", "compile")
        return policy == "eager" or (policy == "auto" and self._device.type == "cpu")

    def _serves_cold(self, key: tuple) -> bool:
        """Whether this call of shape ``key`` runs eagerly: served after the warm-up, outside a warm-up, under
        :attr:`cold_eager`, and no graph or package is ready for the shape."""
        if not self.stats.warmed_up or self.owner.warming or not self.cold_eager or key in self._known:
            return False
        fn = self._fns.get(key)
        return fn is None or (isinstance(fn, GuardFreeStep) and fn.fn is None)

    def drafts(self, batch: int) -> bool:
        """Whether a speculative call of ``batch`` rows drafts (else it decodes one token per step): always, unless
        cold shapes run eagerly (:attr:`cold_eager`) and the warm-up compiled no verify width for this batch (a
        batch ``warmup_batch_sizes="auto"`` warmed for plain decoding only): drafting would then verify eagerly."""
        if not self.cold_eager or not (self.stats.warmed_up or self.owner.warming):
            return True  # shapes compile on first use (or lazily, with no warm-up)
        # (inside the warm-up too: its calls compile the one-token step of each batch size, its width plan the rest)
        rows = 2 if batch_free(batch, self.free_length) else batch
        return any(b == rows and k > 1 for b, k, _ in self.timings)

    def is_free(self, key: tuple) -> bool:
        """Whether shape ``key``'s graph keeps the cache length symbolic, serving every length that is a multiple of
        the static cache's 256-token bucket (a capped last bucket of another length has a graph of its own), and,
        traced at two rows or more, every batch of :data:`~infopt.compile.aot.FREE_BATCH`."""
        return self.free_length and self._classes.get(_class(key)) == key

    def name(self, key: tuple) -> str:
        """The shape ``key`` in words, as :class:`CompileStats` lists it."""
        return _shape_name(key, self.is_free(key))

    # -- the compiled function ---------------------------------------------------------------------------
    def _forward(self, input_ids, position_ids, cache_position, attention_mask, cache):
        kw = {"logits_to_keep": input_ids.shape[1]} if self.keeps else {}
        if attention_mask is None and self._pass_kv_len:
            kw[KV_LEN_KWARG] = cache_position[-1:] + 1
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                         attention_mask=attention_mask, use_cache=True, **{CACHE_KWARG: cache}, **kw)
        return out.logits[:, -input_ids.shape[1]:].float()

    def _compiler(self, gm: torch.fx.GraphModule, example_inputs):
        key = self._key
        n = self._graphs.get(key, 0) + 1
        # (without fullgraph a graph break makes several graphs per compile, and dynamo runs a shape past its
        # recompile limit eagerly by itself)
        if n > MAX_GRAPHS_PER_SHAPE and self.config.fullgraph:
            raise _GraphNotHeld(f"the decode step recompiled {n - 1} times for one shape")
        self._graphs[key] = n
        if self.is_free(key) and (n > 1 or len(_free_symbols(example_inputs)) < (2 if batch_free(key[0], True) else 1)):
            # a graph that does not serve every length (or batch): it fixed one (the guards on the arguments sent
            # another to a recompile) or traced fewer symbolic sizes than were marked
            raise _LengthFixed("the traced decode step fixes the static cache's length or the batch")
        self._note_cold(key)
        t0 = time.perf_counter()
        cfg = self.config
        if cfg.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs, config_patches=step_options(cfg, self._device))
        else:
            from torch._dynamo.backends.registry import lookup_backend

            fn = lookup_backend(cfg.backend)(gm, example_inputs)
        self.stats.compiles += 1
        self.stats.seconds += time.perf_counter() - t0
        if self.stats.warmed_up:
            self.stats.compiles_after_warmup += 1
        return fn

    def _guard_free(self) -> bool:
        """Whether this forward's shapes compile without dynamo's guards (:class:`GuardFreeStep`): Inductor on
        CPU, one graph per call (``fullgraph``), the per-call module check on, and a torch whose ``torch.compile``
        takes a ``guard_filter_fn``."""
        cfg = self.config
        return (cfg.backend == "inductor" and cfg.fullgraph and cfg.module_guards == "per_call"
                and self._device.type == "cpu"
                and hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"))  # (guard_filter_fn's torch)

    def _wants_aot(self) -> bool:
        """Whether guard-free shapes are built as AOTInductor packages (``Compile(aot=True|"auto")`` on a torch that
        can; :mod:`infopt.compile.aot`)."""
        if getattr(self.config, "aot", False) is False:
            return False
        return aot_available()

    def _build_aot(self, key: tuple, args: tuple):
        """The shape ``key`` as an AOTInductor package for the call ``args`` (exported, compiled or loaded from the
        disk cache), or None where that failed (recorded in the stats; the caller compiles the shape instead)."""
        t0 = time.perf_counter()
        options, fp = step_options(self.config, self._device), fingerprint(self.model)
        lkey = local_key(self, key, args, options, fp)
        step = find_indexed(self.model, lkey)
        if step is None:
            self._note_cold(key)
            log.info("infopt compile: exporting the decode step for %s and building its AOTInductor package (about a "
                     "minute on two cores the first time; cached after)", self.name(key))
        else:  # built earlier on this machine for a model described the same way: no export
            self.stats.compiles += 1
            self.stats.seconds += time.perf_counter() - t0
            self.stats.aot += 1
            self.stats.aot_cached += 1
            self.stats.aot_indexed += 1
            if self.stats.warmed_up:
                self.stats.compiles_after_warmup += 1
            return step
        try:
            step, seconds, cached = aot.export_step(self, key, args, options, fp)
            index_package(self.model, step, lkey)
        except Exception as e:  # noqa: BLE001 - export or AOTInductor refusing a model: torch.compile serves it
            if self.is_free(key):  # one package per length, or torch.compile's graph per length where export fails
                raise _LengthFixed(f"the step exported with a symbolic cache length failed: {type(e).__name__}: "
                                   f"{(str(e).strip().splitlines() or [''])[0][:200]}") from e
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            self.stats.aot_failed[self.name(key)] = reason
            log.warning("infopt compile: the decode step for %s could not be built with AOTInductor (%s); it runs "
                        "torch.compile's graph instead", self.name(key), reason)
            return None
        self.stats.compiles += 1
        self.stats.seconds += seconds
        self.stats.aot += 1
        self.stats.aot_cached += int(cached)
        if self.stats.warmed_up:
            self.stats.compiles_after_warmup += 1
        return step

    def _note_cold(self, key: tuple) -> None:
        """Say that a call waits for a compile: every time after the warm-up (each is a stall the user sees), with the
        remedy the first time."""
        if not self.stats.warmed_up:
            return
        if not self.owner._told_cold:
            self.owner._told_cold = True
            log.warning("compiling the decode step for a shape the warm-up did not cover (%s): this call waits for "
                        "the compile once; list the batch sizes and lengths your calls use in Compile("
                        "warmup_batch_sizes=..., warmup_lengths=...) to compile them while the recipe is applied%s",
                        self.name(key), " (on CPU one shape serves every batch of 2-32 and every cache length: "
                        "warmup_batch_sizes=[1, 2] covers them)" if self.free_length else "")
        else:
            log.warning("compiling the decode step for another shape the warm-up did not cover (%s): this call waits "
                        "for it", self.name(key))

    def _note_cold_eager(self, key: tuple) -> None:
        """Say, once per shape (the first time with the remedy), that a call runs a shape the warm-up did not compile
        eagerly."""
        name = self.name(key)
        if name in self.stats.cold_shapes:
            return
        self.stats.cold_shapes.append(name)
        if len(self.stats.cold_shapes) == 1:
            log.warning("a call brought a decode shape the warm-up did not compile (%s): it decodes eagerly (the same "
                        "model without the compiled speed-up) rather than wait for a compiler. To compile it while "
                        "the recipe is applied, list its batch size and length in Compile(warmup_batch_sizes=..., "
                        "warmup_lengths=...)%s; Compile(cold_shapes='compile') compiles such shapes on first use "
                        "instead", name, " (on CPU warmup_batch_sizes: auto covers every batch of 2-32 and every "
                        "cache length)" if self.free_length else "")
        else:
            log.warning("another decode shape the warm-up did not compile (%s) decodes eagerly", name)

    def _compiled(self, key: tuple):
        fn = self._fns.get(key)
        if fn is None and self._guard_free():
            if self._signature is None:
                self._signature = module_signature(self.model)
            fn = self._fns[key] = GuardFreeStep(self, key)
            self.stats.shapes.append(self.name(key))
            return fn
        return fn if fn is not None else self._guarded(key)

    def _guarded(self, key: tuple):
        """The shape ``key`` compiled by ``torch.compile`` with dynamo's guards (on the modules too, unless
        ``module_guards="per_call"``), kept in ``_fns``."""
        fn = self._fns.get(key)
        if fn is None or isinstance(fn, GuardFreeStep):
            b, k, length, padded = key
            kw = {}
            skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
            if self.config.module_guards == "per_call" and skip is not None:
                # dynamo's guards on the modules' attributes (every parameter's metadata, flags, config) cost about
                # 1.3 ms per token on a 2-core CPU for a 30-layer model; prefill() checks the same once per call
                kw["options"] = {"guard_filter_fn": skip}
                if self._signature is None:
                    self._signature = module_signature(self.model)
            fn = isolated_compile(self._forward, name=f"step_b{b}_k{k}_l{'any' if self.is_free(key) else length}_"
                                  f"{'padded' if padded else 'unpadded'}", backend=weak_backend(self),
                                  fullgraph=self.config.fullgraph, dynamic=self.config.dynamic, **kw)
            if self.is_free(key):
                fn = _marking(fn)
            if key not in self._fns:
                self.stats.shapes.append(self.name(key))
            self._fns[key] = fn
        return fn

    def prefill(self, input_ids, position_ids, attention_mask, cache, keep: int = 1) -> torch.Tensor:
        # once per call, before its compiled steps: with dynamo's per-token module guards off (module_guards
        # "per_call"), a change they would have caught (a parameter's dtype, shape or device, a module's training
        # flag, a hook, the config) drops the compiled graphs here, so the next step compiles for the new state
        if self._signature is not None:
            now = module_signature(self.model)
            if now != self._signature:
                log.info("the model changed since its decode step was compiled (a parameter's dtype, shape or "
                         "device, a training flag, a hook or the config): compiling it again")
                self._fns.clear()
                self._graphs.clear()
                self._classes.clear()
                self._signature = now
        return super().prefill(input_ids, position_ids, attention_mask, cache, keep)

    def width(self, k: int) -> int:
        """The width of the graph a ``k``-token step runs: the narrowest width the warm-up timed that holds ``k``
        tokens (its plan leaves some out: :data:`MIN_VERIFY_WIDTH`), else ``k``'s :func:`token_bucket`.

        Example:
            >>> from infopt.compile import Compile
            >>> from infopt.models import tiny_model
            >>> fwd = CompiledForwards(Compile())(tiny_model())
            >>> fwd.width(3)  # nothing warmed: the token bucket
            4
            >>> fwd.timings[(1, 1, 256)] = fwd.timings[(1, 8, 256)] = 0.01  # as a warm-up of widths 1 and 8 leaves
            >>> [fwd.width(k) for k in (1, 2, 8, 9)]
            [1, 8, 8, 16]
        """
        warmed = [w for _, w, _ in self.timings if w >= k]
        return min(warmed) if warmed else token_bucket(k)

    def step_seconds(self, batch: int, k: int, length: int) -> float | None:
        """The warm-up's median time of the unpadded graph a ``k``-token step runs (:meth:`width`): at this cache
        length, or where one graph serves every length, at the nearest length the warm-up timed."""
        kb = self.width(k)
        t = self.timings.get((batch, kb, length))
        if t is None and self.free_length:
            near = sorted((abs(n - length), n) for b, w, n in self.timings if (b, w) == (batch, kb))
            t = self.timings[(batch, kb, near[0][1])] if near else None
        return t

    def step(self, input_ids, position_ids, cache_position, attention_mask, cache, first: int | None = None
             ) -> torch.Tensor:
        length = static_length(cache)
        B, k = input_ids.shape
        kb = self.width(k)
        start = first if first is not None else int(cache_position[0])  # (a GPU sync when not given)
        if length is None or kb > MAX_TOKENS or start + kb > length:  # not a decode shape (or no room to pad): eager
            return super().step(input_ids, position_ids, cache_position, attention_mask, cache, first)
        pad = kb - k
        if pad:  # [B, kb]: the last token repeated at the next positions; its slots are rolled back below
            more = torch.arange(1, pad + 1, device=input_ids.device)
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, pad)], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + more], dim=1)
            cache_position = torch.cat([cache_position, cache_position[-1:] + more])
        if attention_mask is None and batch_free(B, self.free_length):
            # several rows, none padded: the padded graph on a mask of ones, so that one graph serves every batch
            attention_mask = input_ids.new_ones(B, length)
        if attention_mask is not None and attention_mask.shape[1] != length:  # [B, length]: one width per graph
            wide = attention_mask.new_ones(B, length)
            w = min(length, attention_mask.shape[1])
            wide[:, :w] = attention_mask[:, :w]
            attention_mask = wide
        key = (B, kb, length, attention_mask is not None)
        if self.free_length and length % BUCKET == 0:
            key = self._classes.setdefault(_class(key), key)
        args = (input_ids, position_ids, cache_position, attention_mask, cache)
        out = self._run(key, args)
        if pad:
            rollback(cache, pad)
            out = out[:, :k]
        return out

    def packed(self, input_ids, position_ids, keep, paged_step, *, eager: bool = False) -> torch.Tensor:
        """The batching engine's step through two graphs with dynamic shapes (:class:`PackedGraph`), or eagerly: with
        ``eager`` (the first step allocates the KV pools), and for good once compiling failed (said once)."""
        graph = self.engine_graph
        if graph is None and not eager:
            graph = self.engine_graph = PackedGraph(self.model, keeps=self.keeps, stats=self.stats)
        if eager or graph.failed is not None:
            self.stats.eager_calls += 1
            return super().packed(input_ids, position_ids, keep, paged_step)
        try:
            return graph(input_ids, position_ids, head_rows(keep) if self.keeps else None, paged_step)
        except Exception as e:
            if not is_compile_error(e):
                raise
            logits = super().packed(input_ids, position_ids, keep, paged_step)  # raises if the forward is at fault
            graph.disable(e)
            return logits

    def _run(self, key: tuple, args: tuple) -> torch.Tensor:
        """The step ``args`` through shape ``key``'s graph (compiled on its first call), or eagerly where it cannot
        hold one."""
        if key in self._eager:
            self.stats.eager_calls += 1
            return self._forward(*args)
        if self._serves_cold(key):
            self._note_cold_eager(key)
            self.stats.cold_eager_calls += 1
            return self._forward(*args)
        self._known.add(key)
        fn = self._compiled(key)
        self._key = key
        try:
            out = fn(*args)
            self.stats.calls += 1
            return out
        except Exception as e:  # noqa: BLE001 - see below; an error the eager step shares is raised by it
            if self.is_free(key) and _specialized(e):  # the model fixes the cache length: a graph per length
                self._fix_length(key, e)
                B, kb = args[0].shape
                return self._run((B, kb, static_length(args[4]), args[3] is not None), args)
            # Not only dynamo's own exceptions: a trace can stop on a data-dependent shape
            # (GuardOnDataDependentSymNode, a RuntimeError), inductor on a kernel it cannot build. Dynamo traces
            # without running the model, and a graph that failed while running wrote the static cache only at
            # this step's positions, which the eager step writes again: run this step eagerly, and this shape
            # from now on. A failed compile never fails the user's call.
            self._fall_back(key, e)
            self.stats.eager_calls += 1
            return self._forward(*args)

    def _fix_length(self, key: tuple, error: BaseException) -> None:
        """Compile one graph per cache length and batch from now on: the model's step fixes the length or the batch
        (a trace that keeps them symbolic failed on it)."""
        name = self.name(key)
        if name in self.stats.shapes:
            self.stats.shapes.remove(name)
        self.free_length = False
        self._classes.clear()
        self._fns.pop(key, None)
        self._graphs.pop(key, None)
        log.info("the decode step of %s depends on the static cache's length or the batch (%s: %s); it compiles one "
                 "graph per batch size and 256-token cache bucket", type(self.model).__name__, type(error).__name__,
                 (str(error).strip().splitlines() or [""])[0][:200])

    def _fall_back(self, key: tuple, error: BaseException) -> None:
        self._eager.add(key)
        self._fns.pop(key, None)
        cause = error
        while not isinstance(cause, _GraphNotHeld):  # the backend's error, unwrapped from dynamo's
            inner = getattr(cause, "inner_exception", None) or cause.__cause__
            if inner is None:
                break
            cause = inner
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        self.stats.eager_shapes[self.name(key)] = f"{type(cause).__name__}: {reason}"
        if self.owner._told_eager:  # the model's one warning was given; the stats list every shape
            log.info("the decode step for %s could not hold a compiled graph (%s: %s); it decodes eagerly",
                     self.name(key), type(cause).__name__, reason[:200])
            return
        self.owner._told_eager = True
        warnings.warn(f"infopt compile: the decode step for {self.name(key)} could not hold a compiled graph "
                      f"({type(cause).__name__}: {reason[:200]}); that shape now decodes eagerly (same tokens, "
                      "without the compiled speed-up), as will any other shape that cannot, without another "
                      "warning. compile_stats(model).eager_shapes lists such shapes",
                      RuntimeWarning, stacklevel=4)


def _marking(fn):
    """``fn`` (a guarded ``torch.compile`` of the step) with the cache length (and over two rows the batch) marked
    dynamic for each call's trace: dynamo then keeps them symbolic, so another length passes the guards instead of
    recompiling."""

    def call(*args):
        mark_free_sizes(args)
        return fn(*args)

    return call


def _class(key: tuple) -> tuple:
    """The shapes one free graph serves: ``key`` without its cache length, its batch as 2 where a graph serves every
    batch of :data:`~infopt.compile.aot.FREE_BATCH`."""
    return 2 if batch_free(key[0], True) else key[0], key[1], key[3]


class _LengthFixed(RuntimeError):
    """Raised by the compiler callback when a step traced to keep the cache length symbolic came out fixing it."""


def _free_symbols(example_inputs) -> set:
    """The symbols still free in the graph inputs' sizes once the trace's guards are applied (a size the trace fixed
    to one value reads as that value): one per size the graph keeps symbolic."""
    out = set()
    for x in example_inputs:
        sizes = [x] if isinstance(x, torch.SymInt) else list(x.shape) if isinstance(x, torch.Tensor) else []
        for d in sizes:
            if isinstance(d, torch.SymInt) and d.node.maybe_as_int() is None:
                out |= d.node.expr.free_symbols
    return out


def _specialized(error: BaseException) -> bool:
    """Whether a compile failed because the traced step fixes a size it was asked to keep symbolic (the cache length:
    dynamo's and ``torch.export``'s constraint violations)."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, (ConstraintViolationError, _LengthFixed)) or "Constraints violated" in text or (
                "marked" in text and "dynamic" in text and "specializ" in text):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False
