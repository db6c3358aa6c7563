"""Sharded FSDP checkpoints with orbax, as torch's Distributed Checkpoint: each rank writes
its shards, and loading reshards onto another world size or stage.

The format is DDP's (:mod:`jaxpg.ddp.checkpoint`): under ``directory/<step>`` the arrays of
``{"params", "rest", "opt_state"}`` as a flat ``{"00000": array, ...}`` dictionary in
flatten order (PRNG keys as ``key_data``, empty arrays left out) and a JSON record of the
step, the data position and the arrays' paths. An FSDP checkpoint adds to the record the
true (unpadded) shape of each array and how it was saved.

* ``save_checkpoint(dir, fsdp)`` writes the stored arrays: every process writes only its
  own shards (orbax writes each shard once; replicated arrays from one process). A
  parameter's stored dim 0 is padded to a multiple of the shard count (zero rows at the
  end).
* ``save_checkpoint(dir, fsdp, full=True)`` writes whole, unpadded arrays: exactly a DDP
  checkpoint, which ``jaxpg.ddp.restore_checkpoint`` loads into a
  ``DistributedDataParallel`` of the same model and optimizer.
* ``restore_checkpoint(dir, fsdp)`` loads either kind, or a DDP checkpoint, into any
  FSDP of the same model and optimizer, whatever its world size, stage or HSDP layout:
  each process reads only the slices its shards need, with dim 0 cut to the true size
  and padded again to this FSDP's multiple (orbax's pad/truncate on restore).
* :func:`consolidate_checkpoint` turns a sharded checkpoint into a full one offline (one
  process, any device count).
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxpg.data_parallel.checkpoint_format import numbered_arrays, restore_leaves
from jaxpg.data_parallel.prng_keys import is_key
from jaxpg.ddp import checkpoint_writer
from jaxpg.ddp.checkpoint import (
    every_process_calls,
    latest_step,
    readable_step,
    wait_for_checkpoints,
)
from jaxpg.fsdp.model_parallel import has_block_padding
from jaxpg.fsdp.placement import check_fits
from jaxpg.fsdp.state_shapes import state_paths, true_shapes

__all__ = ["save_checkpoint", "restore_checkpoint", "consolidate_checkpoint", "latest_step",
           "wait_for_checkpoints"]

_PARTS = ("params", "rest", "opt_state")


def _tree(state: dict[str, Any]) -> dict[str, Any]:
    # DDP's tree, so that paths and array numbers are the same (no hook state here)
    return {**{k: state[k] for k in _PARTS}, "hook_state": None}


def _flat(tree: dict[str, Any]) -> dict[str, Any]:
    return numbered_arrays(jax.tree.leaves(tree))


def _manager(directory: str | os.PathLike, **kwargs: Any) -> Any:
    return checkpoint_writer.manager(directory, **kwargs)


def _write(directory: str | os.PathLike, step: int, arrays: dict[str, Any],
           meta: dict[str, Any], async_save: bool = False) -> None:
    checkpoint_writer.write_checkpoint(directory, step, arrays, meta, async_save=async_save)


def save_checkpoint(directory: str | os.PathLike, fsdp: Any, *,
                    data_state: dict[str, Any] | None = None, full: bool = False,
                    async_save: bool = False) -> int:
    """Saves ``fsdp``'s training state at its current step. **Every process must call it**;
    a call made on some processes only raises ``DistTimeoutError`` there, naming the ranks
    that did not call it, after the world's timeout.

    Args:
        directory: the checkpoint root; the checkpoint goes to ``directory/<step>``.
        fsdp: the :class:`~jaxpg.fsdp.FullyShardedDataParallel`.
        data_state: the data position to resume from (JSON-serialisable).
        full: write whole, unpadded arrays (a DDP checkpoint) instead of the shards.
        async_save: return once the state is staged and let orbax write it in the
            background (:mod:`jaxpg.ddp.checkpoint_writer`); the next save, a restore and
            ``destroy_process_group`` wait for it (or call ``wait_for_checkpoints``).

    Returns:
        The step saved.
    """
    if not isinstance(async_save, bool):
        raise TypeError(f"save_checkpoint: async_save must be a bool; got {async_save!r}.")
    every_process_calls("save_checkpoint")
    state = fsdp.full_state_dict() if full else fsdp.state_dict()
    tree = _tree(state)
    shapes = true_shapes(fsdp)
    meta = {"step": fsdp.step, "data_state": data_state or {}, "paths": state_paths(tree),
            "fsdp": {"full": full, "true_shapes": [list(s) for s in shapes],
                     "stage": fsdp.stage, "num_shards": fsdp.group.num_shards,
                     "world_size": fsdp.group.size,
                     "block_padded": not full and has_block_padding(fsdp.layouts)}}
    _write(directory, fsdp.step, _flat(tree), meta, async_save=async_save)
    return fsdp.step


def _saved(directory: str | os.PathLike, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's JSON record and its arrays' saved shapes."""
    import orbax.checkpoint as ocp

    with _manager(directory) as mngr:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        arrays = mngr.item_metadata(step)["state"]
    return meta, {k: tuple(v.shape) for k, v in arrays.items()}


def _check_paths(saved: list[str], current: list[str], step: int) -> None:
    if saved != current:
        diff = next((i for i, (a, b) in enumerate(zip(saved, current)) if a != b),
                    min(len(saved), len(current)))
        raise ValueError(
            f"restore_checkpoint: the checkpoint at step {step} holds {len(saved)} arrays, "
            f"this model {len(current)}; the first difference is array {diff} "
            f"({saved[diff:diff + 1]} vs {current[diff:diff + 1]}). Build the same model and "
            "optimizer as the saved run."
        )


def restore_checkpoint(directory: str | os.PathLike, fsdp: Any, *,
                       step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Loads a checkpoint (sharded, full, or DDP's) into ``fsdp`` on every process.

    Each candidate step is checked before it is loaded, as DDP's
    (:func:`jaxpg.ddp.restore_checkpoint`): with ``step=None`` the newest complete, readable
    one is restored, with one warning naming any damaged newer step.

    Returns:
        ``(step, data_state)``.

    Raises:
        FileNotFoundError: if there is no checkpoint, or no ``step``.
        ValueError: if the checkpoint's array names or shapes differ from this model's, if
            ``step`` is damaged, or if every step is.
    """
    import orbax.checkpoint as ocp

    step = readable_step(directory, step)
    meta, saved_shapes = _saved(directory, step)
    tree = _tree(fsdp.state_dict())
    _check_paths(meta["paths"], state_paths(tree), step)
    leaves, treedef = jax.tree.flatten(tree)
    shapes = true_shapes(fsdp)
    saved_true = meta.get("fsdp", {}).get("true_shapes")
    abstract = {}
    for i, (x, path, true) in enumerate(zip(leaves, meta["paths"], shapes, strict=True)):
        key = f"{i:05d}"
        if key not in saved_shapes:
            continue
        raw = jax.random.key_data(x) if is_key(x) else x
        stored = saved_shapes[key]
        if is_key(x):  # key data has one more dimension than the key array
            stored, true = stored[: x.ndim], tuple(true)
        check_fits(path, stored, tuple(saved_true[i]) if saved_true else stored, true,
                   "restore_checkpoint")
        if tuple(stored) != tuple(raw.shape[:len(stored)]):
            _check_block_padding(fsdp, meta, "restore_checkpoint")
        abstract[key] = jax.ShapeDtypeStruct(raw.shape, raw.dtype, sharding=raw.sharding)
    with _manager(directory) as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract, strict=False)))["state"]
    loaded = jax.tree.unflatten(treedef, restore_leaves(leaves, restored))
    fsdp.load_state_dict({**{k: loaded[k] for k in _PARTS}, "step": meta["step"]})
    return int(meta["step"]), dict(meta["data_state"])


def _check_block_padding(fsdp: Any, meta: dict[str, Any], what: str) -> None:
    """Raises if a resharding load involves block-padded tensor-parallel parameters."""
    if meta.get("fsdp", {}).get("block_padded"):
        raise ValueError(
            f"{what}: the checkpoint holds tensor-parallel parameters whose blocks are "
            "padded inside the array (saved at another dp size); it loads only onto the "
            "same layout (the same dp and tp sizes)."
        )
    fsdp.check_resharding(what)


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *,
                           step: int | None = None) -> int:
    """Writes a full (DDP) checkpoint at ``dst`` from the sharded one at ``src``.

    Reads each array at its true shape onto this process's first device (offline: one
    process, the whole state in memory), as torch's ``dcp_to_torch_save``.

    Returns:
        The step converted.
    """
    import orbax.checkpoint as ocp

    step = latest_step(src) if step is None else step
    if step is None:
        raise FileNotFoundError(f"consolidate_checkpoint: no checkpoint under {src!r}.")
    meta, saved_shapes = _saved(src, step)
    if meta.get("fsdp", {}).get("block_padded"):
        raise ValueError(
            f"consolidate_checkpoint: the checkpoint at {os.fspath(src)!r} step {step} holds "
            "tensor-parallel parameters whose blocks are padded inside the array; it "
            "cannot be cut into whole arrays. Restore it onto the same layout instead."
        )
    true = meta.get("fsdp", {}).get("true_shapes")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with _manager(src) as m:
        dtypes = {k: v.dtype for k, v in m.item_metadata(step)["state"].items()}
    abstract = {}
    for key, stored in saved_shapes.items():
        shape = stored
        if true is not None:
            t = tuple(true[int(key)])
            shape = (*t, *stored[len(t):])  # key data keeps its trailing dimension
        abstract[key] = jax.ShapeDtypeStruct(shape, dtypes[key], sharding=device)
    with _manager(src) as mngr:
        arrays = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract, strict=False)))["state"]
    fsdp_meta = dict(meta.get("fsdp", {}), full=True)
    _write(dst, step, dict(arrays),
           {**meta, "fsdp": fsdp_meta})
    return step
