"""The compiled one-token decode step: ``torch.compile`` of the model's forward at decode shape over a static cache.

Only the decode step is compiled. The prompt (prefill) runs eagerly: its length changes from call to
call and a compiled prefill would recompile for each one, while the decode step has the same shapes
for every token of every call that lands in the same cache bucket. Each distinct shape, ``(batch,
cache length, padded or not)``, gets its own compiled graph; :class:`CompileStats` counts them, and
the compiles that happened after :func:`warmup` (which should be none when the warm-up covered the
shapes the calls use).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.decode import decode_step_for, takes_logits_to_keep

log = logging.getLogger("infopt.compile")

MAX_GRAPHS_PER_SHAPE = 2
"""Graphs one decode shape may compile before its step runs eagerly instead: one, plus one recompile (a change of
global state such as grad mode). More means the graph cannot hold: dynamo guards on a value that changes every
token (some models' sliding-window masks do), and each token would otherwise recompile until a hard error."""

__all__ = ["CompileStats", "CompiledDecoder", "compile_stats", "mode_options", "isolated_compile"]


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
            (a warning says so once per shape).
        eager_calls: decode steps run eagerly for those shapes.
    """

    compiles: int = 0
    seconds: float = 0.0
    shapes: list[str] = field(default_factory=list)
    calls: int = 0
    warmed_up: bool = False
    compiles_after_warmup: int = 0
    eager_shapes: dict[str, str] = field(default_factory=dict)
    eager_calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "seconds": round(self.seconds, 2), "shapes": list(self.shapes),
                "calls": self.calls, "warmed_up": self.warmed_up, "compiles_after_warmup": self.compiles_after_warmup,
                "eager_shapes": dict(self.eager_shapes), "eager_calls": self.eager_calls}


def compile_stats(model: nn.Module) -> CompileStats | None:
    """The :class:`CompileStats` of a model optimized with a ``compile`` step, or None."""
    dec = decode_step_for(model)
    return dec.stats if isinstance(dec, CompiledDecoder) else None


def mode_options(mode: str, device: torch.device, cpp_wrapper: bool) -> dict[str, Any]:
    """Inductor config for a compile ``mode`` on ``device``.

    ``reduce-overhead`` is CUDA graphs; ``max-autotune`` also benchmarks kernel choices (on CPU, C++
    GEMM templates, including the weight-only int8/int4 ones, against the ATen kernels). CUDA graphs
    are dropped off CUDA, where they do not apply.
    """
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode))
    if device.type != "cuda":
        opts.pop("triton.cudagraphs", None)
    if cpp_wrapper:
        opts["cpp_wrapper"] = True
    return opts


@functools.cache
def _compile_takes(keyword: str) -> bool:
    return keyword in inspect.signature(torch.compile).parameters


def isolated_compile(fn, *, name: str, **kwargs):
    """``torch.compile(fn, **kwargs)`` with a guard cache of its own.

    Dynamo keeps compiled graphs on the function's code object, so several ``torch.compile`` wrappers of one
    function share one cache and its recompile limit. torch versions with ``isolate_recompiles`` separate them;
    on older ones (torch < 2.12) the function is rebuilt on a fresh copy of its code object named ``name``,
    which gives it a cache of its own the same way.

    Args:
        fn: a function or bound method.
        name: a name for the copy (shows in dynamo's logs).
        **kwargs: ``torch.compile``'s keywords.
    """
    if _compile_takes("isolate_recompiles"):
        return torch.compile(fn, isolate_recompiles=True, **kwargs)
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = func.__code__.replace(co_name=name)
    copy = types.FunctionType(code, func.__globals__, name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return torch.compile(types.MethodType(copy, owner) if owner is not None else copy, **kwargs)


class CompiledDecoder:
    """A :data:`~infopt.core.decode.DecodeStep` that runs the model's one-token forward compiled.

    Args:
        model: the (already patched) model.
        config: the :class:`~infopt.compile.Compile` step: its ``mode``, ``fullgraph``, ``dynamic``,
            ``backend`` and ``cpp_wrapper``.
    """

    def __init__(self, model: nn.Module, config):
        self.model = model
        self.config = config
        self.stats = CompileStats()
        self._fns: dict[tuple, Any] = {}
        self._keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
        self._device = next(model.parameters()).device
        self._graphs: dict[tuple, int] = {}  # compiles per shape
        self._eager: set[tuple] = set()  # shapes that run eagerly (their graph did not hold)
        self._key: tuple | None = None  # the shape being called, for the compiler callback
        self._told_cold = False

    # -- the compiled function ---------------------------------------------------------------------------
    def _forward(self, input_ids, position_ids, cache_position, attention_mask, cache):
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                         attention_mask=attention_mask, past_key_values=cache, use_cache=True, **self._keep)
        return out.logits[:, -1].float()

    def _compiler(self, gm: torch.fx.GraphModule, example_inputs):
        key = self._key
        n = self._graphs.get(key, 0) + 1
        # (without fullgraph a graph break makes several graphs per compile, and dynamo runs a shape past its
        # recompile limit eagerly by itself)
        if n > MAX_GRAPHS_PER_SHAPE and self.config.fullgraph:
            raise _GraphNotHeld(f"the decode step recompiled {n - 1} times for one shape")
        self._graphs[key] = n
        if self.stats.warmed_up and not self._told_cold:
            self._told_cold = True
            log.warning("compiling the decode step for a shape the warm-up did not cover (%s): this call waits for "
                        "the compile once; list the batch sizes and lengths your calls use in Compile("
                        "warmup_batch_sizes=..., warmup_lengths=...) to compile them while the recipe is applied",
                        _shape_name(key))
        t0 = time.perf_counter()
        cfg = self.config
        if cfg.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs, config_patches=mode_options(cfg.mode, self._device, cfg.cpp_wrapper))
        else:
            from torch._dynamo.backends.registry import lookup_backend

            fn = lookup_backend(cfg.backend)(gm, example_inputs)
        self.stats.compiles += 1
        self.stats.seconds += time.perf_counter() - t0
        if self.stats.warmed_up:
            self.stats.compiles_after_warmup += 1
        return fn

    def _compiled(self, key: tuple):
        fn = self._fns.get(key)
        if fn is None:
            b, length, padded = key
            fn = isolated_compile(self._forward, name=f"decode_b{b}_l{length}_{'padded' if padded else 'unpadded'}",
                                  backend=self._compiler, fullgraph=self.config.fullgraph, dynamic=self.config.dynamic)
            self._fns[key] = fn
            self.stats.shapes.append(_shape_name(key))
        return fn

    def __call__(self, input_ids, position_ids, cache_position, attention_mask, cache) -> torch.Tensor:
        key = (int(input_ids.shape[0]), int(cache.get_max_length()), attention_mask is not None)
        args = (input_ids, position_ids, cache_position, attention_mask, cache)
        if key in self._eager:
            self.stats.eager_calls += 1
            return self._forward(*args)
        fn = self._compiled(key)
        self._key = key
        try:
            out = fn(*args)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            # dynamo traces without running the model, so the cache is as it was: run this token eagerly, and
            # this shape from now on. A failed compile never fails the user's call.
            self._fall_back(key, e)
            self.stats.eager_calls += 1
            return self._forward(*args)
        self.stats.calls += 1
        return out

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
        self.stats.eager_shapes[_shape_name(key)] = f"{type(cause).__name__}: {reason}"
        warnings.warn(f"infopt compile: the decode step for {_shape_name(key)} could not hold a compiled graph "
                      f"({type(cause).__name__}: {reason[:200]}); that shape now decodes eagerly (same tokens, "
                      "without the compiled speed-up). compile_stats(model).eager_shapes lists such shapes",
                      RuntimeWarning, stacklevel=3)


class _GraphNotHeld(RuntimeError):
    """Raised by the compiler callback when one shape compiles more than :data:`MAX_GRAPHS_PER_SHAPE` graphs."""


def _shape_name(key: tuple) -> str:
    b, length, padded = key
    return f"batch {b}, cache {length}, {'padded' if padded else 'unpadded'}"
