"""A saved folder's content manifest: the SHA-256 of every file a save wrote, checked when the folder is loaded.

``infopt.save_optimized`` and the ``save_pretrained`` of an optimized model write ``infopt_manifest.json``::

    {"format": 1, "algorithm": "sha256",
     "files": {"infopt_model.safetensors": {"size": 221597792, "sha256": "9f0c..."}, "config.json": {...}, ...}}

``infopt.load`` (and plain ``from_pretrained`` with ``import infopt``) checks every listed file before using it, so a
value changed after saving, even one byte inside a tensor that keeps its shape and dtype, raises
:class:`~infopt.core.errors.CheckpointError` naming the file instead of loading a different model. Hashing runs at
about 1.5 GB/s on one core and releases the GIL, so :func:`verify_async` checks while the model is being built.

The manifest guards against damage and edits; it is not a signature: whoever can change the files can rewrite it.
What keeps a folder from running code is that loading runs none (``SECURITY.md``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from .errors import CheckpointError

log = logging.getLogger("infopt")

__all__ = ["MANIFEST_FILE", "write_manifest", "verify_manifest", "verify_async", "file_sha256"]

MANIFEST_FILE = "infopt_manifest.json"
_FORMAT = 1
_CHUNK = 8 << 20  # bytes per read: large enough that hashlib releases the GIL for most of the work


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | Path, files: Iterable[str | Path] | None = None) -> Path:
    """Write (or rewrite) ``folder/infopt_manifest.json`` over ``files`` (paths inside ``folder``; default every
    file under it but the manifest), so a later load refuses any of them changed.

    Run it yourself only after changing a saved folder on purpose (a hand-edited ``generation_config.json``, say).

    Returns:
        The manifest's path.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / "a.json").write_text("{}")
        >>> sorted(json.loads(write_manifest(d).read_text())["files"])
        ['a.json']
    """
    root = Path(folder)
    if files is None:
        paths = [p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE]
    else:
        paths = [root / p if not Path(p).is_absolute() else Path(p) for p in files]
    entries = {}
    for p in sorted(paths):
        rel = p.relative_to(root).as_posix()
        entries[rel] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
    out = root / MANIFEST_FILE
    out.write_text(json.dumps({"format": _FORMAT, "algorithm": "sha256", "files": entries}, indent=1))
    return out


def _fix() -> str:
    return ("The folder was changed or damaged after it was saved: save the model again, or copy the folder again "
            "from its source. If you edited it on purpose, run infopt.io.write_manifest(folder) to record the new "
            "contents")


def verify_manifest(folder: str | Path, *, only: Iterable[str] | None = None) -> list[str] | None:
    """Check the files ``folder``'s manifest lists against their recorded size and SHA-256.

    Args:
        folder: a saved folder.
        only: check just these files (names relative to ``folder``) among those listed.

    Returns:
        The names checked, or None when the folder has no manifest (saved by an infopt before 0.2; logged once per
        folder).

    Raises:
        CheckpointError: a listed file is missing, has another size or other bytes (the message names it), or the
            manifest itself is unreadable.
    """
    root = Path(folder)
    path = root / MANIFEST_FILE
    if not path.is_file():
        log.warning("infopt: %s has no %s (saved before infopt wrote manifests): its files' contents are not checked", root,
                    MANIFEST_FILE)
        return None
    try:
        meta = json.loads(path.read_text())
        files = meta["files"]
        if meta.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError(f"algorithm {meta.get('algorithm')!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a manifest infopt can read ({type(e).__name__}: {e}). {_fix()}") from None
    wanted = set(only) if only is not None else None
    checked = []
    for rel, entry in sorted(files.items()):
        if wanted is not None and rel not in wanted:
            continue
        p = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise CheckpointError(f"{path} lists {rel!r}, which is not inside the folder. {_fix()}")
        if not p.is_file():
            raise CheckpointError(f"{p} is listed in {MANIFEST_FILE} but missing. {_fix()}")
        size = p.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(f"{p} has {size} bytes where {entry.get('size')} were saved. {_fix()}")
        if file_sha256(p) != entry.get("sha256"):
            raise CheckpointError(f"{p} does not hold the bytes that were saved (its SHA-256 differs from "
                                  f"{MANIFEST_FILE}'s). {_fix()}")
        checked.append(rel)
    return checked


class verify_async:  # noqa: N801 - used like a function: verify_async(folder).result()
    """:func:`verify_manifest` in a background thread (hashing releases the GIL): start it, build the model, then
    call :meth:`result` before using the files' contents."""

    def __init__(self, folder: str | Path, *, only: Iterable[str] | None = None):
        self._out: list = [None, None]
        only = list(only) if only is not None else None

        def run():
            try:
                self._out[0] = verify_manifest(folder, only=only)
            except BaseException as e:  # noqa: BLE001 - handed to the caller in result()
                self._out[1] = e

        self._thread = threading.Thread(target=run, name="infopt-verify", daemon=True)
        self._thread.start()

    def result(self) -> list[str] | None:
        """Wait for the check; its return value, or its error raised here."""
        self._thread.join()
        if self._out[1] is not None:
            raise self._out[1]
        return self._out[0]
