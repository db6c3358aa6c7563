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

from jaxpg.data_parallel.checkpoint_check import choose_step
from jaxpg.data_parallel.checkpoint_format import numbered_arrays, restore_leaves
from jaxpg.ddp import checkpoint_writer
from jaxpg.ddp.checkpoint_writer import wait_for_checkpoints

__all__ = ["save_checkpoint", "restore_checkpoint", "latest_step", "wait_for_checkpoints"]

_PARTS = ("params", "rest", "opt_state", "hook_state")


def _flat(ddp: Any) -> tuple[dict[str, Any], list[str]]:
    state = ddp.state_dict()
    tree = {k: state[k] for k in _PARTS}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays = numbered_arrays([x for _, x in leaves])
    return arrays, [jax.tree_util.keystr(p) for p, _ in leaves]


def _manager(directory: str | os.PathLike) -> Any:
    return checkpoint_writer.manager(directory)


def every_process_calls(api: str) -> None:
    """In a multi-process world, checks in for this process's next ``api`` call and waits
    for every process's (``jaxpg.groups.multiprocess.check_in``)."""
    from jaxpg.groups import world

    state = world.current()
    if state.multiprocess:
        from jaxpg.groups import multiprocess

        multiprocess.check_in(state.world_group, api)


def save_checkpoint(
    directory: str | os.PathLike, ddp: Any, *, data_state: dict[str, Any] | None = None,
    async_save: bool = False,
) -> int:
    """Saves ``ddp``'s training state at its current step; returns the step.

    **Every process must call it** (not only rank 0, as torch's ``if rank == 0:
    torch.save(...)`` habit has it): the processes write their parts together. A call made
    on some processes only raises ``DistTimeoutError`` on those, naming the ranks that did
    not call it, after the world's timeout.

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
    every_process_calls("save_checkpoint")
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


def readable_step(directory: str | os.PathLike, step: int | None,
                  api: str = "restore_checkpoint") -> int:
    """The step a restore loads: ``step`` once checked, or the newest readable one
    (:func:`jaxpg.data_parallel.checkpoint_check.choose_step`; waits for this process's
    save in flight first)."""
    checkpoint_writer.wait_for_checkpoints()
    steps: list[int] = []
    if os.path.isdir(directory):
        with _manager(directory) as mngr:
            steps = list(mngr.all_steps())
    return choose_step(directory, steps, step, api)


def restore_checkpoint(
    directory: str | os.PathLike, ddp: Any, *, step: int | None = None
) -> tuple[int, dict[str, Any]]:
    """Loads a checkpoint into ``ddp`` on every rank; returns ``(step, data_state)``.

    Each candidate step is checked before it is loaded
    (:mod:`jaxpg.data_parallel.checkpoint_check`: orbax's commit record, the JSON records,
    and the arrays' index against their files' sizes). With ``step=None`` the newest
    complete, readable step is restored; a damaged newer one (a node lost in the middle of
    a write) is skipped with one warning naming it, so a restarted job resumes from the
    step before.

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        ddp: a DDP built like the one that was saved.
        step: the step to restore (the newest readable for None).

    Raises:
        FileNotFoundError: if there is no checkpoint, or no ``step``.
        ValueError: if the checkpoint was saved from a different model or optimizer, if
            ``step`` is damaged, or if every step is (the error names each and its damage).
    """
    import orbax.checkpoint as ocp

    step = readable_step(directory, step)
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
    loaded = jax.tree.unflatten(treedef, restore_leaves(leaves, restored))
    ddp.load_state_dict({**loaded, "step": meta["step"]})
    return int(meta["step"]), dict(meta["data_state"])
