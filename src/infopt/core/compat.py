"""What differs between the transformers versions infopt supports, in one place.

transformers 5.24 renamed the KV cache argument of ``generate``, the models' forwards and their decoder layers from
``past_key_values`` to ``cache`` (the old name still works, with a FutureWarning, until 5.40). infopt passes the
cache under the name the installed version takes, and reads it under either name from hooks' kwargs.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

__all__ = ["CACHE_KWARG", "CACHE_KWARGS", "cache_from", "transformers_version"]


def transformers_version() -> tuple[int, ...]:
    """The installed transformers' release numbers, ``(5, 24, 0)``."""
    return Version(transformers.__version__).release


#: the name of the KV cache argument of ``generate`` and the models' forwards in the installed transformers
CACHE_KWARG = "cache" if transformers_version() >= (5, 24) else "past_key_values"

#: both names, for reading a caller's arguments (either may be given on 5.24 and later)
CACHE_KWARGS = ("cache", "past_key_values")


def cache_from(kwargs: dict[str, Any]) -> Any:
    """The KV cache among a forward's or a hook's keyword arguments, under either name (None when absent).

    Example:
        >>> cache_from({"past_key_values": 1}), cache_from({"cache": 2}), cache_from({})
        (1, 2, None)
    """
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
