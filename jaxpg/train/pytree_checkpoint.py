"""Checkpoints of a training state held as a plain pytree (the pipelined recipe's).

They are DDP's and FSDP's format (:mod:`jaxpg.data_parallel.checkpoint_format`) through the
same orbax writer (:mod:`jaxpg.ddp.checkpoint_writer`, synchronous or asynchronous): under
``directory/<step>`` the tree's arrays numbered in flatten order, and a JSON record of the
step, the data position and the arrays' paths. Each process writes the shards it holds;
a restore reads each array onto the sharding of the state it replaces.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxpg.data_parallel.checkpoint_format import numbered_arrays, restore_leaves
from jaxpg.ddp import checkpoint_writer
from jaxpg.ddp.checkpoint import every_process_calls, latest_step, readable_step

__all__ = ["save_tree", "restore_tree", "latest_step"]


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save_tree(directory: str | os.PathLike, step: int, tree: Any, *,
              data_state: dict[str, Any] | None = None, async_save: bool = False) -> None:
    """Saves ``tree``'s arrays as step ``step`` under ``directory``; every process calls it."""
    every_process_calls("save_checkpoint")
    meta = {"step": step, "data_state": data_state or {}, "paths": _paths(tree)}
    checkpoint_writer.write_checkpoint(directory, step, numbered_arrays(jax.tree.leaves(tree)),
                                       meta, async_save=async_save)


def restore_tree(directory: str | os.PathLike, like: Any, *, step: int | None = None
                 ) -> tuple[int, Any]:
    """``(step, tree)``: the newest readable checkpoint (or ``step``) loaded in the
    structure and shardings of ``like``.

    Raises:
        ValueError: the checkpoint holds another tree (another model, optimizer or layout).
    """
    import orbax.checkpoint as ocp

    step = readable_step(directory, step)
    paths = _paths(like)
    leaves, treedef = jax.tree.flatten(like)
    current = numbered_arrays(leaves)
    with checkpoint_writer.manager(directory) as mngr:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta["paths"] != paths:
            raise ValueError(
                f"jaxpg.train: the checkpoint at step {step} in {os.fspath(directory)!r} holds "
                f"{len(meta['paths'])} arrays, this run's state {len(paths)} (or other names); "
                "resume with the saved run's model, optimizer and layout, or point "
                "checkpoint.dir elsewhere.")
        abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for k, x in current.items()}
        restored = mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    return int(meta["step"]), jax.tree.unflatten(treedef, restore_leaves(leaves, restored))
