"""Per-rank memory of a sharded training step, from XLA's memory analysis.

:func:`step_memory` compiles the step for a batch (nothing runs) and reads
``compiled.memory_analysis()``, which describes *one device's* program: its arguments
(the state and this rank's batch), outputs, the bytes outputs share with donated
arguments, and the temporary buffers of the step (gradients before they are reduced,
gathered units, activations, the optimizer update's temporaries). The state's bytes
are read from the arrays themselves (one device's shard of each). The peak of a step is
about ``arguments + outputs - aliased + temporaries``.

Works for :class:`~jaxpg.fsdp.FullyShardedDataParallel` (also one built from an abstract
model, ``nnx.eval_shape``, which is how a model too large to materialize is planned) and
for :class:`~jaxpg.ddp.DistributedDataParallel`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["StepMemory", "step_memory", "state_bytes"]


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One rank's bytes (all figures per device).

    Attributes:
        params: stored parameters.
        opt_state: optimizer state.
        grads: the reduced gradients the update reads (whole for DDP and stage 1, a
            shard for stages 2 and 3); transient, part of ``temp`` or the outputs.
        arguments: the step's inputs (state and batch).
        outputs: the step's outputs.
        aliased: outputs written into donated arguments.
        temp: XLA's temporary buffers.
    """

    params: int
    opt_state: int
    grads: int
    arguments: int
    outputs: int
    aliased: int
    temp: int

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state (ZeRO's accounting)."""
        return self.params + self.grads + self.opt_state

    @property
    def peak(self) -> int:
        """``arguments + outputs - aliased + temp``: the step's footprint."""
        return self.arguments + self.outputs - self.aliased + self.temp

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "state": self.state, "peak": self.peak}


def _one_device_bytes(x: Any) -> int:
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    size = 1
    for d in shape:
        size *= d
    if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        return 0
    return size * x.dtype.itemsize


def state_bytes(tree: Any) -> int:
    """One device's bytes of ``tree`` (arrays or sharded shape-dtype structs)."""
    return sum(_one_device_bytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def step_memory(wrapper: Any, loss_fn: Any, batch: Any) -> StepMemory:
    """Compiles ``wrapper``'s step for ``batch`` and returns one rank's bytes.

    Args:
        wrapper: a ``FullyShardedDataParallel`` or ``DistributedDataParallel``.
        loss_fn: the step's loss function.
        batch: this process's part of the global batch: arrays, or shape-dtype structs
            (nothing is placed or run).
    """
    from jaxpg.ddp.distributed import DistributedDataParallel

    if isinstance(wrapper, DistributedDataParallel):
        from jaxpg.ddp.train_step import StepMode

        fn = wrapper._step_fn(loss_fn, StepMode())
        spec = jax.sharding.NamedSharding(wrapper.group.mesh,
                                          jax.sharding.PartitionSpec(wrapper.group.axis_name))
        scale = wrapper.group.size() // len(wrapper.group.local_members())
        args = (wrapper.params, wrapper.rest, wrapper.opt_state, wrapper.hook_state, None,
                _batch_struct(batch, spec, scale), None)
        grads = state_bytes(wrapper.params)
    else:
        from jaxpg.fsdp.train_step import StepMode

        fn = wrapper._step_fn(loss_fn, StepMode())
        spec = wrapper.group.sharding(wrapper.group.batch_spec)
        scale = wrapper.group.size // wrapper.group.local_batch_positions()
        args = (wrapper.params, wrapper.rest, wrapper.opt_state, None,
                _batch_struct(batch, spec, scale))
        from jaxpg.data_parallel.leaf_split import leaf_split_bytes

        grads = leaf_split_bytes(wrapper.layouts, per_rank=wrapper.stage >= 2,
                             mesh_shape=dict(wrapper.group.mesh.shape))
    compiled = fn.lower(*_abstract(args)).compile()
    ma = compiled.memory_analysis()
    return StepMemory(
        params=state_bytes(wrapper.params), opt_state=state_bytes(wrapper.opt_state),
        grads=grads, arguments=int(ma.argument_size_in_bytes),
        outputs=int(ma.output_size_in_bytes), aliased=int(ma.alias_size_in_bytes),
        temp=int(ma.temp_size_in_bytes))


def _batch_struct(batch: Any, sharding: Any, scale: int) -> Any:
    """The global batch's structs from this process's part (``scale`` processes' worth)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] * scale, *x.shape[1:]), x.dtype,
                                       sharding=sharding), batch)
