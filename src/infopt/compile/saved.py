"""Compiled decode steps saved with an optimized model, so loading it skips the compile.

Tracing the decode step of a 30-layer model through dynamo takes about 12 s on a small CPU even when Inductor's
cache holds its kernels, and a new machine compiles them too (about a minute). :func:`save_steps` compiles each
decode shape the model has compiled ahead of time (``torch.compile(...).aot_compile``) and writes it next to the
weights (``infopt_compiled/``); :func:`load_steps` loads them into the rebuilt model's compiled forward, so
``infopt.load`` of a ``cpu-fast`` folder reaches its first token in seconds.

The saved steps carry no dynamo guards: infopt itself picks the graph by shape (batch, token bucket, cache
length, padded or not), and the manifest records what a graph also assumes (torch, transformers and infopt
versions, a hash of the compile step's source, the CPU's vector ISA, the model's dtype). A folder whose manifest does not match the machine and the
installed versions, or a step that fails to load, is compiled as before, with a warning. A loaded step runs as
a :class:`~infopt.compile.guard_free.GuardFreeStep`, as the steps compiled in-process on CPU do: only while the
model keeps the dtype and device it was saved with, with grad disabled, for the decode loop's contiguous int64
arguments and a cache of the model's dtype; otherwise that shape is compiled anew, with guards.

A saved step's C++ kernels are built by Inductor when the step loads, into its cache (``TORCHINDUCTOR_CACHE_DIR``):
about 9 s on two cores when that cache is empty, more than half of it probing which vector ISAs the compiler can
build. :func:`save_steps` therefore also loads the steps once in a child process with an empty cache and keeps what
that load built (``kernels.zip``, 0.24 MB for ``cpu-fast``); :func:`load_steps` puts those files into an empty or older cache before
loading, so a new process on the same setup starts as fast as one whose cache is warm. Inductor names each file by a
hash of its source and of the compiler command (include paths, flags) or compiler version, so a file only ever
serves the exact build it came from: on a machine where Python or torch live elsewhere, the names differ and Inductor
builds its kernels as before.

A shape that runs an AOTInductor package (``Compile(aot=...)``, :mod:`infopt.compile.aot`) has its package saved too
(``<step>.pt2``, with the model-relative names of the weights it reads): where the loading model asks for packages,
:func:`load_steps` installs it over the model's own tensors, so the loaded model decodes through the same C++ wrapper
without exporting or compiling anything. The names cover a fused projection group's buffers too
(:func:`~infopt.compile.aot.tensor_names`); a package reading a tensor no name covers is not saved, and the
``torch.compile`` step serves that shape.

CPU only for now: CUDA steps are not saved, nor those of models with speculative decoding, the batching
engine or quantized MoE experts (they warm up on load as before).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..generate import decoder_for, rollback
from ..kvcache.static import StaticCaches
from . import decoder as decoder_module
from .aot import AotStep, batch_free, fingerprint, load_saved
from .decoder import CompiledForward, CompiledForwards, _class, module_signature, step_options
from .guard_free import GuardFreeStep, _drop_all_guards, canonical_args

log = logging.getLogger("infopt.compile")

__all__ = ["COMPILED_DIR", "save_steps", "steps_fit", "load_steps", "fingerprint", "skipping_warmup"]

COMPILED_DIR = "infopt_compiled"
MANIFEST = "manifest.json"
KERNELS = "kernels.zip"
# an Inductor cache file as the zip names it: "<two-letter folder>/<hash>[.main].so" (nothing else is restored)
_KERNEL_NAME = re.compile(r"[a-z0-9_]{2}/[a-z0-9_]+(\.main)?\.so")

_SKIP_WARMUP: contextvars.ContextVar[bool] = contextvars.ContextVar("infopt_skip_warmup", default=False)


@contextlib.contextmanager
def skipping_warmup():
    """Inside, a ``compile`` step applied while rebuilding a saved model does not warm up (its steps are loaded)."""
    token = _SKIP_WARMUP.set(True)
    try:
        yield
    finally:
        _SKIP_WARMUP.reset(token)


def warmup_skipped() -> bool:
    return _SKIP_WARMUP.get()


def _step_name(key: tuple) -> str:
    b, k, length, padded = key
    return f"step_b{b}_k{k}_l{length}_{'padded' if padded else 'unpadded'}"


def can_save_steps() -> bool:
    """Whether this torch compiles a function ahead of time (``torch.compile(fn).aot_compile``, torch 2.12 and later):
    without it ``save_optimized`` keeps no compiled step and the loaded model compiles its steps as usual."""
    return callable(getattr(torch.compile(_identity), "aot_compile", None))


def _identity(x):
    return x


def save_steps(model: nn.Module, directory: str | Path) -> list[str]:
    """Compile ahead of time, and write under ``directory/infopt_compiled``, every decode shape ``model`` has
    compiled (its warm-up shapes and any compiled since). Returns the file names written (empty when the model
    has no compile step, runs on CUDA, or compiled nothing).

    A shape that cannot be compiled ahead of time is left out with a warning; the loaded model compiles it as
    before.
    """
    dec = decoder_for(model)
    if dec is None or not isinstance(dec.forwards, CompiledForwards) or not isinstance(dec.cache, StaticCaches):
        return []
    if dec.speculative is not None or dec.engine is not None:
        # a draft model's steps and the verify widths are warmed up together: such models load with their warm-up
        return []
    if any("_infopt_packed" in m.__dict__ or getattr(m.__dict__.get("_infopt_fused"), "packed", None) is not None
           for m in model.modules()):
        # packed linears (and packed fused projection groups) run in a graph as infopt::packed_linear naming this
        # process's packed weight by a handle (infopt.compile.packed): the op would repack under a handle the loading
        # process gives another layer
        return []
    if any(getattr(m, "is_infopt_experts", False) for m in model.modules()):
        # quantized MoE experts run in a graph as infopt::quantized_experts naming this process's live module by a
        # handle (infopt.quantize.experts): a saved graph would name a module the loading process does not have
        return []
    fwd = dec.forward_for(model)
    config = dec.forwards.config
    device = next(model.parameters()).device
    if not isinstance(fwd, CompiledForward) or device.type != "cpu" or config.backend != "inductor":
        return []
    keys = [k for k in fwd._fns if k not in fwd._eager]
    if not keys:
        return []
    if not can_save_steps():
        warnings.warn(f"infopt: torch {torch.__version__} cannot compile a decode step ahead of time (no "
                      "torch.compile(...).aot_compile; torch 2.12 and later have it), so none is saved with the model; "
                      "loading it compiles its steps as usual", RuntimeWarning, stacklevel=2)
        return []
    out = Path(directory) / COMPILED_DIR
    out.mkdir(parents=True, exist_ok=True)
    opts = {**step_options(config, device), "guard_filter_fn": _drop_all_guards}
    token = model.generation_config.bos_token_id
    token = 0 if token is None or isinstance(token, list) else int(token)
    written: dict[str, list] = {}
    packages: dict[str, dict] = {}
    # each shape compiles ahead of time (tens of seconds on two cores), then a child process builds their kernels
    bar = tqdm(total=len(keys) + 1, desc="infopt save: compiling decode steps ahead of time", unit="step")
    for key in keys:
        b, k, length, padded = key
        name = _step_name(key)
        try:
            with torch.no_grad():
                cache = dec.cache.cache_for(model, b, length)
                ids = torch.full((b, 1), token, dtype=torch.long, device=device)
                fwd.prefill(ids, torch.zeros_like(ids), None, cache)  # a cache's layers allocate on first use
                pos = torch.arange(1, 1 + k, device=device)
                mask = torch.ones(b, length, dtype=torch.long, device=device) if padded else None
                args = (fwd, ids.expand(b, k).contiguous(), pos.expand(b, k).contiguous(), pos, mask, cache)
                compiled = torch.compile(type(fwd)._forward, fullgraph=True, backend="inductor", options=opts)
                aot = compiled.aot_compile((args, {}))
                rollback(cache, 1)
            aot.save_compiled_function(str(out / f"{name}.bin"))
            written[name] = list(key)
            package = _save_package(model, fwd._fns.get(key), out / f"{name}.pt2")
            if package is not None:
                packages[name] = package
        except Exception as e:  # noqa: BLE001 - any failure leaves the shape to be compiled at load
            warnings.warn(f"infopt: the decode step for {name} could not be saved compiled ({type(e).__name__}: "
                          f"{str(e)[:200]}); loading the model compiles it", RuntimeWarning, stacklevel=2)
        bar.update()
    if not written:
        bar.close()
        return []
    (out / MANIFEST).write_text(json.dumps({"fingerprint": fingerprint(model), "steps": written,
                                            "aot_packages": packages}, indent=1))
    files = [f"{n}.bin" for n in written] + [f"{n}.pt2" for n in packages]
    bar.set_description("infopt save: building the steps' kernels in a child process")
    try:
        if _bundle_kernels(out, list(written)):
            files.append(KERNELS)
    finally:
        bar.update()
        bar.close()
    return files


def _save_package(model: nn.Module, step, dest: Path) -> dict | None:
    """Copy the AOTInductor package a shape runs (``Compile(aot=...)``) to ``dest``; returns what loading it needs
    (:meth:`~infopt.compile.aot.AotStep.saved_form`), or None where the shape runs no package or its weights are not
    all the model's named tensors."""
    fn = getattr(step, "fn", None)
    if not getattr(step, "aot", False) or not isinstance(fn, AotStep) or fn.path is None or not fn.path.is_file():
        return None
    form = fn.saved_form(model)
    if form is None:
        log.info("infopt: the AOTInductor package of %s reads tensors that are not the model's parameters or buffers; "
                 "it is not saved (the loaded model runs the saved torch.compile step)", dest.stem)
        return None
    shutil.copyfile(fn.path, dest)
    return form


_LOAD_CHILD = r"""
import sys, torch
from infopt.compile import decoder
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        torch.compiler.load_compiled_function(f, f_globals=decoder.__dict__)
"""


def _bundle_kernels(out: Path, names: list[str], timeout: float = 900.0) -> bool:
    """Load the saved steps in a child process with an empty Inductor cache and zip the shared libraries that load
    built (the steps' C++ kernels and the vector-ISA probes) into ``out/kernels.zip``. False, with a warning, when
    the child fails: the steps are saved all the same, and loading them builds their kernels."""
    with tempfile.TemporaryDirectory(prefix="infopt-kernels-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tmp}
        try:
            subprocess.run([sys.executable, "-c", _LOAD_CHILD, *(str(out / f"{n}.bin") for n in names)], env=env,
                           check=True, capture_output=True, text=True, timeout=timeout)
        except (subprocess.SubprocessError, OSError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            warnings.warn(f"infopt: the saved decode steps' kernels could not be built ahead of time "
                          f"({type(e).__name__}: {detail.strip()[-300:]}); loading the model builds them (seconds "
                          "more on a machine whose compile cache is empty)", RuntimeWarning, stacklevel=3)
            return False
        root = Path(tmp)
        libs = sorted(p for p in root.rglob("*.so") if _KERNEL_NAME.fullmatch(p.relative_to(root).as_posix()))
        if not libs:
            return False
        with zipfile.ZipFile(out / KERNELS, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for p in libs:
                z.write(p, p.relative_to(root).as_posix())
    return True


def _restore_kernels(folder: Path) -> int:
    """Copy the saved kernels (see :func:`_bundle_kernels`) into Inductor's cache where it lacks them; files already
    there are kept. Returns how many were copied. A failure only costs time (Inductor builds what is missing), so it
    is logged, not raised."""
    path = folder / KERNELS
    if not path.is_file():
        return 0
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = Path(cache_dir())
        copied = 0
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if not _KERNEL_NAME.fullmatch(name):
                    log.warning("infopt: %s holds an unexpected entry %r; it is ignored", path, name)
                    continue
                dest = root / name
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                tmp.write_bytes(z.read(name))
                tmp.chmod(0o755)
                os.replace(tmp, dest)  # atomic: a concurrent process sees the whole file or none
                copied += 1
        return copied
    except (OSError, zipfile.BadZipFile, ImportError) as e:
        log.warning("infopt: the kernels saved in %s were not restored (%s: %s); Inductor builds them",
                    folder, type(e).__name__, e)
        return 0


def _load_package(fwd, key: tuple, path: Path, form: dict) -> bool:
    """Install the saved AOTInductor package ``path`` as shape ``key``'s step; False, with a warning, where it does
    not load (the saved ``torch.compile`` step serves the shape then)."""
    try:
        aot = load_saved(fwd.model, path, form)
    except Exception as e:  # noqa: BLE001 - a package that does not load leaves the saved compiled step in charge
        warnings.warn(f"infopt: the saved AOTInductor package {path.name} did not load ({type(e).__name__}: "
                      f"{str(e)[:200]}); the saved compiled step runs instead", RuntimeWarning, stacklevel=3)
        return False
    if fwd._signature is None:
        # the package reads these very tensors: the per-call module check must see one of them replaced (and drop
        # the package for an export over the new ones), where a graph would simply read the new tensor
        fwd._signature = module_signature(fwd.model)
    if aot.free and fwd.free_length and aot.free_batch == batch_free(key[0], True):  # every length (and batch)
        fwd._classes[_class(key)] = key
    step = GuardFreeStep(fwd, key, args_sig=canonical_args(key, fwd._device, fwd.is_free(key)))
    # called with the step's arguments, as a package built in this process is; loaded: made for the saved cache
    step.fn, step.loaded, step.aot = aot, True, True
    fwd._fns[key] = step
    fwd._graphs[key] = 1
    fwd.stats.shapes.append(fwd.name(key))
    fwd.stats.loaded += 1
    fwd.stats.aot += 1
    return True


def steps_fit(model: nn.Module, directory: str | Path) -> bool:
    """True when ``directory`` holds saved steps made for this setup (:func:`fingerprint` of ``model``, which may
    still be the blank model being rebuilt); a folder made elsewhere is logged and compiles as usual."""
    manifest = Path(directory) / COMPILED_DIR / MANIFEST
    if not manifest.is_file():
        return False
    saved = json.loads(manifest.read_text()).get("fingerprint", {})
    want = fingerprint(model)
    if saved != want:
        diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
        log.warning("infopt: the compiled decode steps saved in %s were made for another setup (%s); compiling them "
                    "here instead", directory, diff)
        return False
    return True


def load_steps(model: nn.Module, directory: str | Path) -> int:
    """Load the steps :func:`save_steps` wrote into ``model``'s compiled forward (check :func:`steps_fit` first).
    Returns how many were loaded; a step that does not load is compiled on its first call, with a warning."""
    folder = Path(directory) / COMPILED_DIR
    dec = decoder_for(model)
    fwd = dec.forward_for(model) if dec is not None else None
    if not isinstance(fwd, CompiledForward):
        return 0
    meta = json.loads((folder / MANIFEST).read_text())
    p = next(model.parameters())
    _restore_kernels(folder)
    loaded = 0
    packages = meta.get("aot_packages", {}) if fwd._wants_aot() else {}
    for name, key in meta.get("steps", {}).items():
        key = tuple(key)
        if name in packages and _load_package(fwd, key, folder / f"{name}.pt2", packages[name]):
            loaded += 1
            continue
        try:
            with open(folder / f"{name}.bin", "rb") as f:
                fn = torch.compiler.load_compiled_function(f, f_globals=decoder_module.__dict__)
        except Exception as e:  # noqa: BLE001 - a step that does not load is compiled instead
            warnings.warn(f"infopt: the saved decode step {name} did not load ({type(e).__name__}: {str(e)[:200]}); "
                          "it is compiled instead", RuntimeWarning, stacklevel=2)
            continue
        if fwd.free_length:  # a saved graph was traced at its own cache length: one graph per bucket, as it was
            fwd.free_length = False
            fwd._classes.clear()
        fwd._fns[key] = GuardFreeStep(fwd, key, fn, canonical_args(key, p.device))
        fwd._graphs[key] = 1
        fwd.stats.shapes.append(fwd.name(key))
        fwd.stats.loaded += 1
        loaded += 1
    fwd.stats.warmed_up = fwd.stats.warmed_up or loaded > 0  # the saved shapes are the warm-up's
    return loaded
