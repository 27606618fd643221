"""Timing helpers shared by the benchmark scripts of this folder (``from _common import ...``: a script run as
``python benchmarks/NAME.py`` has this folder on its path).

- :func:`median_time`: median seconds per call of a function, over timed batches of calls (layer and kernel
  micro-benchmarks);
- :func:`decode_rate`: greedy decode tokens/s of a model as ``(n - 1) / (t(n) - t(1))``, so the prompt's cost
  cancels;
- :func:`empty_caches`: the environment of a child process that starts as on a new machine (empty compile caches).

The machine record that results files carry comes from :func:`infopt.bench.machine_info`. Only the standard library
is imported here.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_time(fn: Callable[[], Any], *, calls: int = 1, runs: int = 5, warmup: int = 3,
                min_s: float | None = None) -> float:
    """Median seconds per call of ``fn()``: ``warmup`` untimed calls, then ``runs`` timed batches of ``calls`` calls
    each, a batch's time divided by its calls.

    With ``min_s``, the batch size starts at ``calls`` and doubles until one batch takes at least ``min_s`` seconds
    (short calls are timed in batches long enough for the clock); that batch is the first of the ``runs``.
    """
    for _ in range(warmup):
        fn()
    times = []
    if min_s is not None:
        while True:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
            calls *= 2
        times.append(dt / calls)
    while len(times) < runs:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _nothing() -> None:
    pass


def decode_rate(model, ids, n: int, sync: Callable[[], Any] | None = None):
    """Greedy decode tokens/s of ``model.generate`` on ``ids``: a 1-token generate, then one of exactly ``n`` new
    tokens, and ``(n - 1) / (t(n) - t(1))`` (the prompt and the first token cost the same in both, so they cancel).
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the first clock read and after each generate. Returns
    ``(tokens/s, the n-token output)``."""
    sync = sync or _nothing
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync()
    return (n - 1) / (time.perf_counter() - t0 - first), out


def empty_caches(folder: Path, extensions: Path) -> dict[str, str]:
    """The environment of a child process whose compile caches (Inductor's, and infopt's AOTInductor packages and
    calibrations) are new folders under ``folder``: a new machine, for its first process; later processes given the
    same environment find what the first built. infopt's C++ kernels are built by the set-up (``make setup``), not by
    an apply or a load, so ``extensions`` (``infopt.core.caches.cache_dir("extensions")``) is linked in."""
    (folder / "infopt").mkdir(parents=True, exist_ok=True)
    (folder / "infopt" / "extensions").symlink_to(extensions, target_is_directory=True)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "INFOPT_CACHE_DIR": str(folder / "infopt")}
