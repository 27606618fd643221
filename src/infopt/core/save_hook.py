"""The one wrapper infopt puts on a model's ``save_pretrained``, and the parts each floor adds to a save.

Quantizing (``infopt.quantize``) and optimizing (``infopt.optimize``) both make ``model.save_pretrained(dir)``
write more than transformers does: around the save, a ``quantization_config`` and a placeholder for each quantized
layer's float weight; after it, the recipe, a README and a manifest. Those parts belong to the floors that own them,
which register them here when imported (``import infopt`` imports both): :mod:`infopt.quantize.serialization.serialize` a
*preparer* (:func:`register_save_preparer`), :mod:`infopt.io` a *writer* (:func:`register_save_writer`). This
module knows neither, so a floor below ``infopt.io`` (``quantize_``, ``load_quantized``, QAT) installs the hook
without importing anything above it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from torch import nn

from .patch import get_handle, wrap_method

__all__ = ["install_save_hook", "register_save_preparer", "register_save_writer"]

Preparer = Callable[[nn.Module, list, dict], AbstractContextManager]
Writer = Callable[[nn.Module, Path, list[Path]], None]

_PREPARERS: list[Preparer] = []
_WRITERS: list[Writer] = []


def register_save_preparer(prepare: Preparer) -> Preparer:
    """Run ``prepare(model, configs, kwargs)`` around every hooked ``save_pretrained``.

    It returns a context manager entered before transformers writes the folder and left after (also when the save
    fails). ``configs`` are the quantize step configs recorded by :func:`install_save_hook` whose layers are still
    in place; ``kwargs`` are the keyword arguments ``save_pretrained`` passes on, which the preparer may change (the
    ``state_dict`` to write). It may raise to refuse the save.

    Args:
        prepare: the preparer; registering the same one twice keeps one.

    Returns:
        ``prepare``, so this works as a decorator.

    Example:
        >>> import contextlib
        >>> @register_save_preparer
        ... @contextlib.contextmanager
        ... def noted(model, configs, kwargs):
        ...     yield
        >>> _PREPARERS.remove(noted)
    """
    if prepare not in _PREPARERS:
        _PREPARERS.append(prepare)
    return prepare


def register_save_writer(write: Writer) -> Writer:
    """Run ``write(model, folder, written)`` after every hooked ``save_pretrained`` has written ``folder``.

    ``written`` lists the ``*.safetensors`` files of ``folder`` the save created or rewrote.

    Args:
        write: the writer; registering the same one twice keeps one.

    Returns:
        ``write``, so this works as a decorator.

    Example:
        >>> @register_save_writer
        ... def noted(model, folder, written):
        ...     pass
        >>> _WRITERS.remove(noted)
    """
    if write not in _WRITERS:
        _WRITERS.append(write)
    return write


def install_save_hook(model: nn.Module, *, step: str = "optimize", quantize_config=None) -> None:
    """Make ``model.save_pretrained(dir)`` load back everywhere: it writes a ``quantization_config``
    (``quant_method: "infopt"``) into ``config.json`` when the model has quantized layers, so plain
    ``from_pretrained`` (with ``import infopt``) rebuilds them, and the recipe, so :func:`infopt.load` rebuilds the
    whole optimized model.

    Called by :func:`infopt.optimize` and :func:`infopt.quantize.quantize_` (once per model: a later call only
    adds ``quantize_config`` to the configs recorded); undone with the rest of the model's changes. The registered
    preparers run around transformers' save and the registered writers after it (see the module docstring).

    Args:
        model: the model whose ``save_pretrained`` is wrapped (on the instance).
        step: the step the wrapping is recorded under.
        quantize_config: a quantize step config applied to the model, listed in the ``quantization_config``.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> model = tiny_model()
        >>> install_save_hook(model)
        >>> "save_pretrained" in model.__dict__, infopt.undo(model), "save_pretrained" in model.__dict__
        (True, 1, False)
    """
    installed = model.__dict__.get("save_pretrained")
    configs = getattr(installed, "infopt_configs", None)
    if configs is not None:
        if quantize_config is not None:
            configs.append((step, quantize_config))
        return
    configs = [] if quantize_config is None else [(step, quantize_config)]

    def make(original):
        def save_pretrained(save_directory, *args, **kwargs):
            live = _live_configs(model, configs)
            out = Path(save_directory)
            with contextlib.ExitStack() as around:
                for prepare in list(_PREPARERS):
                    around.enter_context(prepare(model, live, kwargs))
                before = _mtimes(out)
                result = original(save_directory, *args, **kwargs)
            written = _written_since(out, before)
            for write in list(_WRITERS):
                write(model, out, written)
            return result

        save_pretrained.__doc__ = getattr(original, "__doc__", None)
        save_pretrained.infopt_configs = configs
        return save_pretrained

    wrap_method(model, "save_pretrained", make, step=step)


def _live_configs(model: nn.Module, configs: list) -> list:
    """The quantize configs (of ``(step, config)`` pairs) whose swaps are still in place: a failed step's go."""
    live = {r.step for r in get_handle(model).records if r.kind == "swap" and not r.undone}
    return [c for step, c in configs if step in live]


def _written_since(folder: Path, before: dict[str, int]) -> list[Path]:
    """Safetensors files in ``folder`` created or rewritten since ``before`` (name -> mtime_ns) was taken."""
    if not folder.is_dir():
        return []
    return [p for p in folder.glob("*.safetensors") if before.get(p.name) != p.stat().st_mtime_ns]


def _mtimes(folder: Path) -> dict[str, Any]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")} if folder.is_dir() else {}
