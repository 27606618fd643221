"""The one mechanism for every in-place mutation infopt makes, each recorded so it can be undone.

Every change to a user's model goes through a function here: swapping a submodule, wrapping an
instance method (``model.generate``), registering a hook, setting an attribute (config fields
included), or a custom change with its own undo. Each returns a record kept in the model's
:class:`PatchHandle`; :func:`undo` replays the records backwards and restores the model exactly:
the same module objects, parameters, buffers, methods and config values.

Only instances are patched, never classes or ``transformers`` module globals.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "PatchHandle",
    "PatchRecord",
    "get_handle",
    "has_patches",
    "swap_module",
    "wrap_method",
    "register_hook",
    "set_attr",
    "record_custom",
    "undo",
    "ModelSlot",
    "STATE_PREFIX",
]

STATE_PREFIX = "_infopt_"
_MISSING = object()


class ModelSlot:
    """One piece of per-model state infopt keeps (a decoder, an engine, counters), stored in the model's
    ``__dict__`` as ``_infopt_<name>``.

    The state's objects usually reference the model, so a module-level table keyed by the model would
    keep every model it ever saw alive; an attribute makes it a cycle freed with the model. It is
    not a submodule, parameter or buffer: ``state_dict``, ``save_pretrained`` and ``to`` ignore it.

    Example:
        >>> slot = ModelSlot("example")
        >>> m = nn.Linear(2, 2)
        >>> slot.get(m) is None
        True
        >>> slot[m] = 3; slot.get(m)
        3
        >>> slot.pop(m), slot.get(m)
        (3, None)
    """

    def __init__(self, name: str):
        self.attr = STATE_PREFIX + name

    def get(self, model: nn.Module, default: Any = None) -> Any:
        return model.__dict__.get(self.attr, default)

    def __setitem__(self, model: nn.Module, value: Any) -> None:
        model.__dict__[self.attr] = value

    def __getitem__(self, model: nn.Module) -> Any:
        try:
            return model.__dict__[self.attr]
        except KeyError:
            raise KeyError(f"{type(model).__name__} has no infopt {self.attr[len(STATE_PREFIX):]} state") from None

    def pop(self, model: nn.Module, default: Any = None) -> Any:
        return model.__dict__.pop(self.attr, default)


# the handle's undo closures reference the model (a wrapped ``generate``, a swap on the root): kept on the model,
# not in a table keyed by it, so a dropped model is freed with its handle
_HANDLES = ModelSlot("patch_handle")


@dataclass
class PatchRecord:
    """One recorded mutation.

    Attributes:
        kind: ``swap``, ``method``, ``hook``, ``attr`` or ``custom``.
        target: a human-readable description (``model.layers.0.mlp.up_proj``).
        step: the recipe step that made it (its ``key``), for the report.
        restore: the callable that reverts it.
    """

    kind: str
    target: str
    step: str | None
    restore: Callable[[], None]
    undone: bool = False

    def revert(self) -> None:
        if not self.undone:
            self.restore()
            self.undone = True


@dataclass
class PatchHandle:
    """Every mutation infopt made to one model, in the order they were made."""

    records: list[PatchRecord] = field(default_factory=list)
    _spill_dir: str | None = None
    _spill_cleanup: weakref.finalize | None = None

    def __deepcopy__(self, memo: dict) -> PatchHandle:
        # A deep copy of a patched model gets an empty handle: the records' closures point at the
        # original model's modules, so replaying them on the copy would undo the original.
        return PatchHandle()

    def __reduce__(self):
        # Pickling a model keeps no undo history (closures cannot be pickled, and a spill file
        # belongs to this process).
        return (PatchHandle, ())

    def add(self, record: PatchRecord) -> PatchRecord:
        self.records.append(record)
        return record

    def counts(self) -> dict[str, int]:
        """Number of live records per kind."""
        out: dict[str, int] = {}
        for r in self.records:
            if not r.undone:
                out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def spill_dir(self) -> str:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="infopt-undo-")
            # removed on undo, when the model (and so this handle) is garbage-collected, or at exit
            self._spill_cleanup = weakref.finalize(self, shutil.rmtree, self._spill_dir, ignore_errors=True)
        return self._spill_dir

    def undo(self) -> int:
        """Revert every record, newest first. Returns how many were reverted."""
        n = 0
        for record in reversed(self.records):
            if not record.undone:
                record.revert()
                n += 1
        self.records.clear()
        if self._spill_cleanup is not None:
            self._spill_cleanup()
            self._spill_cleanup = None
            self._spill_dir = None
        return n


def get_handle(model: nn.Module) -> PatchHandle:
    """The model's :class:`PatchHandle`, created empty on first use.

    The handle is kept in the model's ``__dict__`` (``_infopt_patch_handle``, not a submodule,
    parameter or buffer, so ``state_dict`` and saving are unaffected) and removed by :func:`undo`.
    A patched model that is dropped without ``undo`` is freed with its handle, and the temporary
    folder holding its spilled original weights is deleted then (or at interpreter exit).
    """
    handle = _HANDLES.get(model)
    if handle is None:
        handle = PatchHandle()
        _HANDLES[model] = handle
    return handle


def has_patches(model: nn.Module) -> bool:
    """True when infopt has live changes recorded on ``model``."""
    handle = _HANDLES.get(model)
    return bool(handle and any(not r.undone for r in handle.records))


def _resolve_parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    if not fqn:
        raise ValueError("swap_module needs the dotted name of a submodule, not the model itself")
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not hasattr(parent, child):
        raise AttributeError(f"{type(parent).__name__} at '{parent_name or '<root>'}' has no submodule '{child}'")
    return parent, child


def _spill_params(model: nn.Module, old: nn.Module, handle: PatchHandle, fqn: str) -> Callable[[], None]:
    """Move the tensors only ``old`` owns to a safetensors file; return the function that brings them back.

    Tensors shared with the rest of the model (a tied ``lm_head``/embedding) stay where they are:
    the model still uses them, so spilling them would free nothing. Tensors that are all zeros (a blank model
    being rebuilt by :func:`infopt.load`) are not written: undo makes them again.
    """
    old_ids = {id(t) for t in list(old.parameters()) + list(old.buffers())}
    still_used: set[int] = set()
    for name, p in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if name == fqn or name.startswith(fqn + "."):
            continue
        still_used.add(id(p))
    owned = {}
    tensors: dict[str, torch.Tensor] = {}
    zeros: dict[str, tuple] = {}  # name -> (shape, strides) of a tensor that held only zeros
    for name, t in list(old.named_parameters(remove_duplicate=True)) + list(old.named_buffers(remove_duplicate=True)):
        if t is None or id(t) in still_used or id(t) not in old_ids:
            continue
        owned[name] = (t, t.device)
        if t.is_contiguous() and not t.any():
            zeros[name] = (tuple(t.shape), t.stride())
        else:
            tensors[name] = t.detach().to("cpu").contiguous()
    if not owned:
        return lambda: None
    path = os.path.join(handle.spill_dir(), f"{len(handle.records)}-{fqn}.safetensors") if tensors else None
    if path is not None:
        save_file(tensors, path)
    for t, _ in owned.values():
        # keep the Parameter/buffer object (identity matters for optimizers and ties); free its storage
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def bring_back() -> None:
        loaded = load_file(path) if path is not None else {}
        for name, (t, device) in owned.items():
            if name in zeros:
                t.data = torch.zeros(zeros[name][0], dtype=t.dtype, device=device)
            else:
                t.data = loaded[name].to(device)
        if path is not None:
            os.remove(path)

    return bring_back


def swap_module(
    model: nn.Module,
    fqn: str,
    new: nn.Module,
    *,
    step: str | None = None,
    keep_original: str = "memory",
) -> PatchRecord:
    """Replace the submodule at ``fqn`` with ``new`` (``setattr`` on its parent), recorded for undo.

    Args:
        model: the root model.
        fqn: dotted name of the submodule to replace (``model.layers.0.mlp.up_proj``).
        new: the replacement module.
        step: the recipe step making the change (for the report).
        keep_original: ``"memory"`` keeps the original module as it is (fastest undo); ``"disk"``
            moves the tensors it alone owns to a temporary safetensors file, so the memory a
            quantized replacement saves is really freed and undo still restores bit-identical weights.

    Returns:
        The :class:`PatchRecord`.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2))
        >>> _ = swap_module(m, "0", nn.Identity())
        >>> type(m[0]).__name__
        'Identity'
        >>> _ = undo(m)
        >>> type(m[0]).__name__
        'Linear'
    """
    if keep_original not in ("memory", "disk"):
        raise ValueError(f"keep_original={keep_original!r}; allowed: 'memory', 'disk'")
    handle = get_handle(model)
    parent, child = _resolve_parent(model, fqn)
    old = getattr(parent, child)
    bring_back = _spill_params(model, old, handle, fqn) if keep_original == "disk" else (lambda: None)
    setattr(parent, child, new)

    def restore() -> None:
        bring_back()
        setattr(parent, child, old)

    return handle.add(PatchRecord("swap", fqn, step, restore))


def wrap_method(
    obj: Any,
    name: str,
    make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    model: nn.Module | None = None,
    step: str | None = None,
) -> PatchRecord:
    """Replace the instance method ``obj.name`` with ``make_wrapper(original_bound_method)``.

    The wrapper is stored on the instance only (``obj.__dict__``); the class is untouched. Undo
    removes the instance attribute, or restores a previous instance-level override.

    Args:
        obj: the instance (usually the model) whose method is wrapped.
        name: method name (``"generate"``, ``"forward"``).
        make_wrapper: receives the current bound method, returns the replacement callable.
        model: the model whose handle records the patch (defaults to ``obj``).
        step: the recipe step making the change.
    """
    owner = model if model is not None else obj
    previous = obj.__dict__.get(name, _MISSING)
    original = getattr(obj, name)
    wrapper = make_wrapper(original)
    object.__setattr__(obj, name, wrapper)

    def restore() -> None:
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            object.__setattr__(obj, name, previous)

    return get_handle(owner).add(PatchRecord("method", f"{type(obj).__name__}.{name}", step, restore))


def register_hook(
    model: nn.Module,
    module: nn.Module,
    fn: Callable[..., Any],
    *,
    kind: str = "forward_pre",
    step: str | None = None,
    with_kwargs: bool = False,
) -> PatchRecord:
    """Register a forward or forward-pre hook on ``module`` (a submodule of ``model``), recorded for undo."""
    if kind == "forward_pre":
        h = module.register_forward_pre_hook(fn, with_kwargs=with_kwargs)
    elif kind == "forward":
        h = module.register_forward_hook(fn, with_kwargs=with_kwargs)
    else:
        raise ValueError(f"hook kind={kind!r}; allowed: 'forward_pre', 'forward'")
    return get_handle(model).add(PatchRecord("hook", f"{type(module).__name__}:{kind}", step, h.remove))


def set_attr(model: nn.Module, obj: Any, name: str, value: Any, *, step: str | None = None) -> PatchRecord:
    """Set ``obj.name = value`` (a config field, a generation-config field, a model attribute), recorded.

    Undo restores the previous value, or deletes the attribute if it did not exist.
    """
    had = name in getattr(obj, "__dict__", {}) or hasattr(obj, name)
    old = getattr(obj, name, _MISSING) if had else _MISSING
    setattr(obj, name, value)

    def restore() -> None:
        if old is _MISSING:
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        else:
            setattr(obj, name, old)

    return get_handle(model).add(PatchRecord("attr", f"{type(obj).__name__}.{name}", step, restore))


def record_custom(model: nn.Module, target: str, restore: Callable[[], None], *, step: str | None = None) -> PatchRecord:
    """Record a change made some other way, with the callable that reverts it."""
    return get_handle(model).add(PatchRecord("custom", target, step, restore))


def undo(model: nn.Module) -> int:
    """Revert every change infopt made to ``model``, newest first.

    Returns:
        The number of recorded changes reverted (0 for a model infopt never touched).

    Example:
        >>> m = nn.Linear(2, 2)
        >>> _ = set_attr(m, m, "flag", 1)
        >>> undo(m), hasattr(m, "flag")
        (1, False)
    """
    handle = _HANDLES.pop(model)
    if handle is None:
        return 0
    return handle.undo()
