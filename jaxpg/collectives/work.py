"""Work: the handle an ``async_op=True`` collective returns, as torch's ``Work``."""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxpg.errors import DistTimeoutError
from jaxpg.supervision.flight_recorder import call_pinned, recorder

__all__ = ["Work", "completed", "returns_work_at_once"]


def _leaves(result: Any) -> list[Any]:
    """The concrete arrays of ``result``; traced values (SPMD code) are always "ready"."""
    return [x for x in jax.tree.leaves(result)
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class Work:
    """A pending collective, as torch's ``Work``.

    It holds either the collective's result (arrays JAX may still be computing), or a job
    queued on the multi-process runner thread (``jaxpg.supervision.runner.Job``), which
    dispatches the collective after earlier ones without blocking the caller.

    Args:
        result: the collective's result (arrays still being computed), or None.
        api: the collective's name, for messages.
        error: an exception the collective raised, re-raised by ``wait``.
        job: a queued collective whose result becomes ``result``.
        timeout: the group's timeout in seconds: what ``wait()`` without one waits for a job.
    """

    def __init__(self, result: Any = None, api: str = "collective",
                 error: BaseException | None = None, job: Any = None,
                 timeout: float | None = None):
        self._result = result
        self._api = api
        self._error = error
        self._job = job
        self._timeout = timeout
        self._ran: Any = None  # the finished job: which collective it ran, for messages

    def _job_done(self) -> bool:
        """Collects a finished job's result or error; False while it is still queued."""
        job = self._job
        if job is None:
            return True
        if not job.done():
            return False
        try:
            self._result = job.result()
        except BaseException as exc:  # noqa: BLE001 (re-raised by wait)
            self._error = exc
        self._job, self._ran = None, job
        return True

    def is_completed(self) -> bool:
        """Returns True once every result array is computed (or the work failed)."""
        if not self._job_done():
            return False
        if self._error is not None:
            return True
        return all(x.is_ready() for x in _leaves(self._result))

    def is_success(self) -> bool:
        """Returns True if the work completed without an error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """Returns the error the work failed with, or None."""
        self._job_done()
        return self._error

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Blocks until the work is done.

        Raises the collective's error (``DistTimeoutError`` or ``DistNetworkError`` naming
        the ranks that did not arrive, as the blocking call does), or ``DistTimeoutError``
        when it is not done within ``timeout`` (default: the group's timeout for a
        collective across processes; none for one inside this process).
        """
        seconds = _seconds(timeout)
        start = time.monotonic()
        if self._job is not None:
            limit = seconds if seconds is not None else self._timeout
            from jaxpg.groups import multiprocess

            try:
                self._result = multiprocess.wait_job(self._job, limit)
            except BaseException as exc:  # noqa: BLE001 (kept: a later wait raises it again)
                self._error = exc
            self._job, self._ran = None, self._job
        if self._error is not None:
            raise self._error
        if seconds is not None:
            deadline = start + seconds
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise DistTimeoutError(self._timeout_text(seconds))
                time.sleep(0.0005)
        for x in _leaves(self._result):
            x.block_until_ready()
        return True

    def _timeout_text(self, seconds: float) -> str:
        ran = self._ran
        if ran is not None and getattr(ran, "group", None) is not None:
            from jaxpg.groups import multiprocess

            return multiprocess.timeout_text(ran.group, ran.api, ran.seq, seconds)
        return f"{self._api}: Work.wait timed out after {seconds:.3f} s."

    def result(self) -> Any:
        """Waits and returns the collective's result (torch returns the output tensors)."""
        self.wait()
        return self._result

    def get_future(self) -> concurrent.futures.Future:
        """Returns a ``concurrent.futures.Future`` that resolves to ``result()``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.is_completed():
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._result)
            return fut

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


def returns_work_at_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Makes ``fn(..., async_op=True)`` return a Work at once in a multi-process run.

    The whole call (argument checks aside, which run on the runner too) is queued on the
    runner thread, in call order with every other eager collective, so the caller never
    waits for device work the input depends on, nor for the peers. In one process, JAX's
    asynchronous dispatch already returns at once, and in SPMD code the call is traced;
    both go straight through.
    """
    params = list(inspect.signature(fn).parameters)
    index = params.index("async_op")
    group_index = params.index("group")
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        async_op = kwargs.get("async_op", args[index] if len(args) > index else False)
        if not async_op:
            if recorder.ring is not None:  # the flight recorder notes where it was called
                return call_pinned(fn, args, kwargs)
            return fn(*args, **kwargs)
        from jaxpg.groups import world
        from jaxpg.spmd_lowering import current_context

        state = world.current(required=False)
        if state is None or not state.multiprocess or current_context() is not None:
            return fn(*args, **kwargs)
        from jaxpg.groups import multiprocess

        group = kwargs.get("group", args[group_index] if len(args) > group_index else None)
        pg = world._resolve_group(group, name)
        if len(args) > index:
            args = (*args[:index], False, *args[index + 1:])
        else:
            kwargs["async_op"] = False
        job = multiprocess.submit(lambda: fn(*args, **kwargs), name)
        return Work(None, name, job=job, timeout=pg.timeout.total_seconds())

    return wrapper
