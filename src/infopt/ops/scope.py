"""Where the batching engine's packed weights apply: :func:`packed_call` marks the blocks (in this thread) in which
linears packed *scoped* use their packed copies (:mod:`infopt.ops.packed_linear`). A module of its own, so that the
decode loops can enter the scope without registering the operator.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["packed_call", "in_packed_call"]

_SCOPE = threading.local()


@contextlib.contextmanager
def packed_call():
    """Within this block (in this thread) a packed step runs: linears prepacked for the engine's steps only
    (``infopt.compile.packed.pack_linears_(..., scoped=True)``) use their packed copies.
    :meth:`infopt.generate.Forward.packed` enters it; every other forward of the model keeps the plain weights.

    Example:
        >>> with packed_call():
        ...     in_packed_call()
        True
        >>> in_packed_call()
        False
    """
    before = getattr(_SCOPE, "on", False)
    _SCOPE.on = True
    try:
        yield
    finally:
        _SCOPE.on = before


def in_packed_call() -> bool:
    """True inside :func:`packed_call` in this thread."""
    return getattr(_SCOPE, "on", False)
