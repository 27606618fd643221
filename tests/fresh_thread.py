"""Run a test's body in a thread of its own: per-thread state (kept buffers, thread-locals) starts empty there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a new thread; its result returned, or its exception raised again in the caller's thread."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - carried to the caller's thread
            out["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["result"]
