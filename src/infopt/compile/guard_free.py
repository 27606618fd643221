"""The decode step that checks its own guards: each compiled shape of :class:`~infopt.compile.decoder.CompiledForward`
is a :class:`GuardFreeStep`, compiled with every dynamo guard dropped and checking, more cheaply, what its graph
assumes; with the compile helpers the engine's compiled step shares (:func:`isolated_compile`, :func:`weak_backend`)
and the names of decode shapes."""

from __future__ import annotations

import functools
import types
import weakref

import torch

from ..generate import Forward
from .aot import FREE_BATCH, args_sig, batch_free, cache_sig, cache_slots, free_dims

__all__ = ["GuardFreeStep", "isolated_compile", "weak_backend", "canonical_args", "mark_free_sizes"]


def isolated_compile(fn, *, name: str, **kwargs):
    """``torch.compile(fn, **kwargs)`` with a guard cache of its own.

    Dynamo keeps compiled graphs on the function's code object, so several ``torch.compile`` wrappers of one
    function share one cache and its recompile limits. The function is rebuilt here on a fresh copy of its code
    object named ``name``, so each wrapper has a cache of its own, counted against no other wrapper's limits,
    and freed with the wrapper. (torch's ``isolate_recompiles=True`` separates the per-shape limit only: its
    regions still add up against ``accumulated_recompile_limit``, 256 graphs per code object for the whole
    process, so a notebook or test session that compiles many models fell back to eager steps after a while.)

    Args:
        fn: a function or bound method.
        name: a name for the copy (shows in dynamo's logs).
        **kwargs: ``torch.compile``'s keywords.
    """
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = func.__code__.replace(co_name=name)
    copy = types.FunctionType(code, func.__globals__, name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return torch.compile(types.MethodType(copy, owner) if owner is not None else copy, **kwargs)


def weak_backend(forward):
    """The dynamo backend of ``forward``'s graphs, holding it weakly: it calls ``forward._compiler(gm,
    example_inputs)`` (a :class:`CompiledForward`, or the batching engine's compiled step).

    Dynamo keeps every backend it was given in a process-wide table (``eval_frame.cached_backends``), so a
    bound ``forward._compiler`` there would keep the forward, its model and its graphs alive after the user drops
    the model; this small function is all that stays.

    Args:
        forward: the object whose ``_compiler`` compiles each graph.

    Returns:
        The backend, to pass to ``torch.compile(..., backend=)``.

    Example:
        >>> class Owner:
        ...     def _compiler(self, gm, example_inputs):
        ...         return gm.forward
        >>> owner = Owner()
        >>> backend = weak_backend(owner)
        >>> del owner
        >>> backend(None, [])
        Traceback (most recent call last):
        RuntimeError: the model this decode step was compiled for has been garbage-collected
    """
    ref = weakref.ref(forward)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        owner = ref()
        if owner is None:
            raise RuntimeError("the model this decode step was compiled for has been garbage-collected")
        return owner._compiler(gm, example_inputs)

    return backend


def _drop_all_guards(entries):
    return [False] * len(entries)


_ARGS = ("input_ids", "position_ids", "cache_position", "attention_mask", "cache")


def _shape_guards_only(entries):
    """Keep the guards on the step's arguments' sizes (the relations among symbolic sizes, and each argument tensor's
    match: a graph with a free cache length assumes what it traced of the length, such as the attention kernel's
    16-key blocks, and a trace that fixed it checks it there; a call outside that recompiles, which the compiled
    forward answers with one graph per length), drop the rest (the modules', checked once per call instead)."""
    return [getattr(e, "guard_type", None) == "SHAPE_ENV" or (
        getattr(e, "guard_type", None) == "TENSOR_MATCH" and _argument(getattr(e, "name", ""))) for e in entries]


def _argument(name: str) -> bool:
    return name.split(".", 1)[0].split("[", 1)[0] in _ARGS


def _contiguous(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def canonical_args(key: tuple, device: torch.device, free: bool = False) -> tuple:
    """The signature (dtype, device, shape, strides) of the four tensor arguments the decode loop passes a step
    of shape ``key``: contiguous int64 token ids ``[B, k]``, positions ``[B, k]``, cache positions ``[k]`` and,
    when padded, an attention mask ``[B, length]`` (``free``: of any length, and of any batch of :data:`~infopt.compile.aot.FREE_BATCH`, as
    :func:`~infopt.compile.aot.args_sig` writes it)."""
    b, k, length, padded = key
    i64 = torch.int64
    if batch_free(b, free):
        rows = (i64, device, (None, k), None)
        return rows, rows, (i64, device, (k,), (1,)), (i64, device, (None, None), None) if padded else None
    mask = ((i64, device, (b, None), None) if free else (i64, device, (b, length), (length, 1))) if padded else None
    return (i64, device, (b, k), (k, 1)), (i64, device, (b, k), (k, 1)), (i64, device, (k,), (1,)), mask


def mark_free_sizes(args: tuple) -> None:
    """Mark the cache length of a decode step's arguments dynamic for the compile about to trace them: the attention
    mask's width, dimension 2 of the static cache's keys and values; and for a batch of
    :data:`~infopt.compile.aot.FREE_BATCH` the batch: dimension 0 of the token ids, positions, mask, keys and values.

    The marks are hints (``torch._dynamo.maybe_mark_dynamic``, kept on the tensors: dynamo checks a graph's marks
    against the call's): where the model fixes the length, the trace specializes, which the compiler callback sees (no
    symbolic size among the graph's inputs) and answers by compiling one graph per length; what the graph assumes of
    a symbolic length is checked by the guard on the sizes, which a guard-free step keeps (:func:`_shape_guards_only`).
    """
    mask, cache = args[3], args[4]
    rows = batch_free(args[0].shape[0], True)
    for o, n in cache_slots(cache):
        t = getattr(o, n)
        for d in free_dims(t, rows) or ():
            torch._dynamo.maybe_mark_dynamic(t, d)
    if mask is not None:
        torch._dynamo.maybe_mark_dynamic(mask, 1)
    if rows:
        for t in (args[0], args[1], mask):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)


class GuardFreeStep:
    """One decode shape, compiled on its first call with every dynamo guard dropped (``guard_filter_fn``), or
    loaded compiled (:mod:`infopt.compile.saved`, compiled ahead of time).

    Dynamo's guards cost about 0.3 ms per token on a 2-core CPU even with the module guards skipped: each call
    checks the inputs' metadata and global state ("TorchDynamo Cache Lookup" in ``torch.profiler``). (Compiling
    with ``aot_compile`` instead, as saved steps are, would also drop the lookup, but it bypasses Inductor's and
    AOTAutograd's caches: 12.5 s against 2.2 s for ``cpu-fast``'s step on 2 cores with a warm cache.) infopt picks
    the graph by shape itself and checks the modules once per call
    (``module_guards="per_call"``), so what is left to check is done here, more cheaply: per call the grad mode,
    autocast, the model's dtype and device, and the dtype, shape and strides of the four tensor arguments; the cache's
    tensors whenever the call brings another cache object. A call that differs from what the graph was compiled
    for moves the shape to a guarded compile (:meth:`CompiledForward._guarded`) for good.

    Args:
        fwd: the :class:`CompiledForward` the shape belongs to.
        key: the shape ``(batch, token bucket, cache length, padded)``.
        fn: a graph compiled already (a loaded step), called as ``fn(fwd, *args)``; None compiles on the first call.
        args_sig: the arguments ``fn`` was compiled for (:func:`canonical_args`); with ``fn``.
    """

    def __init__(self, fwd: Forward, key: tuple, fn=None, args_sig: tuple | None = None):
        self.fwd, self.key, self._args_sig = fwd, key, args_sig
        self.loaded = fn is not None
        self.aot = False  # built as an AOTInductor package (fn is then an infopt.compile.aot.AotStep)
        # called with the step's arguments: the in-process compile (made on the first call), or a loaded function
        # with the forward bound as its first argument
        self.fn = functools.partial(fn, fwd) if fn is not None else None
        p = next(fwd.model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._cache_ref = None  # the cache object last checked (weakly), and what its tensors were
        self._cache_sig: list | None = None
        self.free = fwd.is_free(key)  # one graph for every cache length
        self.rows = batch_free(key[0], self.free)  # and for every batch of FREE_BATCH

    def __call__(self, *args):
        fwd = self.fwd
        p = next(fwd.model.parameters())
        sig = args_sig(args, self.free, self.rows)
        if (torch.is_grad_enabled() or p.dtype != self.dtype or p.device != self.device
                or torch.is_autocast_enabled(p.device.type)
                or (self._args_sig is not None and sig != self._args_sig) or not self._cache_fits(args[4])):
            return self._to_guarded(*args)
        if self.fn is None and fwd._wants_aot():
            fn = fwd._build_aot(self.key, args)
            if fn is not None:
                self.fn, self._args_sig, self.aot = fn, sig, True
                return fn(*args)
        if self.fn is None:
            b, k, length, padded = self.key
            # compiled on this first call; a failure is the step's to handle (eager, as for a guarded compile)
            fn = isolated_compile(fwd._forward, name=f"free_b{b}_k{k}_l{'any' if self.free else length}_"
                                  f"{'p' if padded else 'u'}", backend=weak_backend(fwd), fullgraph=True,
                                  dynamic=fwd.config.dynamic,
                                  options={"guard_filter_fn": _shape_guards_only if self.free else _drop_all_guards})
            if self.free:
                mark_free_sizes(args)
            out = fn(*args)
            self.fn, self._args_sig = fn, sig
            return out
        return self.fn(*args)

    def _cache_fits(self, cache) -> bool:
        if self._cache_ref is not None and self._cache_ref() is cache:
            return True
        sig = cache_sig(cache, self.free, self.rows)
        if self._cache_sig is None:
            if self.loaded and any(t[0].is_floating_point and (t[0] != self.dtype or (
                    t[3] is not None and (None in t[2] or t[3] != _contiguous(t[2])))) for t in sig):
                return False  # a loaded step was saved over a contiguous cache (keys, values) of the model's dtype
            self._cache_sig = sig
        elif sig != self._cache_sig:
            return False
        try:
            self._cache_ref = weakref.ref(cache)
        except TypeError:
            self._cache_ref = None
        return True

    def _to_guarded(self, *args):
        self.fwd._graphs.pop(self.key, None)
        self.fwd._key = self.key  # the shape the compiler callback counts (set by step() too)
        return self.fwd._guarded(self.key)(*args)  # (replaces this step in the forward's table)


class _GraphNotHeld(RuntimeError):
    """Raised by the compiler callback when one shape compiles more than :data:`MAX_GRAPHS_PER_SHAPE` graphs."""


def _shape_name(key: tuple, free: bool = False) -> str:
    b, k, length, padded = key
    tokens = "" if k == 1 else f"{k} tokens, "
    cache = "any cache length" if free else f"cache {length}"
    batch = f"any batch {FREE_BATCH[0]}-{FREE_BATCH[1]}" if batch_free(b, free) else f"batch {b}"
    return f"{batch}, {tokens}{cache}, {'padded' if padded else 'unpadded'}"
