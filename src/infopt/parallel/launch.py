"""``launch``: run a function on N local processes joined in a ``torch.distributed`` process group.

For notebooks and tests. Real jobs use ``torchrun`` (see ``docs/parallel.md``); ``launch`` is the
same thing in one call: it spawns ``nprocs`` processes with :mod:`torch.multiprocessing`, gives
them a loopback rendezvous on a free port, initializes the process group, runs ``fn`` and returns
what each rank returned.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "free_port"]

_BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, fn: Callable[..., Any], nprocs: int, backend: str, port: int, args: tuple,
               threads: int | None, out_dir: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException as e:
        # the parent re-raises this text; the spawn error alone loses the remote traceback for some exceptions
        (Path(out_dir) / f"rank{rank}.err").write_text("".join(traceback.format_exception(e)))
        dist.destroy_process_group()
        raise
    # no rank tears its connections down while a peer may still be finishing a send to it: gloo aborts the
    # peer's process (SIGABRT, "terminate called without an active exception") when that races. A barrier
    # that fails means a peer failed; its own error file tells the parent why.
    try:
        dist.barrier()
    except Exception:
        pass
    dist.destroy_process_group()


def launch(fn: Callable[..., Any], nprocs: int = 2, backend: str = "gloo", *, args: tuple = (),
           threads: int | None = 1, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes with an initialized process group.

    Each process gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set as
    ``torchrun`` would, so code written for ``torchrun`` runs unchanged.

    Args:
        fn: a module-level (picklable) function; it runs in fresh ``spawn`` processes, so a function
            defined in a notebook cell must move to an importable module.
        nprocs: number of processes (the world size).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per process).
        args: positional arguments for ``fn`` (picklable).
        threads: ``torch.set_num_threads`` in each process (1 keeps N processes from oversubscribing
            the cores); None leaves torch's default.
        timeout_s: process-group timeout: a collective waiting longer than this fails instead of hanging.

    Returns:
        ``fn``'s return value from each rank, in rank order.

    Raises:
        ValueError: a bad ``nprocs`` or ``backend``.
        RuntimeError: nccl without enough CUDA devices, or a rank failed (the message carries its traceback).

    Example:
        >>> def world():  # in an importable module
        ...     import torch.distributed as dist
        ...     return dist.get_rank(), dist.get_world_size()
        >>> launch(world, nprocs=2)  # doctest: +SKIP
        [(0, 2), (1, 2)]
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"launch(nprocs={nprocs!r}): nprocs must be a positive integer")
    if backend not in _BACKENDS:
        raise ValueError(f"launch(backend={backend!r}); allowed: {', '.join(_BACKENDS)} (gloo on CPU, nccl on CUDA)")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("launch(backend='nccl') needs CUDA devices and none is visible; use backend='gloo' on CPU")
        if torch.cuda.device_count() < nprocs:
            raise RuntimeError(
                f"launch(backend='nccl', nprocs={nprocs}) needs one CUDA device per process; "
                f"{torch.cuda.device_count()} visible. Use nprocs<={torch.cuda.device_count()}"
            )
    with tempfile.TemporaryDirectory(prefix="infopt-launch-") as out_dir:
        try:
            mp.spawn(_rank_main, args=(fn, nprocs, backend, free_port(), tuple(args), threads, out_dir, timeout_s),
                     nprocs=nprocs, join=True)
        except Exception as e:
            errs = sorted(Path(out_dir).glob("rank*.err"))
            if errs:
                first = errs[0]
                raise RuntimeError(f"launch: {first.stem} failed:\n{first.read_text()}") from None
            raise RuntimeError(f"launch: a rank failed: {e}") from None
        results = []
        for r in range(nprocs):
            with open(Path(out_dir) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
