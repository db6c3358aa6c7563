"""Writing DDP and FSDP checkpoints with orbax, synchronously or in the background.

A synchronous save returns once the checkpoint is committed. An asynchronous one
(``async_save=True``) returns once the state is staged: orbax has copied every array to host
memory (on CPU, where that copy may share the array's buffer, jaxpg first copies the state
into fresh buffers that the next step cannot donate);
orbax then writes the files and commits the checkpoint (renames its temporary folder) in a
background thread while training goes on, as torch DCP's ``async_save``.

At most one save is in flight per process: a save, a restore, :func:`latest_step`,
``destroy_process_group`` and the end of the interpreter first wait for the previous one
(:func:`wait_for_checkpoints`). A process killed while a checkpoint is written leaves only
orbax's temporary folder, which orbax's manager ignores, so restores pick the newest
complete checkpoint.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import jax

from jaxpg.groups import callbacks

__all__ = ["write_checkpoint", "wait_for_checkpoints", "manager"]

_lock = threading.Lock()
_pending: Any = None  # the CheckpointManager of the save in flight


def manager(directory: str | os.PathLike, *, async_save: bool = False, **kwargs: Any) -> Any:
    """An orbax ``CheckpointManager`` on ``directory`` (created if missing), with the
    handlers of both items a checkpoint holds (``state``: the arrays, ``meta``: the JSON
    record), so that reading one item's metadata does not log that the other "could not be
    restored"."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=async_save)
    kwargs.setdefault("item_handlers", {"state": ocp.StandardCheckpointHandler(),
                                        "meta": ocp.JsonCheckpointHandler()})
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options,
                                 **kwargs)


def wait_for_checkpoints() -> None:
    """Waits until the asynchronous save in flight (if any) is committed; re-raises its
    error. Every process that saved calls it (it meets the others in orbax's barrier)."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is not None:
        try:
            pending.wait_until_finished()
            pending.check_for_errors()
        finally:
            pending.close()


def _on_cpu(x: Any) -> bool:
    return isinstance(x, jax.Array) and next(iter(x.devices())).platform == "cpu"


def _staged(arrays: dict[str, Any]) -> dict[str, Any]:
    # On CPU orbax's host copy may share the buffer, which the next step donates and may
    # overwrite: stage in fresh buffers. On accelerators orbax's device-to-host copy stages.
    return {k: x.copy() if _on_cpu(x) else x for k, x in arrays.items()}


def write_checkpoint(directory: str | os.PathLike, step: int, arrays: dict[str, Any],
                     meta: dict[str, Any], *, async_save: bool = False) -> None:
    """Saves ``arrays`` and the JSON record ``meta`` under ``directory/<step>``.

    Args:
        directory: the checkpoint root.
        step: the step to save under.
        arrays: a flat ``{name: jax.Array}`` dictionary.
        meta: the JSON-serialisable record.
        async_save: return once the state is staged; orbax writes in the background.
    """
    import orbax.checkpoint as ocp

    from jaxpg.supervision import liveness

    global _pending
    wait_for_checkpoints()  # the next save waits for the previous one
    heartbeat = float(os.environ.get("JAXPG_HEARTBEAT_TIMEOUT", "10"))
    args = ocp.args.Composite(state=ocp.args.StandardSave(_staged(arrays) if async_save
                                                          else arrays),
                              meta=ocp.args.JsonSave(meta))
    with liveness.naming_lost("save_checkpoint", heartbeat):
        mngr = manager(directory, async_save=async_save)
        try:
            _replace_if_damaged(mngr, directory, step)
            mngr.save(step, args=args, force=True)
            if not async_save:
                mngr.wait_until_finished()
        except BaseException:
            mngr.close()
            raise
    if async_save:
        with _lock:
            _pending = mngr
    else:
        mngr.close()


def _replace_if_damaged(mngr: Any, directory: str | os.PathLike, step: int) -> None:
    """Removes a damaged checkpoint already saved at ``step`` (a restart that fell back to
    the step before retrains it and saves it again). Every process decides from the same
    files before any removes them (one check-in before, one after: process 0 removes)."""
    if step not in mngr.all_steps():
        return
    import shutil

    from jaxpg.data_parallel.checkpoint_check import damage
    from jaxpg.groups import world

    path = os.path.join(os.path.abspath(os.fspath(directory)), str(step))
    damaged = damage(path) is not None
    state = world.current(required=False)
    multiprocess = state is not None and state.multiprocess
    if multiprocess:
        from jaxpg.groups import multiprocess as mp

        mp.check_in(state.world_group, "replace_damaged_checkpoint")
    if damaged and (not multiprocess or state.process_index == 0):
        shutil.rmtree(path)
    if multiprocess:
        mp.check_in(state.world_group, "replace_damaged_checkpoint")
    if damaged:
        mngr.reload()


callbacks.on_reset(wait_for_checkpoints)  # orbax's commit needs the world's service
atexit.register(wait_for_checkpoints)
