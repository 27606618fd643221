"""The ``compile`` recipe stage: ``torch.compile`` of the decode step over the static KV cache, warmed up, or of the
batching engine's step."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from ..attention.backends import set_backend_
from ..core.errors import IncompatibleModelError
from ..core.introspect import inspect_model
from ..core.patch import record_custom
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import Forward, decoder_for, rollback, set_part, uncounted
from ..kvcache.static import BUCKET, StaticCaches, bucket_length, static_max_length
from .aot import FREE_BATCH, aot_available
from .decoder import MIN_VERIFY_WIDTH, CompiledForwards, CompileStats, compile_stats, token_bucket
from .saved import warmup_skipped

__all__ = ["Compile", "compile_", "warmup", "engine_forward", "auto_batch_sizes"]

_MODES = ("default", "reduce-overhead", "max-autotune")
COLD_SHAPES = ("auto", "eager", "compile")


def _cxx_compiler() -> str | None:
    """Path of the C++ compiler inductor would use on CPU ($CXX, g++, clang++, c++), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _positive_ints(obj, name: str, value, auto: bool = False) -> None:
    if auto and value == "auto":
        return
    if not isinstance(value, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                               for x in value):
        raise bad_field(obj, name, value, ("auto or " if auto else "") + "a list of positive integers (empty: no "
                        "warm-up)")


@register_step
@dataclass(frozen=True)
class Compile(StepConfig):
    """Compile the one-token decode step with ``torch.compile`` over the static KV cache.

    The prompt runs eagerly and every decode token runs one compiled graph: one graph per
    ``(batch size, padded or not)`` that keeps the cache length symbolic and so serves every 256-token cache bucket
    (with Inductor on CPU; per ``(batch size, cache bucket, padded or not)`` otherwise, or where the model's step fixes
    the length). The warm-up compiles the listed shapes while the
    recipe is applied, so calls that use them never wait for a compile;
    :func:`infopt.compile.compile_stats` counts the graphs compiled, and those compiled after the
    warm-up. Needs ``kvcache.Static`` (its 256-token buckets are the cache lengths), except beside a ``batching``
    step: then the engine's steps are compiled instead (:func:`engine_forward`: two graphs with dynamic shapes over
    its paged cache, warmed when the engine is made, with this step's ``pack_linears`` and ``fuse_projections``).

    Args:
        mode: ``default``; ``reduce-overhead`` (CUDA graphs, CUDA only); ``max-autotune`` (benchmarks
            kernel choices while compiling: slow to compile).
        fullgraph: fail on a graph break instead of splitting the decode step.
        dynamic: let the compiler generalise over shapes.
        backend: ``inductor``; ``eager`` or ``aot_eager`` for debugging.
        cpp_wrapper: inductor's C++ wrapper around the kernels: less Python per token, but each
            graph takes minutes to compile on a small CPU.
        warmup_batch_sizes: batch sizes compiled at apply time, or ``"auto"``: batch 1, and on a CPU, where one
            graph serves every batch of 2-32 rows and every cache length, that graph too (so no call of up to 32
            rows meets a shape the warm-up left out); a speculative step's verify widths and draft steps are
            warmed for batch 1 only, and a batch of rows decodes without drafting (:meth:`CompiledForward.drafts
            <infopt.compile.decoder.CompiledForward.drafts>`). A listed batch size warms its widths too.
        warmup_lengths: call lengths (prompt + new tokens) compiled at apply time; each stands for
            its 256-token cache bucket (capped at the static cache's ``max_length``). Empty: compile
            lazily on the first call of each shape.
        cold_shapes: what a call does with a decode shape the warm-up did not compile: ``"eager"`` runs it eagerly
            (the same model, without the compiled speed-up: the call never waits for a compiler), ``"compile"``
            compiles it on first use (that call waits, once per shape: a minute or more on a small CPU);
            ``"auto"``: eager on a CPU, compile on other devices. Each is logged; :class:`CompileStats
            <infopt.compile.decoder.CompileStats>` counts them (``cold_eager_calls``, ``compiles_after_warmup``).
        pack_linears: run the model's fp32 (or bf16) ``nn.Linear`` layers on oneDNN's prepacked weights
            (:mod:`infopt.compile.packed`: 1.5-4x faster fp32 linears at decode widths on the CPUs measured, and
            bf16 ones without a weight reorder per call; the packed copy costs the layers' size in memory).
            ``"auto"``: on a CPU model in fp32, or in bf16 where oneDNN runs bf16 matmuls, with a torch build that
            has them; ``True`` insists (an error where unavailable); ``False`` never.
        fuse_projections: one matmul for each attention layer's q/k/v and each gated MLP's gate/up projections
            (:mod:`infopt.compile.fuse`: the layers' weights move into one buffer, no copy; five matmuls per
            decoder layer become two). ``"auto"`` and ``True``: every group of plain ``nn.Linear`` layers;
            ``False``: none.
        module_guards: when the model's modules are checked for changes a compiled graph depends on (a
            parameter's dtype, shape or device, training flags, hooks, config values). ``"per_call"``: once per
            ``generate`` call, by infopt, before the prompt (dynamo's own module guards, evaluated every token,
            are skipped: about 1.3 ms per token on a 2-core CPU), and on CPU Inductor's size asserts in the
            generated step too (:func:`infopt.compile.decoder.step_options`); ``"per_token"``: dynamo's guards
            on every step.
        aot: build each decode shape as an AOTInductor package (:mod:`infopt.compile.aot`: the model's forward
            exported with ``torch.export`` and compiled into a shared library whose wrapper is C++, reading the
            model's own weights, no copy; cached on disk, so a second process loads it in seconds). On a 2-core CPU
            ``cpu-fast`` decodes 1.15-1.3x faster than with ``torch.compile``'s Python wrapper. Needs Inductor on
            CPU, ``fullgraph`` and ``module_guards="per_call"``. ``"auto"``: where those hold and torch can
            (``torch.export`` and a runner that takes the caller's weights); ``True``: insists (an error where it
            cannot); ``False``: never. A shape whose export fails runs ``torch.compile``'s graph, with a warning.

    Raises:
        RecipeError: an unknown mode or backend, or bad warm-up sizes.

    Example:
        >>> Compile(mode="default").to_dict()["compile"]["mode"]
        'default'
    """

    stage: ClassVar[str] = "compile"
    # the original weights in their dtype: fused kernels reorder floating-point sums (as tensor parallelism does),
    # nothing is rounded to a lower precision; tests check greedy output token-identical to plain generate
    fidelity: ClassVar[str] = "lossless"  # fused, generated kernels: sums in another order
    mode: str = "default"
    fullgraph: bool = True
    dynamic: bool = False
    backend: str = "inductor"
    cpp_wrapper: bool = False
    warmup_batch_sizes: tuple[int, ...] | str = (1,)
    warmup_lengths: tuple[int, ...] = (256,)
    cold_shapes: str = "auto"
    pack_linears: bool | str = "auto"
    fuse_projections: bool | str = "auto"
    module_guards: str = "per_call"
    aot: bool | str = False

    def __post_init__(self):
        if self.mode not in _MODES:
            raise bad_field(self, "mode", self.mode, ", ".join(_MODES))
        if self.backend not in ("inductor", "eager", "aot_eager"):
            raise bad_field(self, "backend", self.backend, "inductor, eager, aot_eager")
        for name in ("fullgraph", "dynamic", "cpp_wrapper"):
            if not isinstance(getattr(self, name), bool):
                raise bad_field(self, name, getattr(self, name), "true or false")
        _positive_ints(self, "warmup_batch_sizes", self.warmup_batch_sizes, auto=True)
        if self.cold_shapes not in COLD_SHAPES:
            raise bad_field(self, "cold_shapes", self.cold_shapes, ", ".join(COLD_SHAPES))
        _positive_ints(self, "warmup_lengths", self.warmup_lengths)
        if self.pack_linears not in (True, False, "auto"):
            raise bad_field(self, "pack_linears", self.pack_linears, "auto, true or false")
        if self.fuse_projections not in (True, False, "auto"):
            raise bad_field(self, "fuse_projections", self.fuse_projections, "auto, true or false")
        if self.module_guards not in ("per_call", "per_token"):
            raise bad_field(self, "module_guards", self.module_guards, "per_call, per_token")
        if self.aot not in (True, False, "auto"):
            raise bad_field(self, "aot", self.aot, "auto, true or false")

    def check(self, model, info, steps):
        # beside batching a failed compile leaves the engine's steps eager, with a warning (as without a compiler)
        engine = any(s.stage == "batching" for s in steps)
        if self.backend == "inductor" and info.device.type == "cpu" and _cxx_compiler() is None and not engine:
            raise IncompatibleModelError(
                "compile with the inductor backend on CPU builds C++ kernels and needs a C++ compiler; none was found "
                "(g++, clang++ or $CXX). Install one (e.g. apt-get install g++), or use backend 'eager' / leave "
                "the compile step out"
            )
        if self.mode == "reduce-overhead" and info.device.type != "cuda":
            raise IncompatibleModelError(
                f"compile mode 'reduce-overhead' uses CUDA graphs; the model is on {info.device}. "
                "Use mode 'default' (or 'max-autotune') on CPU"
            )
        if self.aot is True:
            why = [w for w, bad in (
                (f"the model is on {info.device.type}, not the CPU", info.device.type != "cpu"),
                (f"backend is {self.backend!r}, not 'inductor'", self.backend != "inductor"),
                ("fullgraph is false", not self.fullgraph),
                (f"module_guards is {self.module_guards!r}, not 'per_call'", self.module_guards != "per_call"),
                (f"torch {torch.__version__} lacks torch.export or an AOTInductor runner that takes the caller's "
                 "weights", not aot_available())) if bad]
            if why:
                raise IncompatibleModelError(
                    f"Compile(aot=True) builds AOTInductor packages on CPU only where the step compiles guard-free: "
                    f"{'; '.join(why)}. Use aot: auto (packages where possible) or aot: false")
        static = next((s for s in steps if s.stage == "kvcache" and s.kind == "static"), None)
        fixed = getattr(static, "batch_size", None)
        if fixed is not None and self.warmup_batch_sizes != "auto" and any(b != fixed for b in self.warmup_batch_sizes):
            raise IncompatibleModelError(
                f"compile warmup_batch_sizes {list(self.warmup_batch_sizes)} differ from kvcache.Static(batch_size="
                f"{fixed}), the only batch size the static cache serves; use warmup_batch_sizes: [{fixed}]"
            )
        return []


def compile_(model: nn.Module, config: Compile | None = None, *, step: str | None = None) -> CompiledForwards:
    """Run ``model``'s fixed-shape decode forwards compiled (undo restores eager decoding).

    Every loop of ``model.generate`` calls one forward: the one-token decode of the greedy/sampling loop, the
    k-token verify and the draft model's steps of speculative decoding. Over a static cache
    (``kvcache.Static``) those calls have fixed shapes and run compiled graphs; calls that
    ``transformers``' own loop serves (logits processors, penalties) stay eager. Does not warm up: see
    :func:`warmup`.

    Returns:
        The :class:`~infopt.compile.decoder.CompiledForwards` (its ``stats`` count the compiles).
    """
    config = config or Compile()
    forwards = CompiledForwards(config)
    set_part(model, "forwards", forwards, step=step or config.key)  # undo drops it, and its graphs with it
    return forwards


ENGINE_PACK_ROWS = 64
"""The row count the batching engine's eager steps pack their weights for (oneDNN's blocking; any count runs)."""


def engine_forward(model: nn.Module, compile: bool | Compile, pack: bool | None = None, *,
                   step: str | None = "batching") -> tuple[Forward, int]:
    """The :class:`~infopt.generate.Forward` a batching engine's steps call, its model prepared for it.

    Compiled (``compile`` True, or a :class:`Compile` step's settings): the model's compiled forward (its compile
    step's, else one made here, whose graphs count in its own :class:`~infopt.compile.decoder.CompileStats`), its
    q/k/v and gate/up projections fused into one matmul each (:mod:`infopt.compile.fuse`; not with
    ``fuse_projections: false``); its ``packed`` step compiles on first use. Eager: :class:`~infopt.generate.Forward`.
    Packed (``pack``; None: the step's ``pack_linears``, ``auto`` where :func:`~infopt.compile.packed.can_pack_model`):
    every linear of the model's dtype on a prepacked weight, scoped to the engine's steps
    (:func:`~infopt.compile.packed.pack_linears_`): other calls of the model keep the plain weights. Each change is
    recorded, so :func:`infopt.undo` restores the model.

    Args:
        model: the engine's model.
        compile: compile the step (True: :class:`Compile`'s defaults).
        pack: pack the linears (True: the caller checked :func:`~infopt.compile.packed.can_pack_model`).
        step: the recipe step the changes are recorded under.

    Returns:
        The forward, and how many linears (and fused groups) were packed.
    """
    from ..ops.packed_linear import PACK_ROWS
    from . import fuse, packed

    config = Compile() if compile is True else (compile or None)
    if pack is None:
        wanted = config.pack_linears if config is not None else "auto"
        pack = packed.can_pack_model(model) if wanted == "auto" else bool(wanted)
    layers = []
    if config is not None and config.fuse_projections is not False:
        groups = fuse.fuse_projections_(model)
        if groups:
            record_custom(model, f"{len(groups)} fused projection groups for the compiled engine step",
                          lambda: fuse.unfuse_projections_(groups), step=step)
    if pack:
        dtype = next(model.parameters()).dtype
        rows = PACK_ROWS if config is not None else ENGINE_PACK_ROWS
        layers = packed.pack_linears_(model, min_elements=0, dtypes=(dtype,), rows=rows, scoped=True)
        if layers:
            record_custom(model, f"{len(layers)} linears on prepacked weights for the engine's steps",
                          lambda: packed.unpack_linears_(layers), step=step)
    if config is None:
        return Forward(model, packed_weights=pack), len(layers)
    dec = decoder_for(model)
    if dec is not None and isinstance(dec.forwards, CompiledForwards):
        return dec.forward_for(model), len(layers)
    return CompiledForwards(config)(model), len(layers)


@torch.no_grad()
def warmup(model: nn.Module, *, batch_sizes: tuple[int, ...] | str = (1,), lengths: tuple[int, ...] = (256,),
           padded: bool = False) -> CompileStats:
    """Compile the decode graphs that calls of these batch sizes and lengths will use.

    Each length stands for its 256-token static-cache bucket; a call whose prompt + new tokens fall in
    a warmed bucket, with a warmed batch size, never compiles. ``padded`` also warms the graphs for
    left-padded batches (an ``attention_mask`` with zeros). With speculative decoding in the recipe, every
    verify width bucket and the draft's one- and two-token steps are compiled directly on the caches real
    calls reuse (a warm-up call's drafts need not reach every width). ``batch_sizes="auto"``: batch 1, and
    where one graph serves every batch of 2-32 rows (Inductor on a CPU), that graph, with the speculative widths
    for batch 1 only (:func:`auto_batch_sizes`). The warm-up compiles whatever ``Compile(cold_shapes=...)`` says.
    Warm-up calls are not counted in :func:`~infopt.generate.routing_stats`.

    Returns:
        The model's :class:`~infopt.compile.decoder.CompileStats` (``warmed_up`` set).

    Raises:
        ValueError: ``model`` has no ``compile`` step.
    """
    stats = compile_stats(model)
    if stats is None:
        raise ValueError("the model has no compile step; optimize it with a recipe containing compile first")
    limit = static_max_length(model)
    if limit is None:
        raise ValueError("the model has no static KV cache (kvcache.Static), which compiled decoding runs on")
    device = next(model.parameters()).device
    token = model.generation_config.bos_token_id
    token = 0 if token is None or isinstance(token, list) else int(token)
    spec = decoder_for(model).speculative is not None
    new = 3  # two decode steps: the second shows a call of the same shape does not compile again
    cache_lengths = [bucket_length(min(n, limit), limit) for n in lengths]
    if limit % BUCKET and decoder_for(model).forward_for(model).free_length and limit not in cache_lengths:
        # one graph serves every whole 256-slot bucket; a max_length that is no multiple of 256 caps the last bucket
        # at a length of its own, which needs its own graph: warmed too, so no call meets it cold
        lengths, cache_lengths = (*lengths, limit), [*cache_lengths, limit]
    width_batches = batch_sizes
    if batch_sizes == "auto":
        batch_sizes, width_batches = auto_batch_sizes(model), (1,)
    plan = _width_plan(model, width_batches, cache_lengths) if spec else []
    calls = len(batch_sizes) * len(lengths) * (2 if padded else 1)
    # a cold compile of a real model takes seconds to minutes per graph (inductor caches them on disk after)
    bar = tqdm(total=calls + len(plan), desc="infopt compile: warming decode graphs", unit="shape")
    forwards = decoder_for(model).forwards
    forwards.warming += 1  # the warm-up compiles, whatever Compile(cold_shapes=...) says of calls
    try:
        with uncounted(model):
            for b in batch_sizes:
                for length in lengths:
                    cache = bucket_length(min(length, limit), limit)
                    start = cache - ((cache - 1) % BUCKET + 1)  # calls longer than this land in the bucket
                    prompt = max(1, min(start + 1, cache - new))
                    for pad in (False, True) if padded else (False,):
                        ids = torch.full((b, prompt), token, dtype=torch.long, device=device)
                        mask = torch.ones_like(ids)
                        if pad:
                            mask[0, 0] = 0
                        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False, pad_token_id=token)
                        bar.update()
        _warm_widths(model, plan, token, bar.update)
    finally:
        forwards.warming -= 1
        bar.close()
    stats.warmed_up = True
    return stats


def auto_batch_sizes(model: nn.Module) -> tuple[int, ...]:
    """The batch sizes ``warmup_batch_sizes="auto"`` compiles for ``model``: ``(1, 2)`` where its step compiles
    one graph for every batch of :data:`~infopt.compile.aot.FREE_BATCH` (guard-free, on a CPU; the graph traced at
    two rows), else ``(1,)``; the static cache's own batch size where it fixes one."""
    fixed = getattr(getattr(decoder_for(model).cache, "config", None), "batch_size", None)
    if fixed is not None:
        return (fixed,)
    return (1, FREE_BATCH[0]) if decoder_for(model).forward_for(model).free_length else (1,)


def _width_plan(model: nn.Module, batch_sizes, cache_lengths) -> list[tuple[nn.Module, int, int, list[int]]]:
    """``(module, batch, cache length, widths)`` for every verify width a speculative round can use (one graph per
    token bucket, none narrower than :data:`~infopt.compile.decoder.MIN_VERIFY_WIDTH` but the one-token step) and
    the draft model's one- and two-token steps; empty without a static cache."""
    dec = decoder_for(model)
    if not isinstance(dec.cache, StaticCaches):
        return []
    part = dec.speculative
    targets = [(model, sorted({1} | {max(MIN_VERIFY_WIDTH, token_bucket(k)) for k in range(2, part.config.cap + 2)}))]
    draft = getattr(part.drafter, "draft", None)
    if draft is not None:
        targets.append((draft, [1, 2]))  # a draft step, and a catch-up after a fully accepted round
    return [(mod, b, length, widths) for mod, widths in targets for b in batch_sizes for length in cache_lengths]


def _warm_widths(model: nn.Module, plan, token: int, done=lambda: None) -> None:
    """Compile the widths of :func:`_width_plan` by calling the forwards directly on the static caches real calls
    will reuse, and time each graph (the speculative loop's draft-length choice reads the timings)."""
    dec = decoder_for(model)
    device = next(model.parameters()).device
    for mod, b, length, widths in plan:
        fwd = dec.forward_for(mod)
        cache = dec.cache.cache_for(mod, b, length)  # the allocation real calls of this shape reuse
        ids = torch.full((b, 1), token, dtype=torch.long, device=device)
        fwd.prefill(ids, torch.zeros_like(ids), None, cache)
        for k in widths:
            if 1 + k > length:
                continue
            pos = torch.arange(1, 1 + k, device=device)
            # contiguous, as the loops pass them: a graph is specialised on strides
            args = (ids.expand(b, k).contiguous(), pos.expand(b, k).contiguous(), pos, None, cache)
            fwd.step(*args)
            rollback(cache, k)
            # on a CPU a compiled verify of 2..16 tokens costs about the same, where an eager estimate grows with k
            fwd.timings[(b, k, length)] = _median_seconds(fwd.step, args, k, device)
        done()


def _median_seconds(step, args: tuple, k: int, device: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``step(*args)`` (a ``k``-token step on the cache ``args[-1]``, rolled back after each
    run)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step(*args)  # a graph's second call may still compile (its guards see the cache filled once)
    rollback(args[-1], k)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step(*args)
        sync()
        times.append(time.perf_counter() - t0)
        rollback(args[-1], k)
    return sorted(times)[len(times) // 2]


def _fuse(model: nn.Module, config: Compile, ctx: ApplyContext) -> None:
    """Queue the fusion of the model's q/k/v and gate/up projections (after every step is applied, as packing: a
    self draft copies the original layers first), before packing and the warm-up."""
    if config.fuse_projections is False:
        return
    from . import fuse

    def run():
        groups = fuse.fuse_projections_(model)
        if groups:
            record_custom(model, f"{len(groups)} fused projection groups", lambda: fuse.unfuse_projections_(groups),
                          step=config.key)
            ctx.notes.append(f"{len(groups)} projection groups fused (q/k/v, gate/up): one matmul each")

    ctx.after.append(run)


def _pack(model: nn.Module, config: Compile, ctx: ApplyContext, info) -> None:
    """Queue the packing of the model's fp32 linears (after every step is applied: a self draft copies and
    quantizes the original layers first), before the warm-up compiles the graphs that call them."""
    from ..ops.packed_linear import can_pack, can_pack_dtype
    from . import packed

    if config.pack_linears is False:
        return
    wanted = info.device.type == "cpu" and can_pack_dtype(info.dtype)
    if config.pack_linears is True and not wanted:
        raise IncompatibleModelError(
            f"Compile(pack_linears=True) needs an fp32 model on CPU (or bf16 on a CPU whose oneDNN runs bf16 "
            f"matmuls) and a torch build with oneDNN (model: {info.dtype} on {info.device.type}; oneDNN prepacked "
            f"linear available: {can_pack()}); use pack_linears: auto")
    if not wanted:
        return
    dtype = info.dtype
    name = "fp32" if dtype == torch.float32 else "bf16"

    def pack():
        layers = packed.pack_linears_(model, dtypes=(dtype,))
        if layers:
            record_custom(model, f"{len(layers)} {name} linears on prepacked weights",
                          lambda: packed.unpack_linears_(layers), step=config.key)
            ctx.notes.append(f"{len(layers)} {name} linears run on oneDNN prepacked weights (+"
                             f"{packed.packed_bytes(layers) / 2**20:.0f} MiB beside the originals)")

    ctx.after.append(pack)


@register_transform(Compile)
def _apply(model: nn.Module, config: Compile, ctx: ApplyContext) -> None:
    info = ctx.info or inspect_model(model)
    if any(s.stage == "batching" for s in ctx.steps):
        # the engine's steps: the batching step makes the engine on this forward (engine_forward fuses and packs)
        # and its warm-up compiles the step's two graphs
        compile_(model, config)
        ctx.notes.append("the batching engine's steps compiled by Inductor with dynamic shapes (two graphs, warmed "
                         "when the engine is made)")
        return
    if model.config._attn_implementation == "sdpa" and info.device.type == "cpu" and info.gqa_groups > 1:
        set_backend_(model, "sdpa_gqa", step=config.key)
        ctx.notes.append("attention sdpa -> sdpa_gqa: grouped K/V heads reach the CPU kernel unrepeated (a compiled "
                         "step would otherwise copy the cache once per query group, every layer and token)")
    compile_(model, config)
    _fuse(model, config, ctx)
    _pack(model, config, ctx, info)
    if ctx.rebuild and warmup_skipped():
        return  # infopt.load warms up (or loads trusted steps) once the saved weights are in, and notes which
    if not (config.warmup_batch_sizes and config.warmup_lengths):
        ctx.notes.append(f"decode step compiled lazily (mode={config.mode}, backend={config.backend}); "
                         "the first call of each shape compiles")
        return

    def warm():
        t0 = time.perf_counter()
        stats = warmup(model, batch_sizes=config.warmup_batch_sizes, lengths=config.warmup_lengths)
        wall = time.perf_counter() - t0
        batches = config.warmup_batch_sizes
        batches = f"auto {list(auto_batch_sizes(model))}" if batches == "auto" else list(batches)
        cold = ("run eagerly (never waiting for a compiler)" if decoder_for(model).forward_for(model).cold_eager
                else "compile on first use")
        ctx.notes.append(
            f"decode forwards compiled (mode={config.mode}, backend={config.backend}): {stats.compiles} graph(s), "
            f"warm-up {wall:.1f} s ({stats.seconds:.1f} s of it in the compiler backend, the rest tracing and "
            f"running the warm-up calls) for batch {batches} x cache {list(config.warmup_lengths)}: "
            f"{', '.join(stats.shapes)}; other shapes {cold}"
        )

    ctx.after.append(warm)  # once every step is applied, so the warm-up runs the loop the calls will run
