"""Where infopt keeps files between runs, and how much: one root, one folder per kind, one size limit per kind.

Every setting is an environment variable named ``INFOPT_CACHE_*``:

========================================  =======================================================================
``INFOPT_CACHE_DIR``                      the root (default ``~/.cache/infopt``); each kind is a folder in it
``INFOPT_CACHE_AOTI_MB``                  AOTInductor packages of compiled decode steps (default 2048)
``INFOPT_CACHE_CALIBRATION``              calibration results: ``memory`` (default), ``disk`` (also on disk), ``off``
``INFOPT_CACHE_CALIBRATION_MB``           calibration results on disk (default 4096)
========================================  =======================================================================

The kinds are ``models`` (the embedded default model converted from its GGUF), ``aoti``, ``calibration`` and
``extensions`` (infopt's C++ kernels built for this machine). A bounded kind is pruned when a new entry is written,
the entries used longest ago first (a use refreshes an entry's modification time). Nothing here is ever filled from
a folder someone handed you: see :func:`infopt.load` and ``SECURITY.md``.

Earlier names (``INFOPT_CACHE``, ``INFOPT_EXTENSIONS_DIR``, ``INFOPT_AOT_CACHE_MB``, ``INFOPT_CALIBRATION_CACHE``)
are still read, with a warning naming the new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path

log = logging.getLogger("infopt")

__all__ = ["ROOT_VAR", "KINDS", "cache_root", "cache_dir", "calibration_mode", "limit_bytes", "setting", "prune", "touch"]

ROOT_VAR = "INFOPT_CACHE_DIR"
"""The environment variable naming the cache root."""

KINDS: dict[str, int | None] = {"models": None, "aoti": 2048, "calibration": 4096, "extensions": None}
"""Each kind of cached file and its default size limit in megabytes (None: not bounded; these hold one small entry
per model or per torch build)."""

# old name -> (new name, how the old value maps: "root", "folder" of a kind, or "same" value)
_RENAMED = {
    "INFOPT_CACHE": (ROOT_VAR, "same"),
    "INFOPT_AOT_CACHE_MB": ("INFOPT_CACHE_AOTI_MB", "same"),
}
_warned: set[str] = set()


def _deprecated(old: str, new: str) -> None:
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"infopt: the environment variable {old} is deprecated; set {new} instead", FutureWarning,
                      stacklevel=3)


def setting(name: str) -> str | None:
    """The value of the ``INFOPT_CACHE_*`` variable ``name`` (an earlier name's, with a warning, when only that one is
    set), or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if value:
        return value
    for old, (new, _) in _RENAMED.items():
        if new == name and os.environ.get(old, "").strip():
            _deprecated(old, new)
            return os.environ[old].strip()
    return None


def cache_root() -> Path:
    """``$INFOPT_CACHE_DIR``, else ``~/.cache/infopt``."""
    root = setting(ROOT_VAR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "infopt"


def cache_dir(kind: str) -> Path:
    """The folder of one kind of cached file (not created here).

    Raises:
        ValueError: an unknown kind.

    Example:
        >>> cache_dir("aoti").name
        'aoti'
    """
    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "extensions" and os.environ.get("INFOPT_EXTENSIONS_DIR", "").strip() and not setting(ROOT_VAR):
        _deprecated("INFOPT_EXTENSIONS_DIR", ROOT_VAR)
        return Path(os.environ["INFOPT_EXTENSIONS_DIR"].strip()).expanduser()
    if kind == "calibration":
        old = os.environ.get("INFOPT_CALIBRATION_CACHE", "").strip()
        if old and old.lower() not in _CALIBRATION_MODES and not setting("INFOPT_CACHE_CALIBRATION"):
            _deprecated("INFOPT_CALIBRATION_CACHE", f"{ROOT_VAR} (the folder) and INFOPT_CACHE_CALIBRATION=disk")
            return Path(old).expanduser()
    return cache_root() / kind


_CALIBRATION_MODES = ("", "memory", "1", "on", "off", "0", "none", "false", "disk")


def calibration_mode() -> str:
    """``"off"``, ``"memory"`` or ``"disk"``: from ``INFOPT_CACHE_CALIBRATION`` (the earlier
    ``INFOPT_CALIBRATION_CACHE`` also took a folder, which means ``disk`` there)."""
    value = (os.environ.get("INFOPT_CACHE_CALIBRATION") or "").strip().lower()
    if not value:
        old = os.environ.get("INFOPT_CALIBRATION_CACHE", "").strip()
        if old:
            _deprecated("INFOPT_CALIBRATION_CACHE", "INFOPT_CACHE_CALIBRATION")
            value = old.lower() if old.lower() in _CALIBRATION_MODES else "disk"
    if value in ("", "memory", "1", "on"):
        return "memory"
    if value in ("off", "0", "none", "false"):
        return "off"
    if value == "disk":
        return "disk"
    raise ValueError(f"INFOPT_CACHE_CALIBRATION={value!r}: use memory (the default), disk or off")


def limit_bytes(kind: str) -> int | None:
    """How many bytes a kind may hold: ``$INFOPT_CACHE_<KIND>_MB`` megabytes, else its default (:data:`KINDS`); None
    for a kind that is not bounded.

    Raises:
        ValueError: the variable is not a number.
    """
    default = KINDS[kind]
    if default is None:
        return None
    name = f"INFOPT_CACHE_{kind.upper()}_MB"
    raw = setting(name)
    if raw is None:
        return int(default * 1e6)
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of megabytes (e.g. {default})") from None
    if mb < 0:
        raise ValueError(f"{name}={raw!r} is negative; give a number of megabytes (e.g. {default})")
    return int(mb * 1e6)


def touch(*paths: Path) -> None:
    """Mark entries as used now (pruning drops those used longest ago first)."""
    for p in paths:
        with contextlib.suppress(OSError):
            os.utime(p)


def prune(folder: Path, kind: str, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Delete the entries of ``folder`` used longest ago until the rest fit in :func:`limit_bytes` of ``kind``.

    An entry is the files sharing a name before the first dot (a calibration result is ``<key>.safetensors`` and
    ``<key>.json``); its age is its newest file's modification time. Hidden files (writes in progress) are left
    alone, as are the entries of ``keep``.

    Returns:
        The files deleted.
    """
    limit = limit_bytes(kind)
    if limit is None or not folder.is_dir():
        return []
    keep_stems = {p.name.split(".", 1)[0] for p in keep}
    entries: dict[str, list] = {}
    for f in folder.iterdir():
        if f.name.startswith(".") or not f.is_file():
            continue
        try:
            st = f.stat()
        except OSError:  # deleted by another process meanwhile
            continue
        e = entries.setdefault(f.name.split(".", 1)[0], [0.0, 0, []])
        e[0], e[1] = max(e[0], st.st_mtime), e[1] + st.st_size
        e[2].append(f)
    total = sum(e[1] for e in entries.values())
    gone: list[Path] = []
    for stem, (_, size, files) in sorted(entries.items(), key=lambda kv: kv[1][0]):
        if total <= limit:
            break
        if stem in keep_stems:
            continue
        for f in files:
            with contextlib.suppress(OSError):
                f.unlink()
                gone.append(f)
        total -= size
    if gone:
        log.info("infopt: %d cached file(s) pruned from %s (over INFOPT_CACHE_%s_MB)", len(gone), folder,
                 kind.upper())
    return gone
