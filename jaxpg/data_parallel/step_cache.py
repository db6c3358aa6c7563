"""Compiled training steps cached by what a loss function computes, not by its identity.

torch users write ``ddp.train_step(lambda m, b: loss(m(b[0]), b[1]), batch)`` in a loop: a
new function object each step. Keyed on identity, every call would trace and compile the
step again. :func:`function_key` keys a callable on its code, its default arguments and the
contents of its closure instead:

* a closed-over scalar, string or ``None`` is compared by type and value (``0.1`` captured
  twice is the same key; ``1`` and ``1.0`` are not, since they trace differently);
* a tuple of such values, a nested function, a bound method or a ``functools.partial`` is
  keyed the same way, recursively;
* anything else (an array, a module, a dict) is compared by identity, and the key holds a
  reference to it, so its ``id`` cannot be reused while the cached step lives.

Two callables with equal keys compute the same thing (up to globals, which ``jax.jit``
does not key on either), so the step compiled for one is valid for the other.

:class:`StepCache` also counts the steps compiled for one code object: a loss function
whose closure really does change each call (a captured array, say) compiles a new step
every time, and after :data:`RECOMPILE_WARNING_AFTER` such compiles it warns once, naming
the API and the fix.
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["RECOMPILE_WARNING_AFTER", "CodeKeyed", "StepCache", "code_keyed", "function_key"]

RECOMPILE_WARNING_AFTER = 4
"""Distinct steps compiled for one loss function's code before :class:`StepCache` warns."""

_BY_VALUE = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))


class _Same:
    """Compares by identity and keeps its object alive (so its ``id`` is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _value_key(value: Any, depth: int) -> Hashable:
    if isinstance(value, _BY_VALUE):
        return (type(value), value)
    if depth < 8:
        if isinstance(value, tuple):
            return (tuple, tuple(_value_key(v, depth + 1) for v in value))
        if callable(value) and isinstance(
                value, types.FunctionType | types.MethodType | functools.partial):
            return function_key(value, _depth=depth + 1)
    return _Same(value)


def function_key(fn: Callable[..., Any], *, _depth: int = 0) -> Hashable:
    """A hashable key under which callables that compute the same thing are equal.

    Args:
        fn: a function, lambda, bound method, ``functools.partial`` or any callable.

    Returns:
        For a Python function, its code object with the keys of its defaults and closure
        cells; for a bound method, its function's key and its instance (by identity); for a
        partial, its function's key and arguments; otherwise ``fn`` by identity.

    Example:
        >>> make = lambda scale: (lambda x: x * scale)
        >>> function_key(make(2.0)) == function_key(make(2.0))
        True
        >>> function_key(make(2.0)) == function_key(make(3.0))
        False
    """
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned after the def)
                cells.append(_Same(cell))
                continue
            cells.append(_value_key(contents, _depth))
        defaults = tuple(_value_key(d, _depth) for d in fn.__defaults__ or ())
        kwdefaults = tuple(sorted((k, _value_key(v, _depth))
                                  for k, v in (fn.__kwdefaults__ or {}).items()))
        return ("function", fn.__code__, _Same(fn.__globals__), defaults, kwdefaults,
                tuple(cells))
    if isinstance(fn, types.MethodType):
        return ("method", _value_key(fn.__func__, _depth), _Same(fn.__self__))
    if isinstance(fn, functools.partial):
        return ("partial", _value_key(fn.func, _depth),
                tuple(_value_key(a, _depth) for a in fn.args),
                tuple(sorted((k, _value_key(v, _depth)) for k, v in fn.keywords.items())))
    return _Same(fn)


def _code_of(fn: Callable[..., Any]) -> Any:
    fn = getattr(fn, "__func__", fn)
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__code__", None)


class StepCache:
    """Compiled steps keyed on ``(function_key(loss_fn), mode)``.

    Args:
        api: the method that compiles the steps, named in the recompile warning
            (``"DistributedDataParallel.train_step"``).
    """

    def __init__(self, api: str):
        self.api = api
        self._steps: dict[Hashable, Callable[..., Any]] = {}
        self._per_code: dict[Any, int] = {}
        self._warned = False

    def __len__(self) -> int:
        return len(self._steps)

    def __bool__(self) -> bool:
        return bool(self._steps)

    def get(self, loss_fn: Callable[..., Any], mode: Hashable,
            build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The step for ``loss_fn`` in ``mode``, built by ``build()`` on a miss."""
        key = (function_key(loss_fn), mode)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = build()
            self._count(loss_fn, mode)
        return step

    def _count(self, loss_fn: Callable[..., Any], mode: Hashable) -> None:
        code = _code_of(loss_fn)
        if code is None:
            return
        n = self._per_code[code, mode] = self._per_code.get((code, mode), 0) + 1
        if n >= RECOMPILE_WARNING_AFTER and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.api} compiled a new step {n} times for loss_fn "
                f"{getattr(code, 'co_name', '?')!r} ({code.co_filename}:{code.co_firstlineno}) "
                "because the values it closes over change from call to call (arrays, "
                "modules or other objects captured by the closure are compared by "
                "identity). Each compile takes far longer than a step: define loss_fn once "
                "and pass the changing values in the batch (or as arrays the step reads).",
                stacklevel=4,
            )


class CodeKeyed:
    """``fn``, callable as it is, but equal to and hashed like any callable of the same
    :func:`function_key`: for caches keyed on configurations that hold functions
    (``functools.lru_cache`` over the pipeline's configuration)."""

    __slots__ = ("fn", "key", "__weakref__")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.key = function_key(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CodeKeyed) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __getattr__(self, name: str) -> Any:  # __name__, __wrapped__ and the like
        return getattr(self.fn, name)


_CANONICAL: weakref.WeakValueDictionary[Hashable, CodeKeyed] = weakref.WeakValueDictionary()


def code_keyed(fn: Callable[..., Any] | None) -> CodeKeyed | None:
    """The one live :class:`CodeKeyed` of ``fn``'s key (made on first use), or None for None.

    Returning the same object for equal keys lets caches keyed on the function object
    itself (``jax.eval_shape``'s, ``jax.jit``'s) hit as well."""
    if fn is None or isinstance(fn, CodeKeyed):
        return fn
    keyed = CodeKeyed(fn)
    return _CANONICAL.setdefault(keyed.key, keyed)
