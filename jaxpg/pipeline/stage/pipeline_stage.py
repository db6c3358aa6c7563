"""torch's ``PipelineStage``: one stage of a pipeline, a Flax NNX module on its own process.

A pipeline of real models is not a stack of identical blocks: the first stage holds the
embedding, the last the norm, the head (and the loss), and stages may differ in their
modules, parameters, and in the shapes and dtypes they take and give. A
:class:`PipelineStage` wraps one such stage's module on the process that owns its
pipeline rank, as ``torch.distributed.pipelining.PipelineStage`` does; the schedule
classes (``jaxpg.pipeline.torch_api``) run the stages.

Shapes between stages come from ``input_args`` or, on the first step, from the seed's
``send_meta``/``recv_meta`` exchange: each stage learns its input's shapes and dtypes from
the stage before it (``jaxpg.pipeline.process.stage_runner``), once, as torch infers them once.

After a step ``stage.grads`` holds the gradient of the module's ``nnx.Param`` state, as
an ``nnx.State`` of the module's structure, accumulated as torch accumulates ``.grad``:
a step adds its microbatches' gradients to what is there, then (``scale_grads=True``, the
default) divides all of it by the number of microbatches, torch's ``scale_grads`` rule.
``zero_grad()`` clears them (``None``, as torch's ``set_to_none``).

**Data parallelism over the pipelines** (torchtitan wraps each stage's module in DDP over
the ``dp`` mesh dimension): ``data_parallel_group=mesh["dp"]`` of a ``("dp", "pp")`` mesh
with ``group=mesh["pp"]``. Each dp replica runs its own pipeline on its own part of the
batch, and after every step the step's gradients are averaged over the replicas (one
``all_reduce`` of the stage's flattened gradients, ``ReduceOp.AVG``) before they are added
to ``grads``: ``grads`` is then the gradient of the global batch's mean loss, the same on
every replica, and one optax update keeps the replicas equal. ``losses`` stay each
replica's own microbatches'.

**Tensor-parallel stages** (torchtitan's PP x TP): on a ``("pp", "tp")`` mesh (or ``("dp",
"pp", "tp")``), one process per device, model stage ``s`` is held by the tp processes of
pp coordinate ``s``. Each of them parallelizes its stage's module over ``mesh["tp"]``
(``parallelize_module(module, mesh["tp"], plan)``) and passes
``PipelineStage(module, s, n, group=mesh["pp"], tensor_parallel_group=mesh["tp"])``
(``None`` infers the group from the module's arrays, as torch reads a DTensor's mesh). The
module's arrays move onto the stage's own mesh (the tp group's devices; each device keeps
its shard), its forward and backward run as SPMD programs over the tp group
(``jaxpg.pipeline.stage.tp``), activations are replicated over tp and travel between the
same tp ranks of neighbouring stages, and ``grads`` keep the parameters' own tp-sharded
layout, so an optax update over them trains the stage. Every process of a stage calls
``step`` with the same inputs (the first stage) or targets (the last).

**Fully sharded, expert- and context-parallel stages** (FSDP x PP and CP x PP, as
torchtitan; EP x PP, as DeepSeek-V3): ``fsdp_group=mesh["dp_shard"]`` splits every
parameter over the stage's dp_shard processes (``jaxpg.pipeline.stage.fsdp``);
``expert_parallel_group=mesh["ep"]`` runs a module whose ``MoELayer`` layers were built over
``mesh["ep"]``, its experts split over the stage's ep processes and its other parameters
replicated; ``context_parallel_group=mesh["cp"]`` runs one whose attention is
``ContextParallelAttention`` over that group, each process feeding its part of every
sequence (``jaxpg.pipeline.stage.data_split``). In each, the processes of the group build
the same module and feed their own part of the batch, and
``grads`` are the whole batch's, in the parameters' layout.

Example (two processes, ``jaxpg-run --nproc-per-node 2``)::

    stage = PipelineStage(my_stage_module, jaxpg.get_rank(), 2)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=cross_entropy)
    if stage.is_first:
        schedule.step(tokens)
    else:
        losses = []
        schedule.step(target=labels, losses=losses)
    params = nnx.state(stage.submod, nnx.Param)
    updates, opt_state = tx.update(stage.grads, opt_state, params)
    nnx.update(stage.submod, optax.apply_updates(params, updates))
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpg.groups import world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_group
from jaxpg.pipeline.stage.carried import check_stage_output
from jaxpg.pipeline.stage.data_split import stage_context_parallel, stage_expert_parallel
from jaxpg.pipeline.stage.fsdp import stage_fully_shard
from jaxpg.pipeline.stage.submesh_programs import submesh_output_structs
from jaxpg.pipeline.stage.tp import stage_tensor_parallel

__all__ = ["PipelineStage"]


def _pipeline_group(group: Any) -> ProcessGroup:
    """``group=`` as a ProcessGroup: None (the world), a ProcessGroup, or a 1-D DeviceMesh."""
    if group is None:
        state = world.current(required=False)
        if state is None:
            raise ValueError("PipelineStage needs an initialized process group: call "
                             "jaxpg.init_process_group() first (or pass group=).")
        return state.world_group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"PipelineStage group= must be a 1-D DeviceMesh (the pipeline "
                             f"dimension, e.g. mesh['pp']), got one of shape {group.shape}.")
        return group.get_group()
    if isinstance(group, ProcessGroup):
        return group
    raise TypeError(f"PipelineStage group= must be None, a ProcessGroup or a 1-D DeviceMesh, "
                    f"got {type(group).__name__}.")


def _as_tuple(args: Any) -> tuple:
    return tuple(args) if isinstance(args, tuple | list) else (args,)


class PipelineStage:
    """One pipeline stage: ``module`` as model stage ``stage_index`` of ``num_stages``.

    Args:
        module: the stage's ``flax.nnx.Module``; ``module(*inputs)`` gives its output (an
            array or a tuple of arrays), the next stage's inputs: its floating-point arrays
            take gradients, its integer and bool arrays (position ids, masks) travel beside
            them without. Its ``nnx.Param`` state is trained; other state is read as a
            constant.
        stage_index: the model stage, ``0 .. num_stages - 1``.
        num_stages: the model's stages, a multiple of the pipeline group's size (stage
            ``s`` runs on the process of pipeline rank ``s % size`` or, for
            ``ScheduleZBVZeroBubble``, in a V).
        device: accepted for torch's signature; must be None or this rank's device.
        input_args: example inputs of the stage (arrays or shape structs, microbatch
            sized): checked against what the previous stage sends. Optional.
        output_args: accepted for torch's signature (outputs are computed from the inputs).
        group: the pipeline's process group (a ProcessGroup or a 1-D DeviceMesh, e.g.
            ``mesh["pp"]``); default the world.
        data_parallel_group: the data-parallel group of this stage's replicas (e.g.
            ``mesh["dp"]``: the processes holding the same stage of the other pipelines),
            whose step gradients are averaged; None: no data parallelism.
        tensor_parallel_group: the tensor-parallel group holding this stage (e.g.
            ``mesh["tp"]``: the processes of this pp coordinate), over which ``module``
            was parallelized; None: inferred from the module (a plain module has none).
        fsdp_group: the dp_shard group holding this stage (e.g. ``mesh["dp_shard"]`` of a
            ``("pp", "dp_shard")`` mesh), over which the stage is fully sharded (FSDP,
            ZeRO stage 3: ``jaxpg.pipeline.stage.fsdp``); each of its processes passes
            the same module and its own part of the batch. None: no full sharding.
        reshard_after_forward: with ``fsdp_group``, torch's ``fully_shard`` argument: True
            (default) gathers the parameters in each microbatch's forward and again in its
            backward, gradients reduce-scattered per microbatch; False gathers them once a
            step and keeps them, each rank summing its whole gradient until the step's last
            backward, then reduce-scatters it once.
        expert_parallel_group: the ep group holding this stage (e.g. ``mesh["ep"]`` of a
            ``("pp", "ep")`` mesh), over which the module's ``MoELayer`` layers split their
            experts (``jaxpg.pipeline.stage.data_split``); each of its processes passes the
            same module and its own part of the batch, the other parameters replicated.
            None: no expert parallelism.
        context_parallel_group: the cp group holding this stage (e.g. ``mesh["cp"]`` of a
            ``("pp", "cp")`` mesh), over which the module's ``ContextParallelAttention``
            layers attend; each of its processes passes the same module and its part of
            every sequence (dimension 1), the parameters replicated. None: no context
            parallelism.
    """

    def __init__(self, module: nnx.Module, stage_index: int, num_stages: int,
                 device: Any = None, *, input_args: Any = None, output_args: Any = None,
                 group: Any = None, data_parallel_group: Any = None,
                 tensor_parallel_group: Any = None, fsdp_group: Any = None,
                 reshard_after_forward: bool = True,
                 expert_parallel_group: Any = None, context_parallel_group: Any = None) -> None:
        if not isinstance(module, nnx.Module):
            raise TypeError(f"PipelineStage module must be a flax.nnx.Module, got "
                            f"{type(module).__name__}.")
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"PipelineStage {name}={value!r} must be an int >= 0.")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage stage_index={stage_index} must be in "
                             f"0..{num_stages - 1} (num_stages={num_stages}).")
        self.group = _pipeline_group(group)
        size = self.group.size()
        if num_stages % size:
            raise ValueError(f"PipelineStage num_stages={num_stages} must be a multiple of the "
                             f"pipeline group's size {size}.")
        self.group_rank = self.group.rank()
        if self.group_rank < 0:
            raise ValueError(f"this process is not a member of the pipeline group "
                             f"{self.group!r}; pass the group of this process's pipeline.")
        self.device = self.group.devices[self.group_rank]
        if device is not None and device != self.device:
            raise ValueError(f"PipelineStage device={device} is not this pipeline rank's device "
                             f"{self.device}; pass device=None.")
        self.submod = module
        self.stage_index, self.num_stages = int(stage_index), int(num_stages)
        self.group_size = size
        self.input_args = (None if input_args is None else
                           tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                 for a in _as_tuple(input_args)))  # fmt: skip
        self.output_args = output_args
        self.grads: nnx.State | None = None
        self.dp_group = self._data_parallel_group(data_parallel_group)
        me = self.group.ranks[self.group_rank]
        others = {"data_parallel_group": data_parallel_group,
                  "tensor_parallel_group": tensor_parallel_group, "fsdp_group": fsdp_group}
        experts = stage_expert_parallel(module, expert_parallel_group, device=self.device,
                                        me=me, pipeline=self.group, others={
                                            **others,
                                            "context_parallel_group": context_parallel_group})
        self.ep_group, self.ep = experts if experts is not None else (None, None)
        context = stage_context_parallel(module, context_parallel_group, device=self.device,
                                         me=me, pipeline=self.group, others=others)
        self.cp_group, self.cp = context if context is not None else (None, None)
        # a fully sharded, expert- or context-parallel module's arrays are on its group's
        # mesh: no tp group to infer
        found = None if (fsdp_group is not None or self.ep is not None or
                         self.cp is not None) and \
            tensor_parallel_group is None else \
            stage_tensor_parallel(module, tensor_parallel_group, device=self.device,
                                  me=self.group.ranks[self.group_rank], pipeline=self.group,
                                  data_parallel=self.dp_group)
        self.tp_group, self.tp = found if found is not None else (None, None)
        sharded = stage_fully_shard(module, fsdp_group, device=self.device,
                                    me=self.group.ranks[self.group_rank], pipeline=self.group,
                                    data_parallel=self.dp_group, tensor_parallel=self.tp,
                                    reshard_after_forward=reshard_after_forward)
        self.fsdp_group, self.fsdp = sharded if sharded is not None else (None, None)
        self.graphdef = nnx.graphdef(module)

    def _data_parallel_group(self, given: Any) -> ProcessGroup | None:
        """``data_parallel_group=`` resolved and checked against the pipeline group."""
        if given is None:
            return None
        dp = resolve_group(given, api="PipelineStage", arg="data_parallel_group")
        me = self.group.ranks[self.group_rank]
        if me not in dp.ranks:
            raise ValueError(f"PipelineStage data_parallel_group={dp!r} does not hold this "
                             f"process's rank {me}; pass this process's data-parallel group "
                             "(e.g. mesh['dp'] of the ('dp', 'pp') mesh).")
        shared = sorted(set(dp.ranks) & set(self.group.ranks))
        if shared != [me]:
            raise ValueError(f"PipelineStage data_parallel_group={dp!r} shares ranks "
                             f"{shared} with the pipeline group {self.group!r}; the two must "
                             "be different dimensions of one mesh, meeting only at this "
                             "process (e.g. mesh['dp'] and mesh['pp']).")
        return dp

    @property
    def is_first(self) -> bool:
        """Whether this is the first model stage (it takes the step's inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last model stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def params(self) -> nnx.State:
        """The module's current ``nnx.Param`` state (read at every step)."""
        return nnx.state(self.submod, nnx.Param)

    def frozen_state(self) -> nnx.State:
        """The module's state other than ``nnx.Param`` (read as constants by the stage)."""
        return nnx.state(self.submod, nnx.Not(nnx.Param))

    @property
    def layout(self) -> Any:
        """The stage's sub-mesh layout (``StageTP``, ``StageFSDP`` or ``StageDataParallel``),
        or None (one device)."""
        return next((x for x in (self.tp, self.fsdp, self.ep, self.cp) if x is not None), None)

    def placed(self, state: nnx.State) -> nnx.State:
        """``state`` where the stage's programs take it: on its device, or on its sub-mesh
        (tensor-parallel: ``state``'s arrays each keeping their layout; fully sharded:
        parameters split over dp_shard)."""
        layout = self.layout
        return jax.device_put(state, self.device) if layout is None else layout.place(state)

    def program_params(self) -> nnx.State:
        """The parameters a step's programs take (placed; with a fully sharded stage's
        ``reshard_after_forward=False``, gathered for the step)."""
        params = self.placed(self.params())
        return params if self.layout is None else self.layout.step_params(params)

    def finish_grads(self, grads: Any) -> Any:
        """A step's summed gradients as ``grads`` holds them (a fully sharded stage's
        ``reshard_after_forward=False``: reduce-scattered here, after the last backward)."""
        return grads if self.layout is None else self.layout.finish_grads(grads)

    def zero_grad(self) -> None:
        """Clears ``grads`` (to ``None``, as torch's ``zero_grad(set_to_none=True)``)."""
        self.grads = None

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divides ``grads`` by ``grad_scale_factor`` (torch's rule, run after a step)."""
        if grad_scale_factor != 1 and self.grads is not None:
            self.grads = _divide(self.grads, grad_scale_factor)

    def __call__(self, params: nnx.State, *inputs: Any) -> tuple:
        """The stage's forward on ``params`` (traceable); its outputs as a tuple."""
        out = nnx.merge(self.graphdef, params, self.frozen_state())(*inputs)
        check_stage_output(out, f"stage {self.stage_index} ({type(self.submod).__name__})",
                           travels=False)
        return _as_tuple(out)

    def output_structs(self, inputs: tuple) -> tuple:
        """The shapes and dtypes of the stage's outputs for inputs of ``inputs``' shapes."""
        if self.layout is not None:
            return submesh_output_structs(self.graphdef, self.layout, self.params(),
                                          self.frozen_state(), tuple(inputs))
        return jax.eval_shape(lambda p, *x: self(p, *x), self.params(), *inputs)

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"group_rank={self.group_rank}, module={type(self.submod).__name__})")


@jax.jit
def _divide(tree: Any, factor: Any) -> Any:
    return jax.tree.map(lambda a: a / jnp.asarray(factor, a.dtype), tree)
