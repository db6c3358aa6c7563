"""Checkpoints of a DDP run with orbax: state, step, hook state and data position.

:func:`save_checkpoint` writes, under ``directory/<step>``, every array of
:meth:`DistributedDataParallel.state_dict` (parameters, the rest of the module state,
optimizer state, the per-rank hook state) and a JSON record of the step, the caller's data
position (``data_state``: epoch, batch index, sampler seed ... anything JSON) and the
arrays' paths. Every process calls it; orbax writes replicated arrays once (from the
primary process) and each process's shards of the per-rank hook state.

:func:`restore_checkpoint` is called on every rank with a DDP built the same way (same
model, optimizer, hook, group); it reads the arrays straight into the model's shardings
and returns the step and the data position, so the loop can resume where it stopped. A
run stopped and resumed follows the same trajectory as one that never stopped, provided
the data order is a function of the data position (e.g. ``DistributedSampler`` with
``set_epoch``).

The arrays are saved as a flat ``{"00000": array, ...}`` dictionary in flatten order
(PRNG keys as their raw ``key_data``; empty arrays, which orbax refuses, are left out and
taken from the model on restore), which orbax handles for any optimizer state; the
JSON record keeps the paths so that restoring into a different model fails with a clear
message.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxpg.ddp import checkpoint_writer
from jaxpg.ddp.checkpoint_writer import wait_for_checkpoints

__all__ = ["save_checkpoint", "restore_checkpoint", "latest_step", "wait_for_checkpoints"]

_PARTS = ("params", "rest", "opt_state", "hook_state")


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flat(ddp: Any) -> tuple[dict[str, Any], list[str]]:
    state = ddp.state_dict()
    tree = {k: state[k] for k in _PARTS}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays = {
        f"{i:05d}": (jax.random.key_data(x) if _is_key(x) else x)
        for i, (_, x) in enumerate(leaves)
        if x.size  # orbax refuses empty arrays; restore takes them from the model
    }
    return arrays, [jax.tree_util.keystr(p) for p, _ in leaves]


def _manager(directory: str | os.PathLike) -> Any:
    return checkpoint_writer.manager(directory)


def save_checkpoint(
    directory: str | os.PathLike, ddp: Any, *, data_state: dict[str, Any] | None = None,
    async_save: bool = False,
) -> int:
    """Saves ``ddp``'s training state at its current step; returns the step.

    Args:
        directory: the checkpoint root; the checkpoint goes to ``directory/<step>``.
        ddp: the :class:`~jaxpg.ddp.DistributedDataParallel`.
        data_state: the data position to resume from (JSON-serialisable).
        async_save: return once the state is staged and let orbax write it in the
            background (:mod:`jaxpg.ddp.checkpoint_writer`); the next save, a restore and
            ``destroy_process_group`` wait for it (or call ``wait_for_checkpoints``).
    """
    if not isinstance(async_save, bool):
        raise TypeError(f"save_checkpoint: async_save must be a bool; got {async_save!r}.")
    arrays, paths = _flat(ddp)
    meta = {"step": ddp.step, "data_state": data_state or {}, "paths": paths}
    checkpoint_writer.write_checkpoint(directory, ddp.step, arrays, meta,
                                       async_save=async_save)
    return ddp.step


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete step saved under ``directory``, or None if there is none (waits
    for this process's save in flight first)."""
    checkpoint_writer.wait_for_checkpoints()
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mngr:
        return mngr.latest_step()


def restore_checkpoint(
    directory: str | os.PathLike, ddp: Any, *, step: int | None = None
) -> tuple[int, dict[str, Any]]:
    """Loads a checkpoint into ``ddp`` on every rank; returns ``(step, data_state)``.

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        ddp: a DDP built like the one that was saved.
        step: the step to restore (the latest for None).

    Raises:
        FileNotFoundError: if there is no checkpoint.
        ValueError: if the checkpoint was saved from a different model or optimizer.
    """
    import orbax.checkpoint as ocp

    checkpoint_writer.wait_for_checkpoints()
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(f"restore_checkpoint: no checkpoint under {directory!r}.")
    current, paths = _flat(ddp)
    with _manager(directory) as mngr:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta["paths"] != paths:
            diff = next((i for i, (a, b) in enumerate(zip(meta["paths"], paths)) if a != b),
                        min(len(paths), len(meta["paths"])))
            raise ValueError(
                f"restore_checkpoint: the checkpoint at step {step} holds {len(meta['paths'])} "
                f"arrays, this model {len(paths)}; the first difference is array {diff} "
                f"({meta['paths'][diff:diff + 1]} vs {paths[diff:diff + 1]}). Build the same "
                "model, optimizer and communication hook as the saved run."
            )
        abstract = {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            for k, x in current.items()
        }
        restored = mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )["state"]
    state = ddp.state_dict()
    tree = {k: state[k] for k in _PARTS}
    leaves, treedef = jax.tree.flatten(tree)
    new = []
    for i, old in enumerate(leaves):
        value = restored.get(f"{i:05d}", old)
        if _is_key(old) and value is not old:
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(old))
        new.append(value)
    loaded = jax.tree.unflatten(treedef, new)
    ddp.load_state_dict({**loaded, "step": meta["step"]})
    return int(meta["step"]), dict(meta["data_state"])
