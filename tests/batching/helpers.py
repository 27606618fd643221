"""Test helpers for the batching tests."""

from __future__ import annotations

import threading


def start_queued(engine, threads: list[threading.Thread], n: int) -> None:
    """Start ``threads`` while holding ``engine``'s step lock until ``n`` requests are queued, so the requests
    they submit are all waiting before the first step runs (the test does not race the engine)."""
    with engine._step_lock:
        for t in threads:
            t.start()
        while len(engine._incoming) < n and any(t.is_alive() for t in threads):
            threading.Event().wait(0.01)
    for t in threads:
        t.join(timeout=120)
