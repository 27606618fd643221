"""Run a callback once a module has been imported, without importing it: for registrations into heavy modules.

``after_import("transformers.quantizers.auto", register)`` calls ``register()`` right away when the
module is already imported, and otherwise right after its first import finishes (whoever imports it),
so ``import infopt`` does not pay for importing it. The hook is a one-shot finder at the front of
``sys.meta_path``: it finds the module's spec with the other finders, wraps the loader's
``exec_module`` to call the callbacks after it, and puts the original loader back on the module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]

_lock = threading.Lock()
_pending: dict[str, list[Callable[[], None]]] = {}


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once ``module`` is imported: now if it already is, else right after its import.

    An exception from ``callback`` propagates out of the import that triggered it (it is not swallowed).

    Example:
        >>> calls = []
        >>> after_import("json", lambda: calls.append("json"))  # json is imported already: runs now
        >>> calls
        ['json']
    """
    with _lock:
        if module not in sys.modules:
            if module not in _pending:
                _pending[module] = []
                sys.meta_path.insert(0, _Finder(module))
            _pending[module].append(callback)
            return
    callback()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, module: str):
        self.module = module

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)  # one shot; the lookup below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, module: str):
        self.inner = inner
        self.module = module

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        # the module's own loader goes back before its code runs: nothing keeps a reference to this wrapper
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        try:
            self.inner.exec_module(module)
        except BaseException:
            sys.meta_path.insert(0, _Finder(self.module))  # the import failed: watch the next attempt
            raise
        with _lock:
            callbacks = _pending.pop(self.module, [])
        for cb in callbacks:
            cb()

    def __getattr__(self, name: str):  # get_source, get_filename, ... for anything that asks during the import
        return getattr(self.inner, name)
