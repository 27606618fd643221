"""infopt's C++ CPU kernels: built from ``infopt/ops/csrc`` with the machine's compiler on first use, cached on disk.

Each kernel is one C++ file registering operators under ``torch.ops.infopt`` through ``torch.library``. It is
compiled against the installed torch's headers and libraries (no ninja, no Python headers: a few seconds) for
this machine's CPU (``-march=native``) and cached under ``$INFOPT_CACHE_DIR/extensions`` (default
``~/.cache/infopt/extensions``; :mod:`infopt.core.caches`), keyed by the source, the torch version, the compiler and
its flags and the CPU's flags, so another torch or machine builds its own copy. ``make setup`` builds them once.

Before a built library is first loaded, a child process checks that an error raised in it (a ``TORCH_CHECK`` on
bad input) reaches Python as a RuntimeError under the installed torch; a torch whose exception handling does not
match the compiler's would otherwise end the process at the first bad input. Where no compiler exists, the build
fails or that check fails, :func:`load` returns False and logs why once; callers then run their torch reference
kernels (the same results, slower). ``INFOPT_NO_EXTENSIONS=1`` turns the C++ kernels off.

Example:
    >>> from infopt.ops.cpp import status
    >>> sorted(status())
    ['paged_attention', 'quant_linear']
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ..core.caches import cache_dir as kind_dir

__all__ = ["KERNELS", "ROWS", "load", "status", "build_all", "cache_dir", "operators", "loaded"]

_log = logging.getLogger("infopt.extensions")

KERNELS = ("paged_attention", "quant_linear")
"""The C++ kernels in ``infopt/ops/csrc``, by file name."""

_PROBE = {"quant_linear": "int4_a8_linear"}  # an operator that shows the kernel is registered (default: its name)

_SRC = Path(__file__).resolve().parent / "csrc"
_LOCK = threading.Lock()
_STATE: dict[str, bool | str] = {}  # name -> True (loaded) or the reason it is not


def cache_dir() -> Path:
    """Where built kernels are kept: ``$INFOPT_CACHE_DIR/extensions``, else ``~/.cache/infopt/extensions``
    (:mod:`infopt.core.caches`)."""
    return kind_dir("extensions")


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).resolve().parent / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    # x86: let the compiler use 512-bit vectors where the CPU has them (its default stops at 256)
    wide = ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
    return [cxx, "-O3", "-march=native", *wide, "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()), str(src),
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(out)]


def _target(name: str, cxx: str) -> Path:
    src = (_SRC / f"{name}.cpp").read_bytes()
    flags = " ".join(_command(cxx, Path("src"), Path("out")))  # the compiler flags and torch's include paths
    key = hashlib.sha256(b"\0".join([src, torch.__version__.encode(), flags.encode(), _cpu_flags().encode(),
                                     sys.platform.encode()])).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


def _compiled(name: str) -> Path | str:
    """The kernel's library in the cache, compiled first if missing; or the reason it cannot be."""
    if sys.platform != "linux":
        return f"the C++ kernels are built on Linux only (this is {sys.platform})"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found (install g++ or set CXX)"
    target = _target(name, cxx)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _log.info("infopt: building the %s C++ kernel (once per machine and torch version, a few seconds)", name)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            part = Path(tmp) / target.name
            proc = subprocess.run(_command(cxx, _SRC / f"{name}.cpp", part), capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
                return f"building it with {cxx} failed:\n{tail}"
            os.replace(part, target)  # atomic: another process never loads a half-written library
    return target


_PROBE_CODE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    getattr(torch.ops.infopt, sys.argv[2])()
except RuntimeError as e:
    sys.exit(0 if "infopt error-path probe" in str(e) else 3)
sys.exit(4)
"""


def _errors_reach_python(name: str, target: Path) -> bool | str:
    """Whether an error the kernel raises (``TORCH_CHECK``) reaches Python as a RuntimeError under this torch.

    Checked once per built library, in a child process: a torch build whose exception handling does not match
    this compiler's would otherwise end the user's process (a segmentation fault) at the first bad input. The
    verdict is kept beside the library."""
    ok, bad = target.with_name(target.name + ".errors-ok"), target.with_name(target.name + ".errors-bad")
    if ok.exists():
        return True
    if bad.exists():
        return bad.read_text()
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE_CODE, str(target), f"{name}_error_probe"],
                              capture_output=True, text=True, timeout=600)
        code = proc.returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"checking its error path failed to run: {e}"  # not kept: a later process tries again
    if code == 0:
        ok.touch()
        return True
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    reason = (f"it built, but an error raised in it does not reach Python as a RuntimeError with torch "
              f"{torch.__version__} (a child process that raised one ended with {how})")
    bad.write_text(reason)
    return reason


def _registered(name: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"infopt::{_PROBE.get(name, name)}", "CPU")
    except RuntimeError:
        return False


def _build(name: str) -> bool | str:
    if os.environ.get("INFOPT_NO_EXTENSIONS") == "1":
        return "INFOPT_NO_EXTENSIONS=1 is set"
    if _registered(name):  # already loaded in this process (a second copy's registration would abort it)
        return True
    target = _compiled(name)
    if not isinstance(target, Path):
        return target
    errors = _errors_reach_python(name, target)
    if errors is not True:
        return errors
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as e:
        return f"loading {target} failed: {e}"
    return True


ROWS = 16
"""Output rows per weight block of the ``quant_linear`` kernels (:mod:`infopt.quantize.formats.a8`'s layouts)."""


# each C++ operator's fake (its output's shape and dtype from its inputs), for torch.compile and opcheck, per kernel
_FAKES: dict[str, dict] = {
    "paged_attention": {
        "paged_attention": lambda query, key_pool, value_pool, block_table, query_start, kv_lens, scale, window=0,
        split_keys=True: query.new_empty(query.shape[0], query.shape[1], value_pool.shape[-1]),
    },
    "quant_linear": {
        "int4_a8_linear": lambda x, weight, scale_min, group: x.new_empty(x.shape[0], weight.shape[0] * ROWS),
        "int4_a8_linear_n": lambda x, weights, scale_mins, group: [x.new_empty(x.shape[0], w.shape[0] * ROWS)
                                                                   for w in weights],
        "int8_a8_linear": lambda x, weight, scale, group: x.new_empty(x.shape[0], weight.shape[0] * ROWS),
        "int4_a8_dense_t": lambda weight, scale_min, group, dtype: weight.new_empty(
            weight.shape[1] * 8, weight.shape[0] * ROWS, dtype=dtype),
        "int4_a8_dense_t_out": lambda weight, scale_min, group, out: None,
        "int8_f32_linear": lambda x, weight, scale: x.new_empty(x.shape[0], weight.shape[0]),
        "w8a8_linear": lambda x, weight, weight_scale, bias: x.new_empty(x.shape[0], weight.shape[0]),
        "int4_a8_from_ggml": lambda raw, kind, perm: _int4_from_ggml_fake(raw, kind),
        "int8_a8_from_ggml": lambda raw, perm, kind=0: _int8_from_ggml_fake(raw, kind),
    },
}


def _int4_from_ggml_fake(raw: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_0, Q4_1, Q4_K, Q4_0 symmetric, Q4_K two-level: bytes and groups of 32 per block
    block_bytes, groups = ((18, 1), (20, 1), (144, 8), (18, 1), (144, 8))[kind]
    g = raw.shape[1] // block_bytes * groups
    rows = raw.shape[0] // ROWS
    scales = (raw.new_empty(rows, g, ROWS, dtype=torch.float16) if kind == 3 else
              raw.new_empty(rows, g // 8, 320) if kind == 4 else
              raw.new_empty(rows, g, 2, ROWS, dtype=torch.bfloat16))
    return raw.new_empty(rows, g * 4, 64), scales


def _int8_from_ggml_fake(raw: torch.Tensor, kind: int) -> torch.Tensor:
    block_bytes, weights = ((34, 32), (210, 256))[kind]  # Q8_0, Q6_K: bytes and weights per block
    k = raw.shape[1] // block_bytes * weights
    return raw.new_empty(raw.shape[0] // ROWS, k // 4, 64)


def _register_fakes(name: str) -> None:
    # a library loaded once per process registers its fakes once; one loaded earlier by another copy of this module
    # (a test reloading it) already has them, which torch before 2.13 refuses to take twice
    for op, fake in _FAKES[name].items():
        try:
            torch.library.register_fake(f"infopt::{op}")(fake)
        except RuntimeError as e:
            if "already has an fake impl" not in str(e):
                raise


def operators(name: str) -> tuple[str, ...]:
    """The ``torch.ops.infopt`` operators the C++ kernel ``name`` registers (besides ``quant_linear_isa``)."""
    return tuple(_FAKES[name])


def load(name: str) -> bool:
    """Build (once) and load the C++ kernel ``name``; True when its operators are registered.

    False when it cannot be built or loaded here: the reason is logged once (warning) and kept in
    :func:`status`; the caller uses its torch reference kernel.

    Raises:
        ValueError: an unknown kernel name.
    """
    if name not in KERNELS:
        raise ValueError(f"unknown C++ kernel {name!r}; known: {', '.join(KERNELS)}")
    state = _STATE.get(name)
    if state is None:
        with _LOCK:
            state = _STATE.get(name)
            if state is None:
                state = _build(name)
                if state is True:
                    _register_fakes(name)
                _STATE[name] = state
                if state is not True:
                    _log.warning("infopt: the %s C++ kernel is not available (%s); using the torch reference "
                                 "kernel instead (same results, slower)", name, state)
    return state is True


def loaded(name: str) -> bool:
    """Whether the C++ kernel ``name`` is loaded already (no build is tried: safe while tracing)."""
    return _STATE.get(name) is True


def status() -> dict[str, bool | str | None]:
    """Each kernel's state: True (loaded), a reason string (not available), None (not tried yet)."""
    return {k: _STATE.get(k) for k in KERNELS}


def build_all() -> dict[str, bool | str | None]:
    """Build and load every kernel now (``make setup`` calls this); returns :func:`status`."""
    for k in KERNELS:
        load(k)
    return status()

