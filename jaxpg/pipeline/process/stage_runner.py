"""Runs one process's :class:`~jaxpg.pipeline.stage.pipeline_stage.PipelineStage` s through a
timetable: the process executor for stages that differ from each other.

The process executor of ``pipeline_value_and_grad`` (``jaxpg.pipeline.process.executor``) runs
stacked, identical stages; this one runs each stage's own module, so a stage may hold the
embedding, another the head, and their inputs and outputs may differ in shapes and dtypes.
The rest is the same machinery: the rank's actions in its timetable order
(``rank_ops``), messages on one in-order lane per neighbour (``p2p_lanes``), sent as
soon as made and waited for right before they are read.

* **Shapes.** On a schedule's first step, :func:`exchange_shapes` walks the model stages
  in order: a stage learns its input's shapes and dtypes from its inputs (the first), from
  its own previous chunk, or by the seed's ``recv_meta`` from the rank before it, computes
  its output's with ``jax.eval_shape`` and ``send_meta`` s them to the next rank. Each rank
  waits only for the stage before its own, so the chain cannot deadlock. A stage that
  cannot take its input (or a loss that cannot take the last stage's output and the
  target) is named on every rank of the pipeline, before anything runs (one
  ``all_gather_object`` of the verdict). The shapes fix every message's receive
  buffer from then on.
* **Programs.** Per stage, jitted (``jaxpg.pipeline.stage.programs``): ``F`` keeps the
  pullback until ``B`` (or ``B`` and ``W``) applies it. A tensor-parallel stage's programs
  are SPMD programs over its tp group (``jaxpg.pipeline.stage.submesh_programs``), a fully
  sharded stage's over its dp_shard group; activations still travel as each process's own
  copy (replicated over tp) or rows (split over dp_shard), to the same rank of the next
  stage's group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.collectives.objects import all_gather_object
from jaxpg.pipeline.process.action_walk import run_beside_lanes, walk_actions
from jaxpg.pipeline.process.p2p_lanes import StepMail
from jaxpg.pipeline.process.rank_plan import RankPlan, rank_plan
from jaxpg.pipeline.stage.carried import StageOutputError, check_stage_output, grad_leaves
from jaxpg.pipeline.stage.metadata import format_struct
from jaxpg.pipeline.stage.programs import StagePrograms, plain_programs
from jaxpg.pipeline.stage.submesh_programs import submesh_stage_programs

__all__ = ["StagePrograms", "stage_programs", "rank_setup", "exchange_shapes",
           "run_step"]


def stage_programs(stage: Any, loss_fn: Callable | None) -> StagePrograms:
    """The programs of ``stage`` (a PipelineStage) with ``loss_fn``; stages of the same
    structure (graph) share them, so every schedule of a model compiles them once."""
    if stage.layout is not None:
        return submesh_stage_programs(stage.graphdef, loss_fn, stage.is_first, stage.layout)
    return plain_programs(stage.graphdef, loss_fn, stage.is_first)


def rank_setup(tt: Any, group: Any) -> RankPlan:
    """This process's part of ``tt`` over the pipeline ``group`` (one rank per process)."""
    global_of = {q: group.global_rank(q) for q in range(tt.num_stages)}
    return rank_plan(tt, group.rank(), group.devices, global_of)


def _structs(tree: Any) -> tuple:
    return tuple(jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) for a in tree)


def exchange_shapes(tt: Any, setup: RankPlan, stages: dict, first_inputs: tuple | None,
                    what: str, group: Any, loss_fn: Callable | None = None,
                    target: Any = None) -> tuple[dict, dict]:
    """Each local stage's input and output shape structs (``send_meta``/``recv_meta``).

    Every rank of the pipeline finds out whether the chain holds before any activation
    travels: a stage that cannot take what reaches it sends ``send_no_meta`` on, so no
    rank waits for shapes that will not come, and one ``all_gather_object`` over the
    pipeline ``group`` hands the first failure (in model order) to every rank, which all
    raise it.

    Args:
        tt: the timetable.
        setup: this rank's :class:`~jaxpg.pipeline.process.rank_plan.RankPlan`.
        stages: model stage -> this process's PipelineStage.
        first_inputs: one microbatch of the model's inputs (on the first stage's process).
        what: the schedule, for errors.
        group: the pipeline's process group (the verdict's).
        loss_fn: the schedule's ``loss_fn(output, target)``, checked on the last stage's
            output with ``target`` (one microbatch's, on the last stage's process).

    Returns:
        ``(inputs, outputs)``: model stage -> a tuple of shape structs.

    Raises:
        ValueError: on every rank, when a stage cannot take the previous stage's output (or
            the microbatch), or its ``input_args`` differ from what it receives; the message
            names both stages and the shapes.
        TypeError: on every rank, when a stage returns other than an array or a tuple of
            arrays (or, to a next stage, one with no floating-point array to carry the
            gradient, or of other dtypes than floating, integer and bool).
    """
    n = tt.num_model_stages
    inputs, outputs = {}, {}
    failure = None  # (stage, error) found by this process
    for s in sorted(stages):
        if s == 0:
            got = _structs(first_inputs)
        elif s - 1 in stages:
            got = outputs.get(s - 1)
        else:  # always received: the rank before always sends (shapes, or that it has none)
            peer = tt.place_of(s - 1)[0]
            got = setup.pairs[peer][0].recv_meta(what)
            got = None if got is None else tuple(got)
        if got is not None and failure is None:
            inputs[s] = got
            try:
                outputs[s] = _stage_outputs(tt, stages[s], got, what)
                if s == n - 1 and loss_fn is not None and target is not None \
                        and stages[s].tp is None:  # a tp stage's loss may need its group
                    _check_loss(loss_fn, outputs[s], target, s, what)
            except (ValueError, TypeError) as err:
                failure = (s, err)
        if s < n - 1 and s + 1 not in stages:
            lane = setup.pairs[tt.place_of(s + 1)[0]][0]
            if s in outputs:
                lane.send_meta(outputs[s], what)
            else:
                lane.send_no_meta(what)
    _agree_on_shapes(group, failure, setup.me)
    return inputs, outputs


def _shown(structs: tuple) -> str:
    """A stage's inputs as text: one array as ``float32[2,16]``, several as a tuple."""
    return format_struct(structs[0] if len(structs) == 1 else structs)


def _stage_outputs(tt: Any, stage: Any, got: tuple, what: str) -> tuple:
    """Stage ``stage``'s output structs for inputs ``got``, or the named error."""
    s = stage.stage_index
    source = "the microbatch inputs" if s == 0 else \
        f"stage {s - 1}'s output (pipeline rank {tt.place_of(s - 1)[0]})"
    if stage.input_args is not None and [(a.shape, a.dtype) for a in stage.input_args] != [
            (a.shape, a.dtype) for a in got]:
        raise ValueError(f"{what}: stage {s}'s input_args are {_shown(stage.input_args)} "
                         f"but it receives {_shown(got)}, {source}; fix input_args, "
                         f"the stage before it or the microbatch size.")
    module = type(stage.submod).__name__
    try:
        out = stage.output_structs(got)
    except StageOutputError as err:  # raised by the stage's trace: named with the schedule
        raise StageOutputError(f"{what}: {err}") from err
    except Exception as err:  # noqa: BLE001 (any failure to trace the stage on these shapes)
        fix = ("make the batch fit stage 0 (it is split into n_microbatches along "
               "dimension 0)" if s == 0 else
               f"make stage {s - 1}'s output fit stage {s}'s input, or state what stage {s} "
               "takes with input_args=")
        raise ValueError(f"{what}: stage {s} ({module}) cannot take {source}, "
                         f"{_shown(got)}: {type(err).__name__}: {str(err).rstrip('.')}; "
                         f"{fix}.") from err
    check_stage_output(out, f"{what}: stage {s} ({module})", travels=s < tt.num_model_stages - 1)
    return tuple(out)


def _check_loss(loss_fn: Callable, outputs: tuple, target: Any, s: int, what: str) -> None:
    """``loss_fn`` takes the last stage's ``outputs`` with ``target`` and gives a scalar."""
    y = outputs[0] if len(outputs) == 1 else outputs
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
                           target)
    try:
        loss = jax.eval_shape(loss_fn, y, structs)
    except Exception as err:  # noqa: BLE001 (any failure to trace the loss on these shapes)
        raise ValueError(f"{what}: loss_fn cannot take stage {s}'s output {_shown(outputs)} "
                         f"with a target microbatch of {format_struct(structs)}: "
                         f"{type(err).__name__}: {str(err).rstrip('.')}; make the last "
                         "stage's output and the target fit the loss.") from err
    if getattr(loss, "shape", None) != ():
        raise ValueError(f"{what}: loss_fn must return a scalar loss per microbatch; on stage "
                         f"{s}'s output {_shown(outputs)} it returns {format_struct(loss)}.")


def _agree_on_shapes(group: Any, failure: tuple | None, me: int) -> None:
    """Raises the first failure in model order on every rank of ``group`` (none: returns)."""
    mine = None if failure is None else [
        failure[0], "TypeError" if isinstance(failure[1], TypeError) else "ValueError",
        str(failure[1]), me]
    found = [f for f in all_gather_object(mine, group=group) if f is not None]
    if not found:
        return
    stage, kind, text, rank = min(found)
    error = (TypeError if kind == "TypeError" else ValueError)(
        f"{text} (found by rank {rank} before the step ran; every rank of the pipeline "
        "raises this)")
    if failure is not None and failure[0] == stage:
        raise error from failure[1]
    raise error


def run_step(tt: Any, setup: RankPlan, stages: dict, shapes: tuple[dict, dict],
             loss_fn: Callable | None, args: Sequence[tuple] | None,
             targets: Sequence[Any] | None, timeout: float, what: str) -> tuple[dict, dict, dict]:
    """One step of this rank's actions.

    Returns:
        ``(grads, losses, outputs)``: model stage -> its summed weight gradient (this
        step's microbatches); microbatch -> loss and -> last stage's output (last stage).
    """
    inputs, outputs = shapes

    def structs_of(key):
        kind, s, _ = key
        return inputs[s] if kind == "act" else grad_leaves(outputs[s])

    mail = StepMail(setup.me, timeout, what, setup.process_of)
    actions = _StageActions(setup, stages, loss_fn, args, targets)

    def walk():
        walk_actions(setup, actions, mail)
        return actions.grads, actions.losses, actions.outs

    return run_beside_lanes(setup, mail, lambda lane, transfers: lane.run_transfers(
        transfers, mail, structs_of, what), walk)


class _StageActions:
    """This process's stages' actions (a ``RankActions``): each ``F`` keeps its pullback
    until the backward, each stage sums its weight gradient, the last keeps losses and
    outputs per microbatch."""

    def __init__(self, setup, stages, loss_fn, args, targets) -> None:
        self.params = {s: st.program_params() for s, st in stages.items()}
        self.rests = {s: st.placed(st.frozen_state()) for s, st in stages.items()}
        self.progs = {s: stage_programs(st, loss_fn) for s, st in stages.items()}
        self.split = any(op.kind == "W" for op in setup.ops)
        self.args, self.targets = args, targets
        self.vjps, self.dys, self.losses, self.outs = {}, {}, {}, {}
        self.grads = dict.fromkeys(stages)
        self.one = None

    def forward(self, op, received):
        s, mb = op.stage, op.microbatch
        x = self.args[mb] if op.first else received
        if op.last:
            self.losses[mb], self.outs[mb], self.vjps[s, mb] = self.progs[s].forward_loss(
                self.params[s], self.rests[s], x, self.targets[mb])
            return None
        sent, self.vjps[s, mb] = self.progs[s].forward(self.params[s], self.rests[s], x)
        return sent

    def backward(self, op, received):
        s, mb = op.stage, op.microbatch
        if op.last:
            if self.one is None:
                self.one = jnp.ones((), self.losses[mb].dtype)
            dy = self.one
        else:
            dy = received
        if self.split:
            self.dys[s, mb] = dy
            return None if op.first else self.progs[s].backward_input(self.vjps[s, mb], dy)
        sent, self.grads[s] = self.progs[s].backward(self.vjps.pop((s, mb)), dy, self.grads[s])
        return sent

    def weight(self, op):
        s, mb = op.stage, op.microbatch
        self.grads[s] = self.progs[s].weight(self.vjps.pop((s, mb)), self.dys.pop((s, mb)),
                                             self.grads[s])

    def done(self, op, out) -> None:
        pass

