"""Work: the handle an ``async_op=True`` collective returns, as torch's ``Work``."""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from typing import Any

import jax

from jaxpg.errors import DistTimeoutError

__all__ = ["Work"]


def _leaves(result: Any) -> list[Any]:
    """The concrete arrays of ``result``; traced values (SPMD code) are always "ready"."""
    return [x for x in jax.tree.leaves(result)
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]


class Work:
    """A pending collective. JAX dispatch is already asynchronous; ``wait`` blocks on it.

    Args:
        result: the collective's result (arrays still being computed), or None.
        api: the collective's name, for messages.
        error: an exception the collective raised, re-raised by ``wait``.
    """

    def __init__(self, result: Any = None, api: str = "collective",
                 error: BaseException | None = None):
        self._result = result
        self._api = api
        self._error = error

    def is_completed(self) -> bool:
        """Returns True once every result array is computed (or the work failed)."""
        if self._error is not None:
            return True
        return all(x.is_ready() for x in _leaves(self._result))

    def is_success(self) -> bool:
        """Returns True if the work completed without an error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """Returns the error the work failed with, or None."""
        return self._error

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Blocks until the work is done; raises DistTimeoutError after ``timeout``."""
        if self._error is not None:
            raise self._error
        if timeout is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
                else float(timeout)
            deadline = time.monotonic() + seconds
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise DistTimeoutError(
                        f"{self._api}: Work.wait timed out after {seconds:.3f} s."
                    )
                time.sleep(0.0005)
        for x in _leaves(self._result):
            x.block_until_ready()
        return True

    def result(self) -> Any:
        """Waits and returns the collective's result (torch returns the output tensors)."""
        self.wait()
        return self._result

    def get_future(self) -> concurrent.futures.Future:
        """Returns a ``concurrent.futures.Future`` that resolves to ``result()``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._error is not None:
            fut.set_exception(self._error)
            return fut
        if self.is_completed():
            fut.set_result(self._result)
            return fut
        import threading

        def _finish() -> None:
            try:
                fut.set_result(self.result())
            except BaseException as exc:  # noqa: BLE001 (handed to the future)
                fut.set_exception(exc)

        threading.Thread(target=_finish, daemon=True).start()
        return fut

    def __repr__(self) -> str:
        return f"Work({self._api}, completed={self.is_completed()})"


def completed(result: Any, async_op: bool, api: str) -> Any:
    """Returns ``Work(result)`` when ``async_op``, else ``result``."""
    return Work(result, api) if async_op else result
