"""Stage metadata: each stage's input and output shapes, found once by tracing.

This is the static form of PaddlePaddle's ``send_meta``/``recv_meta`` handshake. Paddle
sends the shapes and dtypes of the first activation over the wire so the receiver can
allocate its buffer; here every shape is known at trace time, so
``infer_stage_metadata`` runs ``jax.eval_shape`` on the embedding, on each model stage
in turn and on the head + loss, and checks that each output is what the next stage
takes. The executor's activation and gradient buffers hold one activation structure,
so every repeated stage must map its input to an output of the same shapes and dtypes.

Model stage ``s`` runs on rank ``s % p`` as chunk ``s // p`` (``p`` pipeline ranks).
Activations may be any pytree of arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.loss_check import LossDoesNotTrainError, check_depends
from jaxpg.pipeline.stage.config import PipelineConfig

LOSS_CAUSE = (
    "loss_fn(last_params, y, targets) must compute the loss from its arguments: y, the last "
    "stage's output, and last_params, the head's parameters. The usual cause: a loss that "
    "closes over a module or parameters as they were before the pipeline took them "
    "(`lambda lp, y, t: ce(model(x), t)`) instead of using y and last_params."
)

__all__ = ["StageMeta", "infer_stage_metadata", "batch_stage_metadata", "format_struct"]


class StageMeta(NamedTuple):
    """Shapes and dtypes at one model stage.

    Attributes:
        stage: the model stage index.
        rank: the pipeline rank that runs it.
        chunk: the virtual stage (chunk) on that rank.
        input: the input activation, a pytree of ``jax.ShapeDtypeStruct``.
        output: the output activation, a pytree of ``jax.ShapeDtypeStruct``.
    """

    stage: int
    rank: int
    chunk: int
    input: Any
    output: Any


def format_struct(tree: Any) -> str:
    """Formats a pytree of arrays or shape structs as ``float32[2,8]``-style text."""

    def one(leaf):
        return f"{leaf.dtype}[{','.join(str(d) for d in leaf.shape)}]"

    leaves, treedef = jax.tree.flatten(tree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return one(leaves[0])
    return str(jax.tree.unflatten(treedef, [one(leaf) for leaf in leaves]))


def _struct(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a), a.dtype), tree)


def _same(a: Any, b: Any) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb, strict=True)
    )


def _where(stage: int, p: int) -> str:
    return f"stage {stage} (rank {stage % p}, chunk {stage // p})"


def infer_stage_metadata(
    stage_fn: Callable[[Any, Any], Any],
    stage_params: Any,
    inputs: Any,
    *,
    num_ranks: int,
    num_chunks: int = 1,
    first_fn: Callable[[Any, Any], Any] | None = None,
    first_params: Any = None,
    loss_fn: Callable[[Any, Any, Any], Any] | None = None,
    last_params: Any = None,
    targets: Any = None,
) -> tuple[StageMeta, ...]:
    """Traces the stages on one microbatch and checks that their shapes chain.

    Args:
        stage_fn: ``stage_fn(params_of_one_stage, x) -> y``.
        stage_params: the stage-stacked parameters, leading dimension
            ``num_ranks * num_chunks`` (arrays or shape structs).
        inputs: one microbatch of inputs (arrays or shape structs).
        num_ranks: pipeline ranks ``p``.
        num_chunks: chunks (virtual stages) per rank ``v``.
        first_fn: optional embedding ``first_fn(first_params, inputs) -> x``.
        first_params: the embedding's parameters.
        loss_fn: optional ``loss_fn(last_params, y, targets) -> scalar``.
        last_params: the head's parameters.
        targets: one microbatch of targets.

    Returns:
        One ``StageMeta`` per model stage, in model order.

    Raises:
        ValueError: if a stage cannot take the previous stage's output, or returns an
            output of other shapes or dtypes than its input (the message names both
            stages and both shapes), or the loss is not a scalar.
        LossDoesNotTrainError: the loss depends on neither ``last_params`` nor the last
            stage's output (a subclass of ValueError).
    """
    num_stages = num_ranks * num_chunks
    one_stage = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a)[1:], a.dtype), stage_params
    )
    x = _struct(inputs)
    source = "the microbatch inputs"
    if first_fn is not None:
        try:
            x = jax.eval_shape(first_fn, _struct(first_params), x)
        except Exception as err:
            raise ValueError(
                f"first_fn cannot take a microbatch of inputs {format_struct(inputs)}: {err}"
            ) from err
        source = "first_fn (the embedding)"
    metas = []
    for stage in range(num_stages):
        try:
            y = jax.eval_shape(stage_fn, one_stage, x)
        except Exception as err:
            prev = _where(stage - 1, num_ranks) if stage else source
            raise ValueError(
                f"{_where(stage, num_ranks)} cannot take the output of {prev}, "
                f"{format_struct(x)}: {err}"
            ) from err
        if not _same(x, y):
            nxt = _where(stage + 1, num_ranks) if stage + 1 < num_stages else "the loss"
            raise ValueError(
                f"Stage shapes do not chain: {_where(stage, num_ranks)} outputs "
                f"{format_struct(y)}, but {nxt} takes {format_struct(x)} as input (the "
                f"input of {_where(stage, num_ranks)}; every stage runs the same block on "
                "one activation buffer). Make the block map its input to an output of the "
                "same shape and dtype, and change widths in first_fn or the head."
            )
        metas.append(StageMeta(stage, stage % num_ranks, stage // num_ranks, x, y))
    if loss_fn is not None:
        try:
            # traced once: the loss's shape, and whether it depends on y or last_params
            loss = check_depends(loss_fn, (_struct(last_params), x, _struct(targets)),
                                 (True, True, False), loss_fn=loss_fn, api="pipeline",
                                 model="last_params or y", cause=LOSS_CAUSE)
        except LossDoesNotTrainError:
            raise
        except Exception as err:
            raise ValueError(
                f"loss_fn cannot take the output of {_where(num_stages - 1, num_ranks)}, "
                f"{format_struct(x)}, with targets {format_struct(targets)}: {err}"
            ) from err
        if not hasattr(loss, "shape") or loss.shape != ():
            raise ValueError(
                f"loss_fn must return a scalar loss per microbatch; got {format_struct(loss)}."
            )
    return tuple(metas)


def batch_stage_metadata(cfg: PipelineConfig, params: Any, inputs: Any,
                         targets: Any) -> tuple[list[StageMeta], int]:
    """Every stage's metadata for one microbatch of ``inputs`` and ``targets`` (a global
    batch split over the data-parallel ranks and ``cfg``'s microbatches), as both pipeline
    executors infer it, and that microbatch's rows.

    Raises:
        ValueError: if inputs and targets differ in batch size, or it does not divide into
            data-parallel size x microbatches.
    """
    from jaxpg.pipeline.stage.microbatch import microbatch_size

    tt = cfg.timetable
    v, m = tt.num_chunks, tt.num_microbatches
    p = cfg.mesh.shape[cfg.pp_axis]
    dp = cfg.mesh.shape[cfg.dp_axis] if cfg.dp_axis is not None else 1
    size = microbatch_size(inputs, 1)
    if microbatch_size(targets, 1) != size:
        raise ValueError(
            f"inputs have batch size {size} but targets have {microbatch_size(targets, 1)}."
        )
    if size % (dp * m):
        raise ValueError(
            f"batch size {size} is not divisible by data-parallel size {dp} x "
            f"num_microbatches {m} = {dp * m}; use a batch size that is a multiple of {dp * m}."
        )
    rows = size // (dp * m)
    cp = cfg.mesh.shape[cfg.cp_axis] if cfg.cp_axis is not None else 1

    def local(a: Any, what: str) -> tuple[int, ...]:
        shape = (rows, *a.shape[1:])
        if cp == 1:
            return shape
        if len(shape) < 2 or shape[1] % cp:
            raise ValueError(
                f"cp_axis={cfg.cp_axis!r} splits the {what}' sequence dimension (1) over "
                f"{cp} ranks, but a leaf has shape {tuple(a.shape)}; pass (batch, sequence, "
                f"...) arrays whose sequence length is a multiple of {cp}.")
        return (rows, shape[1] // cp, *shape[2:])

    def mb_struct(tree: Any, what: str) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(local(a, what), a.dtype), tree)

    stage_fn, first_fn, loss_fn = cfg.stage_fn, cfg.first_fn, cfg.loss_fn
    if cfg.param_specs is not None or cfg.cp_axis is not None:
        # the functions on parameter shards and sequence parts, their collectives bound
        specs = (jax.tree.map(lambda _: P(), params) if cfg.param_specs is None else
                 jax.tree.unflatten(cfg.param_specs[1], cfg.param_specs[0]))
        stage_fn, first_fn, loss_fn = (
            on_shards(fn, spec, cfg.mesh) for fn, spec in
            ((stage_fn, specs.stages), (first_fn, specs.first), (loss_fn, specs.last)))
    return infer_stage_metadata(
        stage_fn, params.stages, mb_struct(inputs, "inputs"), num_ranks=p, num_chunks=v,
        first_fn=first_fn, first_params=params.first, loss_fn=loss_fn,
        last_params=params.last, targets=mb_struct(targets, "targets"),
    ), rows  # fmt: skip


def on_shards(fn: Callable[..., Any] | None, specs: Any, mesh: Any
              ) -> Callable[..., Any] | None:
    """``fn(params, *rest)`` traced as the executor runs it: inside a ``shard_map`` over
    ``mesh``, on the shards of ``params`` that ``specs`` make (so that its collectives over
    the mesh's axes are bound), ``rest`` and the result as they are on every rank."""
    if fn is None:
        return None

    def run(params: Any, *rest: Any) -> Any:
        return jax.shard_map(fn, mesh=mesh, in_specs=(specs, *(P(),) * len(rest)),
                             out_specs=P(), check_vma=False)(params, *rest)

    return run
