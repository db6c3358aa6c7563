"""Memory from XLA: compile one block's per-device program at a layout's shapes, compose the rest.

For a Flax NNX block, :func:`compiled_block` compiles, from abstract inputs (nothing is
allocated), on a mesh of ``tp`` (simulated) devices with the block's tensor-parallel plan:

* the forward that returns what the backward needs (``jax.vjp``'s residuals, less the
  parameters themselves): its output size per device is the block's **saved activations**;
* the forward and backward of the block: its temporaries are the block's **working memory**;

and reads ``memory_analysis()`` of each. :func:`xla_memory` then composes what does not change
a device's program analytically, as :mod:`jaxpg.plan.memory` does: the blocks of a chunk, the
chunks the schedule keeps in flight, the data-parallel axes (ZeRO's shards) and the stages.
A layout of thousands of devices compiles one block on at most ``tp`` devices.

Example (8 simulated devices)::

    block = compiled_block(lambda: MyBlock(dim=512, rngs=nnx.Rngs(0)),
                           jax.ShapeDtypeStruct((2, 1024, 512), jnp.bfloat16),
                           tp=2, param_spec=megatron_specs)
    mem = xla_memory(job, layout, block)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpg.plan.job import Job
from jaxpg.plan.layout import Layout
from jaxpg.plan.memory import Memory, in_flight_chunks, memory, microbatch_size, param_split

__all__ = ["CompiledBlock", "compiled_block", "xla_memory"]

_POLICIES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class CompiledBlock:
    """One block's per-device figures, read from XLA.

    Attributes:
        saved_bytes: the activations its forward keeps for the backward, per device.
        working_bytes: the temporaries of its forward and backward, per device.
        param_count: its parameters on one device (after the tp plan).
        param_bytes: their bytes.
        flops: XLA's FLOP count of its forward and backward, per device.
        remat: the recomputation policy it was compiled with.
    """

    saved_bytes: float
    working_bytes: float
    param_count: float
    param_bytes: float
    flops: float
    remat: str


def _policy_apply(apply: Callable, remat: str) -> Callable:
    import jax

    if remat == "full":
        return jax.checkpoint(apply)
    if remat == "selective":  # keep the weight matmuls' outputs, recompute attention's core
        return jax.checkpoint(apply,
                              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return apply


def compiled_block(make_block: Callable[[], Any], x, *, tp: int = 1,
                   param_spec: Callable[[tuple, Any], Any] | None = None,
                   remat: str = "none", devices=None) -> CompiledBlock:
    """Compiles one NNX block's forward (with residuals) and backward; reads their memory.

    Args:
        make_block: builds the block (run under ``nnx.eval_shape``: nothing is allocated).
        x: the block's input for one microbatch, a ``jax.ShapeDtypeStruct`` (global shape:
            batch, local sequence, width).
        tp: tensor-parallel degree: the programs run on a mesh of ``tp`` devices, axis "tp".
        param_spec: ``param_spec(path, leaf) -> PartitionSpec`` over the axis "tp" for each
            parameter (the block's tensor-parallel plan); None replicates them.
        remat: ``"none"``, ``"selective"`` or ``"full"`` (``jax.checkpoint`` around the block).
        devices: the devices of the mesh (default: the first ``tp`` local ones).
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if remat not in _POLICIES:
        raise ValueError(f"compiled_block: remat={remat!r} must be one of {_POLICIES}.")
    devices = list(devices or jax.devices()[:tp])
    if len(devices) != tp:
        raise ValueError(f"compiled_block: tp={tp} needs {tp} devices; {len(devices)} are "
                         "available (simulate more with "
                         "--xla_force_host_platform_device_count).")
    mesh = Mesh(np.array(devices), ("tp",))
    graphdef, state = nnx.split(nnx.eval_shape(make_block))
    spec = param_spec or (lambda path, leaf: PartitionSpec())
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec(path, leaf)), state)
    abstract = jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                 sharding=s), state, shardings)
    x_sharding = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x_sharding)

    def apply(st, inp):
        return nnx.merge(graphdef, st)(inp)

    apply = _policy_apply(apply, remat)

    def forward(st, inp):
        y, vjp_fn = jax.vjp(apply, st, inp)
        params = {id(leaf) for leaf in jax.tree.leaves(st)}
        saved = [leaf for leaf in jax.tree.leaves(vjp_fn) if id(leaf) not in params]
        return y, saved

    def train(st, inp):
        loss = lambda s: apply(s, inp).astype("float32").sum()  # noqa: E731
        return jax.grad(loss)(st)

    fwd = jax.jit(forward).lower(abstract, x).compile()   # the shardings ride on the inputs
    both = jax.jit(train).lower(abstract, x).compile()
    out = fwd.memory_analysis()
    y_bytes = np.prod(x.shape) * x.dtype.itemsize / 1.0  # y is replicated like x
    saved = max(0.0, out.output_size_in_bytes - y_bytes)
    working = both.memory_analysis().temp_size_in_bytes
    leaves = jax.tree.leaves(abstract)
    local = [np.prod(s.sharding.shard_shape(s.shape)) for s in leaves]
    count = float(sum(local))
    nbytes = float(sum(n * s.dtype.itemsize for n, s in zip(local, leaves)))
    cost = both.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return CompiledBlock(float(saved), float(working), count, nbytes,
                         float((cost or {}).get("flops", 0.0)), remat)


def xla_memory(job: Job, layout: Layout, block: CompiledBlock) -> Memory:
    """Per-device memory of ``layout`` with the block's activations from XLA.

    The block must be compiled at the layout's shapes (the microbatch, ``seq_len / cp``,
    ``tp``, the layout's ``remat``). Its saved activations times the blocks of a chunk and
    the chunks in flight replace the formula's; its working memory (less what it saved)
    stands for one block's temporaries; its parameters times the stage's blocks replace the
    spec's count for the blocks (ZeRO's sharding as in :func:`jaxpg.plan.memory.memory`).
    """
    if block.remat != layout.remat:
        raise ValueError(f"xla_memory: the block was compiled with remat={block.remat!r}, the "
                         f"layout has remat={layout.remat!r}; compile it with the layout's.")
    formula = memory(job, layout)
    split = param_split(job, layout)
    chunk_blocks = split.layers_per_stage / layout.chunks
    in_flight = in_flight_chunks(layout)
    tokens = microbatch_size(job, layout) * job.seq_len / layout.cp
    activations = in_flight * chunk_blocks * block.saved_bytes + (
        in_flight / layout.chunks * tokens * job.model.dim * job.act_bytes
        / (layout.tp if layout.sp else 1))
    logits = tokens * job.model.vocab / layout.tp * (job.act_bytes + 4)
    # one block's backward at a time; its own saved activations are already counted above
    temporaries = logits + max(0.0, block.working_bytes - block.saved_bytes)
    # the model state: the compiled blocks' parameters in place of the spec's, ZeRO as before
    count = block.param_count * split.layers_per_stage + split.ends
    scale = count / split.total if split.total else 1.0
    return Memory(formula.params * scale, formula.grads * scale, formula.optimizer * scale,
                  activations, temporaries)
