"""Golden files for regression tests: one ``.safetensors`` (tensors) + ``.json`` (metadata) pair per test."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save

from .._version import __version__

__all__ = ["GoldenStore", "GoldenMissingError", "EnvironmentMismatchWarning", "environment_record",
           "sanitize_test_id", "UPDATE_HINT"]

UPDATE_HINT = "run pytest with --infopt-update-golden to record it"
_MAX_STEM = 160


class GoldenMissingError(AssertionError):
    """A test asked for a golden that was never recorded (fails the test; it never passes silently)."""


class EnvironmentMismatchWarning(UserWarning):
    """The environment a golden was recorded in differs from the current one (``--infopt-strict-env`` fails)."""


def sanitize_test_id(nodeid: str) -> str:
    """A file-name stem for a pytest node id: ``tests/test_a.py::test_x[cpu]`` -> ``tests_test_a.py__test_x_cpu``.

    Characters other than letters, digits, ``.``, ``-`` and ``_`` become ``_`` (``::`` becomes ``__``); an
    over-long id is cut and suffixed with a hash of the whole id so two ids never share a file.

    Args:
        nodeid: the pytest node id.

    Returns:
        The stem (no extension).

    Example:
        >>> sanitize_test_id("tests/test_a.py::test_x[cpu]")
        'tests_test_a.py__test_x_cpu'
    """
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", nodeid.replace("::", "__")).strip("_.")
    if len(stem) > _MAX_STEM:
        stem = stem[:_MAX_STEM - 13] + "-" + hashlib.sha256(nodeid.encode()).hexdigest()[:12]
    return stem or "test"


def environment_record(device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What a golden was computed with: library versions, device name, dtype and CPU threads.

    No timestamps or host names, so the same computation on the same stack records the same bytes.

    Args:
        device: the device the test runs on.
        dtype: the compute dtype (default ``torch.get_default_dtype()``).

    Returns:
        A JSON-serialisable dict.

    Example:
        >>> rec = environment_record()
        >>> rec["device"], "torch" in rec
        ('cpu', True)
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.machine() or "cpu"
    return {
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype or torch.get_default_dtype()).removeprefix("torch."),
        "infopt": __version__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
    }


def seed_everything(seed: int = 0) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency of infopt; this only guards a stripped install
        return
    np.random.seed(seed)


class GoldenStore:
    """Reads and writes the golden pair ``<stem>.safetensors`` + ``<stem>.json`` of one test.

    Each assertion owns a *section* (``"generate"``, ``"quality"``, ``"bench"``): its tensors are stored under
    ``"<section>/<name>"`` keys and its metadata under ``json["sections"][section]``, so one test can hold
    several golden checks. Files are written deterministically: tensors sorted by key, contiguous CPU; JSON
    with sorted keys, fixed indentation and no timestamps, so rerunning a lossless fp32 computation rewrites
    identical bytes.

    Args:
        directory: the golden directory (created on the first write).
        stem: file-name stem, usually :func:`sanitize_test_id` of the node id.
        update: record (overwrite) goldens instead of failing when they are missing.
        strict_env: fail, rather than warn, when the recorded environment differs from ``env``.
        env: the current environment record (:func:`environment_record`).
        bench: benchmark regression checks are enabled (``--infopt-bench``).

    Example:
        >>> import tempfile
        >>> g = GoldenStore(tempfile.mkdtemp(), "t", update=True, env={"torch": "x"})
        >>> g.write("generate", {"ids": torch.tensor([1, 2])}, {"n": 1})
        >>> g.read("generate")[1]
        {'n': 1}
    """

    def __init__(self, directory: str | os.PathLike, stem: str, *, update: bool = False, strict_env: bool = False,
                 env: dict[str, Any] | None = None, bench: bool = False):
        self.directory = Path(directory)
        self.stem = stem
        self.update = update
        self.strict_env = strict_env
        self.env = dict(env or {})
        self.bench = bench
        self._env_checked = False

    @property
    def tensor_path(self) -> Path:
        return self.directory / f"{self.stem}.safetensors"

    @property
    def json_path(self) -> Path:
        return self.directory / f"{self.stem}.json"

    def __repr__(self) -> str:
        return f"GoldenStore({str(self.json_path.with_suffix(''))!r}, update={self.update})"

    def _load_json(self) -> dict[str, Any]:
        if not self.json_path.is_file():
            return {}
        return json.loads(self.json_path.read_text(encoding="utf-8"))

    def _load_tensors(self) -> dict[str, torch.Tensor]:
        if not self.tensor_path.is_file():
            return {}
        return load_file(str(self.tensor_path))

    def has(self, section: str) -> bool:
        """Whether ``section`` was recorded."""
        return section in self._load_json().get("sections", {})

    def read(self, section: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, meta)`` of a recorded section, after checking the recorded environment.

        Raises:
            GoldenMissingError: the section (or the files) were never recorded; the message says how to.
            AssertionError: ``strict_env`` and the environment differs.
        """
        doc = self._load_json()
        if section not in doc.get("sections", {}):
            raise GoldenMissingError(f"no '{section}' golden at {self.json_path}; {UPDATE_HINT}")
        self.check_env(doc.get("env", {}))
        prefix = section + "/"
        tensors = {k[len(prefix):]: v for k, v in self._load_tensors().items() if k.startswith(prefix)}
        return tensors, doc["sections"][section]

    def write(self, section: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Record ``section`` (replacing it, keeping the other sections) with the current environment.

        Args:
            section: the assertion's section name.
            tensors: name -> tensor (moved to CPU, made contiguous).
            meta: JSON-serialisable metadata.
        """
        doc = self._load_json()
        old = {k: v for k, v in self._load_tensors().items() if not k.startswith(section + "/")}
        sections = {k: v for k, v in doc.get("sections", {}).items() if k != section}
        sections[section] = meta
        new = {**old, **{f"{section}/{k}": v.detach().to("cpu").contiguous() for k, v in tensors.items()}}
        self.directory.mkdir(parents=True, exist_ok=True)
        out = {"env": self.env, "format": 1, "sections": sections}
        self.json_path.write_text(json.dumps(out, sort_keys=True, indent=2) + "\n", encoding="utf-8")
        if new:
            # sorted keys, no metadata (it lives in the JSON): same tensors -> same bytes
            self.tensor_path.write_bytes(save({k: new[k] for k in sorted(new)}))
        elif self.tensor_path.exists():
            self.tensor_path.unlink()
        self._env_checked = True

    def check_env(self, recorded: dict[str, Any]) -> None:
        """Warn (or, with ``strict_env``, fail) when ``recorded`` differs from the current environment."""
        if self._env_checked or not self.env:
            return
        self._env_checked = True
        diff = {k: (recorded.get(k), self.env.get(k)) for k in sorted(set(recorded) | set(self.env))
                if recorded.get(k) != self.env.get(k)}
        if not diff:
            return
        lines = ", ".join(f"{k}: recorded {a!r}, now {b!r}" for k, (a, b) in diff.items())
        msg = (f"golden {self.json_path.name} was recorded in a different environment ({lines}); numerics may "
               f"differ. Re-record with --infopt-update-golden if the change is intended")
        if self.strict_env:
            raise AssertionError(msg + " (--infopt-strict-env is set)")
        warnings.warn(msg, EnvironmentMismatchWarning, stacklevel=3)
