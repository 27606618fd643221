"""Calibrated quantizers run once: their results cached by the model's weights, the step's config and the calibration ids.

GPTQ, AWQ, SmoothQuant and QAT spend minutes (GPTQ on the default model's 30 layers: about five) computing
replacement layers from activations. The result depends only on

- the model: every parameter and buffer (full SHA-256 of their bytes, with names, shapes and dtypes), its
  config, its attention implementation and the type of every submodule (a patched module computes
  different activations);
- the step: its config (``to_dict``) and the layers it targets;
- the calibration token ids ``[n, seq]``;
- the code: the infopt and torch versions.

Those make the key. The weights are hashed in full, not sampled: SHA-256 runs at about 1.5 GB/s here
(0.35 s for the default model's 540 MB of fp32), which is nothing beside a calibration, and a sampled
hash would miss a fine-tune that moved a few rows. The in-memory cache (on by default, a few entries,
least recently used first out) holds deep copies of the replacement modules; a hit hands out fresh
deep copies, bit-identical to the first run's. So ``infopt bench``'s repeats, ``undo`` then ``optimize``
again, and the tuner's candidates calibrate once per process.

The disk cache is opt-in (``INFOPT_CACHE_CALIBRATION=disk``: ``$INFOPT_CACHE_DIR/calibration``, else
``~/.cache/infopt/calibration``): entries are the modules' state dicts (safetensors, no pickle) loaded over modules the
quantizer rebuilds with ``rebuild=True``, as :func:`infopt.load` does; each is tens to hundreds of MB,
so a library should not fill a home folder unasked, and the folder is kept under ``INFOPT_CACHE_CALIBRATION_MB``
megabytes (4096 by default), the entries used longest ago deleted first. ``INFOPT_CACHE_CALIBRATION=off`` disables
both (:mod:`infopt.core.caches`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..._version import __version__
from ...core.caches import cache_dir, calibration_mode, prune, touch

__all__ = ["CalibrationCache", "CACHE", "ENV_VAR", "weights_fingerprint", "cache_key", "cached_plan"]

ENV_VAR = "INFOPT_CACHE_CALIBRATION"
"""``off`` (no caching), unset or ``memory`` (in-process only, the default), or ``disk`` (also
``$INFOPT_CACHE_DIR/calibration``)."""


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # any dtype (bfloat16 has no numpy type): reinterpret the contiguous storage as bytes
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, shape, dtype, bytes), the config, the attention
    implementation and every submodule's type.

    Args:
        model: any ``nn.Module`` (a transformers model also contributes its config).

    Returns:
        A 64-character hex digest; equal digests mean the same weights feeding the same computation.

    Example:
        >>> from infopt.models import tiny_model
        >>> weights_fingerprint(tiny_model(seed=0)) == weights_fingerprint(tiny_model(seed=0))
        True
        >>> weights_fingerprint(tiny_model(seed=0)) == weights_fingerprint(tiny_model(seed=1))
        False
    """
    h = hashlib.sha256()
    seen: set[int] = set()
    for kind, items in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t is None:
                continue
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}".encode())
            if id(t) in seen:  # a tied weight: its name is recorded, its bytes once
                continue
            seen.add(id(t))
            h.update(_tensor_bytes(t))
    for name, mod in model.named_modules():
        h.update(f"m:{name}:{type(mod).__module__}.{type(mod).__qualname__}".encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
        h.update(str(getattr(config, "_attn_implementation", None)).encode())
    return h.hexdigest()


def cache_key(model: nn.Module, config: Any, targets: list, ids: torch.Tensor | None) -> str:
    """The cache key of calibrating ``model`` with ``config`` on ``targets`` and calibration ids ``ids``.

    Args:
        model: the model about to be quantized.
        config: the step config (a :class:`~infopt.core.step.StepConfig`).
        targets: the :class:`~infopt.quantize.api.Target` layers (their names enter the key).
        ids: calibration token ids ``[n, seq]``.

    Returns:
        A hex digest.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import GPTQ
        >>> m = tiny_model()
        >>> cache_key(m, GPTQ(group_size=32), [], torch.zeros(1, 4, dtype=torch.long)) != cache_key(
        ...     m, GPTQ(group_size=64), [], torch.zeros(1, 4, dtype=torch.long))
        True
    """
    h = hashlib.sha256()
    h.update(weights_fingerprint(model).encode())
    h.update(type(config).__qualname__.encode())
    h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    h.update(json.dumps([t.fqn for t in targets]).encode())
    if ids is not None:
        h.update(f"{tuple(ids.shape)}:{ids.dtype}".encode())
        h.update(_tensor_bytes(ids))
    h.update(f"infopt {__version__} torch {torch.__version__}".encode())
    return h.hexdigest()


def _type_name(mod: nn.Module) -> str:
    return f"{type(mod).__module__}.{type(mod).__qualname__}"


def _nbytes(mods: dict[str, nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in mods.values()
               for t in (*m.parameters(), *m.buffers()) if t is not None)


class CalibrationCache:
    """In-memory (and optionally on-disk) store of calibrated plans ``{fqn: module}`` plus JSON-able extras.

    Args:
        max_entries: entries kept in memory (least recently used evicted first).
        max_bytes: bytes of module weights kept in memory.
        mode: ``"off"``, ``"memory"`` or ``"disk"``; None reads :data:`ENV_VAR` at each use.
        directory: the disk folder (None: ``$INFOPT_CACHE_DIR/calibration``, :mod:`infopt.core.caches`).

    Attributes:
        hits, misses: counters since creation (or :meth:`clear`).

    Example:
        >>> cache = CalibrationCache(mode="memory")
        >>> plan, extra = cache.get_or_compute("k", lambda: ({"a": nn.Linear(2, 2)}, {"n": 1}))
        >>> plan2, _ = cache.get_or_compute("k", lambda: 1 / 0)
        >>> bool(torch.equal(plan["a"].weight, plan2["a"].weight)), plan["a"] is plan2["a"], cache.hits
        (True, False, 1)
    """

    def __init__(self, max_entries: int = 8, max_bytes: int = 2 * 2**30, *, mode: str | None = None,
                 directory: str | os.PathLike | None = None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._mode = mode
        self._directory = directory
        self._mem: OrderedDict[str, tuple[dict[str, nn.Module], dict[str, Any]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    # -- settings --------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"off"``, ``"memory"`` or ``"disk"`` (from the constructor, else :data:`ENV_VAR`)."""
        if self._mode is not None:
            return self._mode
        return calibration_mode()

    @property
    def directory(self) -> Path:
        """The disk cache folder."""
        if self._directory is not None:
            return Path(self._directory).expanduser()
        return cache_dir("calibration")

    def clear(self) -> None:
        """Forget the in-memory entries and reset the counters (disk entries stay)."""
        self._mem.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._mem)

    # -- the one entry point -----------------------------------------------------------------------------
    def get_or_compute(self, key: str, compute: Callable[[], tuple[dict[str, nn.Module], dict[str, Any]]],
                       rebuild: Callable[[list[str]], dict[str, nn.Module]] | None = None
                       ) -> tuple[dict[str, nn.Module], dict[str, Any]]:
        """The cached ``(plan, extra)`` for ``key``, else ``compute()``'s (then stored).

        Args:
            key: from :func:`cache_key`.
            compute: runs the calibration: ``({fqn: module}, JSON-able extras)``.
            rebuild: ``rebuild(fqns) -> {fqn: module}``: modules of the plan's structure for those names (the
                quantizer's ``rebuild=True`` path), which a disk entry's state dicts are loaded into; None keeps
                this entry out of the disk cache.

        Returns:
            ``(plan, extra)``: the plan's modules are fresh copies the caller may swap into a model.
        """
        mode = self.mode
        if mode == "off":
            return compute()
        got = self._mem.get(key)
        if got is None and mode == "disk" and rebuild is not None:
            got = self._load(key, rebuild)
            if got is not None:
                self._remember(key, *got)
        if got is not None:
            self._mem.move_to_end(key)
            self.hits += 1
            return {f: copy.deepcopy(m) for f, m in got[0].items()}, copy.deepcopy(got[1])
        self.misses += 1
        plan, extra = compute()
        self._remember(key, {f: copy.deepcopy(m) for f, m in plan.items()}, copy.deepcopy(extra))
        if mode == "disk" and rebuild is not None:
            self._save(key, plan, extra)
        return plan, extra

    def _remember(self, key: str, plan: dict[str, nn.Module], extra: dict[str, Any]) -> None:
        if _nbytes(plan) > self.max_bytes:
            return
        self._mem[key] = (plan, extra)
        self._mem.move_to_end(key)
        while len(self._mem) > self.max_entries or sum(_nbytes(p) for p, _ in self._mem.values()) > self.max_bytes:
            self._mem.popitem(last=False)

    # -- disk ----------------------------------------------------------------------------------------------
    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.directory
        return d / f"{key}.safetensors", d / f"{key}.json"

    def _save(self, key: str, plan: dict[str, nn.Module], extra: dict[str, Any]) -> None:
        weights, meta = self._paths(key)
        weights.parent.mkdir(parents=True, exist_ok=True)
        state = {}
        for fqn, mod in plan.items():
            for k, v in mod.state_dict().items():
                state[f"{fqn}::{k}"] = v.detach().cpu().contiguous()
        tmp = weights.with_name(f".{weights.name}.{os.getpid()}.tmp")  # hidden: pruning leaves it alone
        save_file(state, str(tmp))
        os.replace(tmp, weights)  # readers never see half a file
        meta.write_text(json.dumps({"modules": {f: _type_name(m) for f, m in sorted(plan.items())}, "extra": extra},
                                   default=str))
        prune(weights.parent, "calibration", keep=(weights,))

    def _load(self, key: str, rebuild: Callable[[list[str]], dict[str, nn.Module]]
              ) -> tuple[dict[str, nn.Module], dict[str, Any]] | None:
        weights, meta = self._paths(key)
        if not (weights.exists() and meta.exists()):
            return None
        touch(weights, meta)  # used now: pruned last
        info = json.loads(meta.read_text())
        plan = rebuild(list(info["modules"]))
        if {f: _type_name(m) for f, m in plan.items()} != info["modules"]:
            return None  # written by a quantizer that planned other modules: recalibrate
        state = load_file(str(weights))
        for fqn, mod in plan.items():
            device = next((t.device for t in (*mod.parameters(), *mod.buffers()) if t is not None), "cpu")
            sub = {k.split("::", 1)[1]: v.to(device) for k, v in state.items() if k.split("::", 1)[0] == fqn}
            mod.load_state_dict(sub, strict=True)
        return plan, info.get("extra", {})


CACHE = CalibrationCache()
"""The process-wide cache :func:`infopt.quantize.quantize_` and the QAT step use."""


def cached_plan(model: nn.Module, config: Any, targets: list, ids: torch.Tensor,
                compute: Callable[[], tuple[dict[str, nn.Module], dict[str, Any]]],
                rebuild: Callable[[], dict[str, nn.Module]] | None = None,
                cache: CalibrationCache | None = None) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """``compute()``'s ``(plan, extra)`` for calibrating ``model`` with ``config``, through the cache.

    Args:
        model, config, targets, ids: what the calibration depends on (see :func:`cache_key`).
        compute: the calibration itself.
        rebuild: the quantizer's structure-only plan (enables the disk cache for this entry); modules the
            calibrated plan has beyond it (a norm with scales folded in) are copies of the model's own.
        cache: default :data:`CACHE`.

    Returns:
        ``(plan, extra)``.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import GPTQ
        >>> m, c = tiny_model(), CalibrationCache(mode="memory")
        >>> ids = torch.zeros(1, 4, dtype=torch.long)
        >>> _ = cached_plan(m, GPTQ(group_size=32), [], ids, lambda: ({}, {}), cache=c)
        >>> _ = cached_plan(m, GPTQ(group_size=32), [], ids, lambda: 1 / 0, cache=c)
        >>> c.hits, c.misses
        (1, 1)
    """
    cache = CACHE if cache is None else cache
    if cache.mode == "off":
        return compute()
    structure = None
    if rebuild is not None:
        def structure(fqns: list[str]) -> dict[str, nn.Module]:
            plan = rebuild()
            return {f: plan[f] if f in plan else copy.deepcopy(model.get_submodule(f)) for f in fqns}

    return cache.get_or_compute(cache_key(model, config, targets, ids), compute, structure)
