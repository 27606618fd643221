"""A decode shape compiled ahead of time by AOTInductor: the step's wrapper is C++, not Python.

``torch.compile``'s graphs on CPU run a generated Python wrapper that calls, per decoder layer, several infopt
operators and generated kernels; with the gathering of the step's inputs that is Python work every token (about
1 ms of a 5-6 ms ``cpu-fast`` token on two cores). AOTInductor compiles the same forward, exported with
``torch.export``, into one shared library whose wrapper is C++.

What is exported is :meth:`CompiledForward._forward <infopt.compile.decoder.CompiledForward._forward>` at one decode
shape, with the static cache's tensors (each layer's keys, values and fill counter) as inputs it updates in place, so
one package serves every cache allocation of that shape. The model's weights are not copied into the package: the
package is built without its constants, and the loaded runner reads the model's own parameters and buffers
(``load_constants(..., user_managed=True)``), so memory stays what it was. Building one does not copy them either:
the program's buffers (infopt's quantized codes and scales) go to AOTInductor as parameters
(:func:`_weights_as_parameters`), since it keeps a copy of every buffer. A change to the model the per-call module
check sees (:func:`infopt.compile.decoder.module_signature`) drops the package, as it drops compiled graphs.

Packages are cached on disk (``$INFOPT_CACHE_DIR/aoti``, else ``~/.cache/infopt/aoti``) under a hash of the exported
graph's code, the weights' metadata, the Inductor options and the versions that built it, so a second process that
exports the same step loads its package instead of compiling it again (export takes a few seconds, an AOTInductor
compile half a minute or more on two cores). Beside each package, an index file named after a description of the
model and the step computed here without an export (:func:`local_key`: the code, the model's structure, settings and
tensor layouts, the shape, the options) lets a later process that describes the same step load the package without
exporting it (:func:`find_indexed`): ``infopt.optimize(model, "cpu-fast")`` and ``infopt.load`` of such a model then
take seconds. The index names the package's weights by where the model holds them (:func:`tensor_names`: parameters,
buffers and fused projection groups' buffers). The folder is kept under ``$INFOPT_CACHE_AOTI_MB`` megabytes (2048 by
default) by deleting the packages used longest ago when a new one is written.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.export.graph_signature import InputKind, InputSpec

from .._version import __version__
from ..core.caches import cache_dir, limit_bytes, prune, touch
from ..kvcache.static import BUCKET

log = logging.getLogger("infopt.compile")

__all__ = ["AotStep", "aot_available", "aot_cache_dir", "cache_limit_bytes", "cache_slots", "export_step", "load_saved",
           "prune_cache", "tensor_sig", "cache_sig", "args_sig", "length_dim", "batch_free", "FREE_BATCH",
           "free_dims", "local_key", "find_indexed", "index_package", "fingerprint", "tensor_names",
           "tensor_named"]


def aot_available() -> bool:
    """Whether this torch can build and run a package without its weights: ``torch.export``,
    ``aoti_compile_and_package`` and a runner whose constants the caller supplies."""
    try:
        from torch._inductor.package.package import AOTICompiledModel
    except ImportError:
        return False
    return (hasattr(torch, "export") and hasattr(torch._inductor, "aoti_compile_and_package")
            and hasattr(AOTICompiledModel, "load_constants"))


def aot_cache_dir() -> Path:
    """Where packages are cached: ``$INFOPT_CACHE_DIR/aoti``, else ``~/.cache/infopt/aoti``
    (:mod:`infopt.core.caches`)."""
    return cache_dir("aoti")


_SCRATCH: list[Path] = []  # a folder of this process's own, where the cache folder cannot be written


def _writable(folder: Path) -> Path:
    """``folder`` (created) where packages can be written to it; else a temporary folder kept until the process
    exits, said once in a warning (a read-only home, a container): the step still runs on its package."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-")
        probe.close()
        return folder
    except OSError as e:
        reason = f"{type(e).__name__}: {e}"
    if not _SCRATCH:
        _SCRATCH.append(Path(tempfile.mkdtemp(prefix="infopt-aoti-")))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
        log.warning("infopt compile: the AOTInductor package cache %s cannot be written (%s); this process keeps its "
                    "packages in %s until it exits. Set INFOPT_CACHE_DIR to a writable folder to keep them across "
                    "runs", folder, reason, _SCRATCH[0])
    return _SCRATCH[0]


def cache_limit_bytes() -> int:
    """How much the package cache may hold: ``$INFOPT_CACHE_AOTI_MB`` megabytes, default 2048."""
    return limit_bytes("aoti")


def prune_cache(folder: Path, keep: Path | None = None) -> list[Path]:
    """Delete the packages in ``folder`` used longest ago (by modification time, which a load refreshes) until the
    rest fit in :func:`cache_limit_bytes`; ``keep`` is never deleted. Returns the files deleted."""
    return prune(folder, "aoti", keep=() if keep is None else (keep,))


def cache_slots(cache) -> list[tuple[Any, str]]:
    """Every tensor attribute of the cache's layers, ``(layer, name)``, in a fixed order: what a step reads and
    writes."""
    return [(layer, name) for layer in getattr(cache, "layers", ())
            for name, v in vars(layer).items() if isinstance(v, torch.Tensor)]


class _StepModule(nn.Module):
    """The decode step as a module ``torch.export`` can trace: the model (a submodule, so its parameters are the
    program's weights) and the cache's tensors as inputs, swapped into the cache object for the trace."""

    def __init__(self, fwd, cache, padded: bool):
        super().__init__()
        self.model = fwd.model
        self._fwd, self._cache, self._padded = [fwd], [cache], padded  # (lists: not submodules)

    def forward(self, input_ids, position_ids, cache_position, *rest):
        mask, tensors = (rest[0], rest[1:]) if self._padded else (None, rest)
        slots = cache_slots(self._cache[0])
        old = [getattr(obj, name) for obj, name in slots]
        try:
            for (obj, name), t in zip(slots, tensors, strict=True):
                setattr(obj, name, t)
            return self._fwd[0]._forward(input_ids, position_ids, cache_position, mask, self._cache[0])
        finally:
            for (obj, name), t in zip(slots, old, strict=True):
                setattr(obj, name, t)


def _flat_args(args: tuple, padded: bool, tensors: list) -> tuple:
    head = args[:4] if padded else args[:3]
    return (*head, *tensors)


def _weights_as_parameters(ep) -> dict[str, torch.Tensor]:
    """Turn the program's lifted tensor constants (tensors the forward reaches outside any module's parameters and
    buffers, such as a fused projection group's weight) and the buffers the step does not write (infopt's quantized
    layers keep their codes and scales as buffers) into parameters, in place, and return every tensor the program
    holds by name: the model's own objects, from before they were wrapped.

    A constant would be renamed ``_tensor_constantN`` and have to be packaged; a parameter keeps its name, so the
    package asks for it by that name and gets the model's tensor. AOTInductor also keeps a copy of every buffer it
    compiles as the buffer's "original value" (in case the program mutates it) and does not copy parameters: at
    Llama-3.1-8B shapes those copies were 5.2 GB, held for the rest of the process after the package was built."""
    sig = ep.graph_signature
    own = {k: v for k, v in {**ep.state_dict, **ep.constants}.items() if isinstance(v, torch.Tensor)}
    written = set(sig.buffers_to_mutate.values())
    specs = sig.input_specs
    for i, spec in enumerate(specs):
        lifted = spec.kind == InputKind.CONSTANT_TENSOR
        if not (lifted or spec.kind == InputKind.BUFFER) or spec.target in written:
            continue
        stored = spec.persistent and not lifted
        t = ep.state_dict.get(spec.target) if stored else ep.constants.get(spec.target)
        if not isinstance(t, torch.Tensor):
            continue
        ep.state_dict[spec.target] = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
        if not stored:
            ep.constants.pop(spec.target, None)
        specs[i] = InputSpec(kind=InputKind.PARAMETER, arg=spec.arg, target=spec.target)
    return own


def _package_key(ep, options: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(ep.graph_module.print_readable(print_output=False, include_stride=True, include_device=True).encode())
    h.update(str(ep.graph_signature).encode())
    for name, t in sorted({**ep.state_dict, **ep.constants}.items()):
        if isinstance(t, torch.Tensor):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.stride()}".encode())
    # a custom graph pass names its version by uuid() (its repr holds an address)
    h.update(json.dumps({k: v.uuid().hex() if hasattr(v, "uuid") else repr(v)
                         for k, v in sorted(options.items())}).encode())
    h.update(json.dumps(fingerprint, sort_keys=True).encode())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _torch_internal_notices():
    """Silence a deprecation notice torch's own export and packaging code raises from its internals (about pytree's
    ``LeafSpec``): a user applying ``cpu-fast`` can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        yield


def export_step(fwd, key: tuple, args: tuple, options: dict[str, Any], fingerprint: dict[str, Any]
                ) -> tuple[AotStep, float, bool]:
    """Export ``fwd``'s decode step at shape ``key`` for the call ``args`` and compile it with AOTInductor (or load
    the package from the disk cache).

    Returns:
        ``(step, seconds, cached)``: the :class:`AotStep` calling the loaded package over the model's tensors, the
        export + compile time, and whether the package came from the cache.
    """
    from torch._inductor import aoti_compile_and_package

    t0 = time.perf_counter()
    padded = bool(key[3])
    free = fwd.is_free(key)
    rows = batch_free(key[0], free)
    cache = args[4]
    tensors = [getattr(obj, name) for obj, name in cache_slots(cache)]
    module = _StepModule(fwd, cache, padded)
    flat = _flat_args(args, padded, tensors)
    dynamic = None
    if free:  # one symbolic cache length: the mask's width and the keys' and values' dimension 2. In 16-slot blocks
        # (the static attention kernel's; calls bring whole 256-slot buckets), from one bucket up: a derived size whose
        # root is not 1 at the traced length, which export would specialize. Over FREE_BATCH rows, one symbolic batch
        # too: dimension 0 of the ids, positions, mask, keys and values
        blocks = BUCKET // 16
        length = 16 * torch.export.Dim("cache_blocks", min=blocks, max=blocks << 12)
        batch = {0: torch.export.Dim("batch", min=FREE_BATCH[0], max=FREE_BATCH[1])} if rows else {}
        rest = ({**batch, 1: length},) if padded else ()  # (the forward takes the mask and the cache's tensors as *rest)
        dynamic = (batch or None, batch or None, None,
                   rest + tuple(None if length_dim(t) is None else {**batch, length_dim(t): length} for t in tensors))
    with torch.no_grad(), _torch_internal_notices():
        ep = torch.export.export(module, flat, dynamic_shapes=dynamic, strict=False)
    # the model's own tensor objects: given to the package without a copy, and named back to the model by identity
    # (AotStep.saved_form)
    constants = _weights_as_parameters(ep)
    opts = {**options, "aot_inductor.package_constants_in_so": False}
    name = _package_key(ep, opts, fingerprint)
    folder = aot_cache_dir()
    path = folder / f"{name}.pt2"
    if not path.is_file() and _SCRATCH and (_SCRATCH[0] / path.name).is_file():
        path = _SCRATCH[0] / path.name  # built earlier in this process, the cache folder being unwritable
    cached = path.is_file()
    if not cached:
        folder = _writable(folder)
        path = folder / path.name
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / "step.pt2"
            with _torch_internal_notices():
                aoti_compile_and_package(ep, package_path=str(out), inductor_configs=opts)
            os.replace(out, path)  # atomic: another process never loads a half-written package
        prune_cache(folder, keep=path)
    else:
        with contextlib.suppress(OSError):
            os.utime(path)  # the newest use: pruning drops the packages used longest ago first
    runner = _load_package(path)
    wanted = set(runner.get_constant_fqns())
    missing = wanted - set(constants)
    if missing:
        raise RuntimeError(f"the AOTInductor package wants constants the exported program does not hold: "
                           f"{sorted(missing)[:5]}")
    weights = {k: constants[k] for k in wanted}
    runner.load_constants(weights, check_full_update=True, user_managed=True)
    step = AotStep(runner, padded, weights, cache_sig(cache, free, rows), path, free=free, free_batch=rows)
    return step, time.perf_counter() - t0, cached


class AotStep:
    """Calls a decode shape's AOTInductor package with the cache's tensors as the trailing inputs.

    The package was compiled for the cache tensors' dtypes, shapes and strides at export: a cache whose tensors differ
    (another allocation is checked when the call brings it) is refused with an error, which the compiled forward
    answers by running the step eagerly.

    Args:
        runner: the loaded package.
        padded: whether the step takes an attention mask.
        constants: the tensors the package reads as its weights (held as long as this step is).
        cache_sig: ``(dtype, device, shape, strides)`` of each cache tensor (:func:`cache_slots` order) it was
            compiled for (:func:`cache_sig`).
        path: the package's file (kept with a saved model).
        free: the package keeps the cache length symbolic (any length serves).
        free_batch: and its batch (any batch of :data:`FREE_BATCH`).
    """

    def __init__(self, runner, padded: bool, constants: dict[str, torch.Tensor], cache_sig: list[tuple],
                 path: Path | None = None, free: bool = False, free_batch: bool = False):
        self.runner, self.padded, self.constants, self.path, self.free = runner, padded, constants, path, free
        self.free_batch = free and free_batch
        self._sig = list(cache_sig)
        self._slots: list = []
        self._tensors: list = []
        self._cache_id: int | None = None

    def __call__(self, *args):
        cache = args[4]
        tensors = self._tensors
        if id(cache) != self._cache_id or any(getattr(o, n) is not t for (o, n), t in zip(self._slots, tensors, strict=True)):
            slots = cache_slots(cache)
            now = [getattr(o, n) for o, n in slots]
            if cache_sig(cache, self.free, self.free_batch) != self._sig or (self.free and any(
                    length_dim(t) is not None and t.shape[length_dim(t)] % BUCKET for t in now)):
                raise RuntimeError("the static cache's tensors differ from those the AOTInductor package was compiled "
                                   "for (dtype, shape or strides)")
            self._slots, self._tensors, self._cache_id = slots, now, id(cache)
            tensors = now
        return self.runner(*_flat_args(args, self.padded, tensors))

    def saved_form(self, model: nn.Module) -> dict[str, Any] | None:
        """What :func:`load_saved` needs besides the package file: the model-relative name of each constant
        (:func:`tensor_names`) and the cache signature; None when a constant is none of the model's tensors by any
        name (only an export finds it)."""
        names = tensor_names(model)
        constants = {}
        for fqn, t in self.constants.items():
            if id(t) not in names:
                return None
            constants[fqn] = names[id(t)]
        return {"constants": constants, "padded": self.padded, "free_length": self.free, "free_batch": self.free_batch,
                "cache": [[str(d).removeprefix("torch."), str(dev), list(shape), None if stride is None else list(stride)]
                          for d, dev, shape, stride in self._sig]}


def _load_package(path: Path):
    """The package's runner. Its key (or a saved step's manifest, checked before this is called) already holds the
    torch version and the CPU's ISA (:func:`fingerprint`), so the package is loaded with the runner's own loader, not
    ``aoti_load_package``, whose first call in a process probes the compiler for every vector ISA to compare them
    with the package's metadata for a warning (six child processes: 1.2 s of a 2-core machine's load time)."""
    try:
        from torch._inductor.package.package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (AttributeError, ImportError, TypeError):  # another torch's interface: its public loader
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path))
    return AOTICompiledModel(loader)


FUSED_ATTR = "_infopt_fused"
"""The attribute of each layer of a fused projection group (:mod:`infopt.compile.fuse`) that holds the group."""

FUSED = "#fused."
"""Marks a name of :func:`tensor_names` that is a fused projection group's tensor: ``<first layer>#fused.<name>``."""


def tensor_names(model: nn.Module) -> dict[int, str]:
    """A model-relative name for each tensor a compiled step of ``model`` can read as a weight, by ``id``: its
    parameters and buffers, and the tensors of its fused projection groups (:mod:`infopt.compile.fuse`), which are
    no module's: ``<path of the group's first layer>#fused.<fused tensor>`` (``.bias``; a quantized group's hidden
    layer's own tensors as ``layer.<name>``). :func:`tensor_named` finds each again in a model built the same way."""
    names = {id(t): n for n, t in (*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False))}
    seen: set[int] = set()
    for path, m in model.named_modules():
        group = m.__dict__.get(FUSED_ATTR)
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        own = [*group.fused.items(), ("bias", group.bias)]
        layer = getattr(group, "layer", None)
        if isinstance(layer, nn.Module):
            own += [(f"layer.{n}", t) for n, t in (*layer.named_parameters(), *layer.named_buffers())]
        for n, t in own:
            if t is not None:
                names.setdefault(id(t), f"{path}{FUSED}{n}")
    return names


def tensor_named(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor :func:`tensor_names` calls ``name`` in ``model`` (raises ``LookupError`` where there is none)."""
    path, fused, rest = name.partition(FUSED)
    if not fused:
        try:
            return model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
        except AttributeError as e:
            raise LookupError(f"the model has no parameter or buffer {name!r}") from e
    group = model.get_submodule(path).__dict__.get(FUSED_ATTR)
    if group is None:
        raise LookupError(f"{path!r} is no fused projection group's first layer (for {name!r})")
    if rest == "bias":
        t = group.bias
    elif rest.startswith("layer."):
        layer = getattr(group, "layer", None)
        t = dict((*layer.named_parameters(), *layer.named_buffers())).get(rest[len("layer."):]) if layer else None
    else:
        t = group.fused.get(rest)
    if t is None:
        raise LookupError(f"the fused projection group at {path!r} has no tensor {rest!r}")
    return t


def load_saved(model: nn.Module, path: Path, form: dict[str, Any]) -> AotStep:
    """An :class:`AotStep` from a package saved with a model and its :meth:`AotStep.saved_form`, reading ``model``'s
    tensors (raises where the package does not load or a constant is missing)."""
    runner = _load_package(path)
    constants = {fqn: tensor_named(model, n) for fqn, n in form["constants"].items()}
    wanted = set(runner.get_constant_fqns())
    if wanted != set(constants):
        raise RuntimeError(f"the saved package wants other constants than were saved with it "
                           f"({sorted(wanted ^ set(constants))[:5]})")
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    sig = [(getattr(torch, d), torch.device(dev), tuple(shape), None if stride is None else tuple(stride))
           for d, dev, shape, stride in form["cache"]]
    return AotStep(runner, bool(form["padded"]), constants, sig, path, free=bool(form.get("free_length", False)),
                   free_batch=bool(form.get("free_batch", False)))


def _is_param(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in (model.get_submodule(owner) if owner else model)._parameters


def tensor_sig(t: torch.Tensor | None, free: int | tuple[int, ...] | None = None) -> tuple | None:
    """What a compiled step assumes of a tensor argument: ``(dtype, device, shape, strides)``; None for None.

    ``free``: the dimension or dimensions the step keeps symbolic (the cache length, the batch): their sizes are left
    out (None), and so are the strides of a contiguous tensor, which follow from its shape.
    """
    if t is None:
        return None
    if free is None:
        return (t.dtype, t.device, tuple(t.shape), t.stride())
    dims = (free,) if isinstance(free, int) else free
    shape = tuple(None if d in dims else n for d, n in enumerate(t.shape))
    return (t.dtype, t.device, shape, None if t.is_contiguous() else t.stride())


def length_dim(t: torch.Tensor) -> int | None:
    """The dimension of a static cache tensor that is the cache length: 2 for the layers' keys and values (their only
    4-d tensors, ``[batch, kv heads, length, head dim]``), None for the rest (fill counters)."""
    return 2 if t.dim() == 4 else None


FREE_BATCH = (2, 32)
"""The batch sizes one graph serves where the step keeps the batch symbolic: from two rows (a trace at one row fixes
it: torch specializes sizes 0 and 1) to 32 (kernels may branch on the rows above that: the ``cpu-fast`` step's int4
linears guard on at most 63). A larger batch gets graphs of its own size."""


def batch_free(batch: int, free: bool) -> bool:
    """Whether a step of ``batch`` rows that keeps the cache length symbolic (``free``) keeps its batch symbolic too:
    for every batch in :data:`FREE_BATCH`, one graph."""
    return free and FREE_BATCH[0] <= batch <= FREE_BATCH[1]


def free_dims(t: torch.Tensor, batch: bool) -> tuple[int, ...] | None:
    """The dimensions of a static cache tensor that a free step keeps symbolic: its length (:func:`length_dim`) and,
    with ``batch``, its rows (dimension 0 of the keys and values); None for a tensor with neither."""
    d = length_dim(t)
    if d is None:
        return None
    return (0, d) if batch else (d,)


def cache_sig(cache, free: bool, batch: bool = False) -> list[tuple]:
    """:func:`tensor_sig` of each of the cache's tensors (:func:`cache_slots` order); ``free``: for a step that keeps
    the cache length (:func:`length_dim`) symbolic, ``batch``: and its batch (:func:`batch_free`)."""
    return [tensor_sig(t, free_dims(t, batch) if free else None)
            for t in (getattr(o, n) for o, n in cache_slots(cache))]


def args_sig(args: tuple, free: bool, batch: bool = False) -> tuple:
    """:func:`tensor_sig` of a decode step's four tensor arguments (token ids, positions, cache positions, attention
    mask); ``free``: the mask's width, the cache length, left out; ``batch``: the rows of the ids, positions and mask
    too."""
    rows = (0,) if free and batch else None
    dims = (rows, rows, None, ((0, 1) if rows else (1,)) if free else None)
    return tuple(tensor_sig(a, d) for a, d in zip(args[:4], dims, strict=True))


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What a compiled step assumes beyond its shape (a saved step's manifest, :mod:`infopt.compile.saved`; a
    package's key here): the versions that produced it, the CPU's ISA and the model's dtype and device type."""
    p = next(model.parameters())
    dtype = getattr(model, "dtype", p.dtype)  # the model's float dtype, the same before and after quantizing
    # the saved bytecode is the compile step's own code and its graph passes: a change to them (within one version
    # number, during development) must not run a stale step
    here = Path(__file__).parent
    source = hashlib.sha256(b"".join((here / n).read_bytes() for n in ("decoder.py", "passes.py", "aot.py"))
                            ).hexdigest()[:16]
    return {"torch": torch.__version__, "transformers": transformers.__version__, "infopt": __version__,
            "source": source,
            "python": list(sys.version_info[:2]), "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "dtype": str(dtype),
            "device": p.device.type}


# -- the package index: a step found by describing the model, without an export ------------------------------------
_SOURCE_HASH: list[str] = []


def _source_hash() -> str:
    """A hash of infopt's own code (every Python and C++ source of the package): a development change within one
    version number must not find a package built by other code."""
    if not _SOURCE_HASH:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for f in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
        _SOURCE_HASH.append(h.hexdigest())
    return _SOURCE_HASH[0]


_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain(v: Any) -> Any:
    """A stable text for an attribute value: scalars and tuples of them as they are; anything else by its type (a
    function by its qualified name), never by its address."""
    if isinstance(v, _SCALARS):
        return repr(v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _SCALARS) for x in v):
        return repr(tuple(v))
    if callable(v) and hasattr(v, "__qualname__"):
        return f"fn:{getattr(v, '__module__', '')}.{v.__qualname__}"
    return f"obj:{type(v).__module__}.{type(v).__qualname__}"


def _describe_model(model: nn.Module) -> bytes:
    """Everything of the model an exported decode step depends on, besides the tensors' values: each module's type,
    training flag, hooks, instance-level methods and plain attributes, each parameter's and buffer's name, dtype,
    device, shape, strides and grad flag, and the config."""
    parts: list[str] = []
    for name, m in model.named_modules():
        parts.append(f"m:{name}:{type(m).__module__}.{type(m).__qualname__}:{m.training}")
        for hooks in ("_forward_hooks", "_forward_pre_hooks"):
            parts += [f"h:{hooks}:{_plain(fn)}" for fn in getattr(m, hooks, {}).values()]
        for k, v in sorted(vars(m).items()):
            if k in ("_parameters", "_buffers", "_modules", "training") or k.startswith("_forward") or k.startswith(
                    "_backward") or k.startswith("_state_dict") or k.startswith("_load_state_dict"):
                continue
            if isinstance(v, torch.Tensor):
                text = repr(tensor_sig(v))
            elif k == FUSED_ATTR:  # a fused group: its tensors' layouts, and the packed copy's handle a graph names
                text = repr((type(v).__qualname__, v.names, v.sizes, v.tensors, v.packed,
                             [(n, tensor_sig(t)) for n, t in v.fused.items()], tensor_sig(v.bias)))
            elif isinstance(v, nn.Module):
                text = f"module:{type(v).__qualname__}"
            else:
                text = _plain(v)
            parts.append(f"a:{k}={text}")
        for kind, items in (("p", m._parameters.items()), ("b", m._buffers.items())):
            for k, t in items:
                parts.append(f"{kind}:{k}:{None if t is None else (*tensor_sig(t), t.requires_grad)}")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        parts.append(config.to_json_string(use_diff=False))
        parts.append(f"attn:{getattr(config, '_attn_implementation', None)}")
    return "\n".join(parts).encode()


def _global_state() -> dict[str, Any]:
    """Process-wide settings an export or an Inductor compile reads."""
    import torch._inductor.config as inductor_config

    portable = inductor_config.save_config_portable()
    return {"matmul": torch.get_float32_matmul_precision(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "mkldnn": torch.backends.mkldnn.enabled,
            "inductor": {k: v for k, v in sorted(portable.items())
                         if isinstance(v, (bool, int, float, str, type(None)))},
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE"))
                    and k != "TORCHINDUCTOR_CACHE_DIR"}}


def local_key(fwd, key: tuple, args: tuple, options: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """The index name of shape ``key``'s package for ``fwd``'s model: a hash, computed here, of what the exported step
    depends on (the code, the model as :func:`_describe_model` reads it, the shape and the call's tensor layouts,
    the cache's tensors, the compile options and the versions). Equal keys mean the same exported program."""
    h = hashlib.sha256()
    h.update(_source_hash().encode())
    h.update(_describe_model(fwd.model))
    free = fwd.is_free(key)
    rows = batch_free(key[0], free)
    if free:  # the package serves every cache length (and batch of FREE_BATCH): what it is traced at is no part of it
        key = ("2+" if rows else key[0], key[1], None, *key[3:])
    h.update(repr((key, type(fwd).__qualname__, free, args_sig(args, free, rows))).encode())
    h.update(repr([(type(o).__qualname__, n) for o, n in cache_slots(args[4])]).encode())
    h.update(repr(cache_sig(args[4], free, rows)).encode())
    h.update(json.dumps({k: v.uuid().hex() if hasattr(v, "uuid") else repr(v) for k, v in sorted(options.items())}
                        ).encode())
    h.update(json.dumps(fingerprint, sort_keys=True).encode())
    h.update(json.dumps(_global_state(), sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def _index_files(folder: Path, lkey: str) -> list[Path]:
    # "<package stem>.<local key>.json": pruned with its package (core.caches groups files by the name's first part)
    return sorted(folder.glob(f"*.{lkey}.json"))


def find_indexed(model: nn.Module, lkey: str) -> AotStep | None:
    """The package a step described by ``lkey`` was built into earlier on this machine, loaded over ``model``'s
    tensors without an export; None when there is none (or it no longer loads)."""
    for folder in (aot_cache_dir(), *_SCRATCH):
        for index in _index_files(folder, lkey):
            package = folder / f"{index.name.split('.', 1)[0]}.pt2"
            try:
                form = json.loads(index.read_text())["form"]
                if not package.is_file():
                    continue
                step = load_saved(model, package, form)
            except Exception as e:  # noqa: BLE001 - a stale or damaged entry: the caller exports as usual
                log.info("infopt compile: the indexed package %s did not load (%s: %s); exporting instead", package,
                         type(e).__name__, e)
                continue
            touch(package, index)
            return step
    return None


def index_package(model: nn.Module, step: AotStep, lkey: str) -> None:
    """Record that the step described by ``lkey`` is ``step``'s package, for :func:`find_indexed` (nothing where the
    package reads a tensor :func:`tensor_names` does not name)."""
    form = step.saved_form(model)
    if form is None or step.path is None:
        return
    index = step.path.with_name(f"{step.path.stem}.{lkey}.json")
    tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"form": form}))
        os.replace(tmp, index)
    except OSError as e:
        log.info("infopt compile: the package index %s could not be written (%s)", index, e)
