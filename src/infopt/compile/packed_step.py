"""The batching engine's packed step under ``torch.compile``: two graphs serve every step.

:meth:`infopt.compile.decoder.CompiledForward.packed` runs it; its graphs count in the model's one
:class:`~infopt.compile.decoder.CompileStats`, beside the fixed-shape decode and verify graphs.

A step's shapes change every time: its token count (decode tokens plus prefill chunks), its sequence count, the
width of its block table and the rows whose logits are due. The forward is compiled once with dynamic shapes, and
before each call the sequence, block and logit-row dimensions are marked *unbacked*, so dynamo never specializes
them (a backed size of 1 would get a graph of its own: one per combination of single sequence, single block,
single due row). The token count stays backed because transformers' mask and rotary code branch on it; it splits
the steps into single-token decodes and everything else. So an engine compiles two graphs, in its warm-up, and
none while it serves.

What the graph buys on CPU is fusion of everything between the matmuls and the attention kernel (norms, rotary
embeddings, activations, residual adds, the K/V writes), which the eager forward runs as hundreds of small
operators per step. The linears stay on oneDNN's prepacked weights through ``infopt::packed_linear``
(:mod:`infopt.compile.packed`), and attention stays on the ``infopt::paged_attention`` kernel; both are custom
operators the graph calls as they are. ``benchmarks/engine_throughput.py --compile off on`` measures it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ..attention.paged import triton_enabled
from ..ops import triton_paged
from .guard_free import isolated_compile, weak_backend
from .options import mode_options, module_signature

log = logging.getLogger("infopt.compile")

__all__ = ["PackedGraph", "is_compile_error"]


def _mark_unbacked(t: torch.Tensor | None, *dims: int) -> None:
    if t is not None:
        from torch._dynamo.decorators import mark_unbacked

        for d in dims:
            mark_unbacked(t, d)


def is_compile_error(e: BaseException) -> bool:
    """True for errors raised by dynamo or Inductor. The caller then runs the step eagerly: if that fails too, the
    forward itself is at fault; if it succeeds, compiling is."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(e, TorchDynamoException)


class PackedGraph:
    """``model``'s packed forward (``input_ids`` and ``position_ids`` ``[1, T]``, a ``paged_step``, the logit rows to
    keep), compiled with dynamic shapes; see the module docstring.

    Args:
        model: the engine's model (its attention backend already ``paged``).
        keeps: the model's forward takes ``logits_to_keep``.
        stats: the :class:`~infopt.compile.decoder.CompileStats` its graphs count in.
    """

    SHAPES = {True: "engine step, 1 token", False: "engine step, 2+ tokens, any sequences"}

    def __init__(self, model: nn.Module, *, keeps: bool, stats):
        self.model = model
        self.keeps = keeps
        self.stats = stats
        self.warmed_up = False
        self.failed: str | None = None  # why compiling failed (then every step runs eagerly)
        self._device = next(model.parameters()).device
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        # attention through infopt's Triton kernels where they apply (CUDA), the reference operator elsewhere; the
        # C++ kernel on CPU is chosen inside the graph before either
        self._triton = triton_paged.applies(self._device, dtype)
        self._signature: int | None = None
        self._rebuilt = False  # compiling again after the model changed (said once, in __call__)
        self._single = True  # a one-token step is being called (a graph of its own), for the compiler callback
        self._fn = self._new_fn()

    def _new_fn(self):
        kw = {}
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        if skip is not None:
            # dynamo's guards on every parameter's metadata, module flags and the config cost about 2 ms per step on
            # a 2-core CPU for a 30-layer model; __call__ compares module_signature instead (about 0.5 ms)
            kw["options"] = {"guard_filter_fn": skip}
            self._signature = module_signature(self.model)
        return isolated_compile(self._forward, name="engine_step", backend=weak_backend(self), dynamic=True,
                                fullgraph=True, **kw)

    def _forward(self, input_ids, position_ids, keep, step):
        kw = {"logits_to_keep": keep} if self.keeps else {}
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, paged_step=step,
                          **kw).logits

    def _compiler(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        t0 = time.perf_counter()
        fn = compile_fx(gm, example_inputs, config_patches=mode_options("default", self._device, False))
        stats = self.stats
        stats.compiles += 1
        stats.seconds += time.perf_counter() - t0
        name = self.SHAPES[self._single]
        if name not in stats.shapes:
            stats.shapes.append(name)
        if self.warmed_up:
            stats.compiles_after_warmup += 1
            if not self._rebuilt:
                log.warning("the engine compiled a step shape its warm-up did not cover (%s): the requests in this "
                            "step waited for it", name)
        return fn

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None, step
                 ) -> torch.Tensor:
        """The step's logits, as the model returns them."""
        if self._signature is not None:
            if module_signature(self.model) != self._signature:  # what the skipped module guards would catch
                log.info("the model changed since the engine's step was compiled (a parameter's dtype, shape or "
                         "device, a training flag, a hook or the config): compiling it again")
                self._fn = self._new_fn()
                self._rebuilt = True
        meta = step.meta
        starts = meta.query_start()  # built here, so the graph takes it as an input
        if self._triton and meta.token_index is None and triton_enabled():  # the Triton kernels' operator, its
            # programs an input of the graph
            meta.triton = True
            _mark_unbacked(meta.prefill_tiles(), 0)
        _mark_unbacked(meta.block_table, 0, 1)
        _mark_unbacked(meta.kv_lens, 0)
        _mark_unbacked(meta.new_lens, 0)
        _mark_unbacked(starts, 0)
        _mark_unbacked(keep, 0)
        self._single = input_ids.shape[1] == 1
        out = self._fn(input_ids, position_ids, keep, step)
        self.stats.calls += 1
        return out

    def disable(self, e: BaseException) -> None:
        """Give up on compiling the engine's step (every later step runs eagerly), saying why once."""
        text = " ".join(str(e).split())  # dynamo's messages span lines; the cause follows the first
        self.failed = f"{type(e).__name__}: {text[:400]}"
        self.stats.eager_shapes["engine step"] = self.failed
        log.warning("the engine's compiled step failed to compile (%s); its steps run eagerly", self.failed)
