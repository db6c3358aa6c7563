"""Paddle's face of the pipeline: ``PipelineLayer`` over ``LayerDesc`` s, and ``train_batch``.

Paddle describes a pipelined model as a flat list of layer descriptions; each process
builds only the layers of its own stage, cut by ``seg_method`` (``"uniform"``, or
``"layer:Block"``: as many ``Block`` layers on every stage, the layers between them going
with the ``Block`` before)::

    layers = [LayerDesc(Embedding, vocab, d, seed=0)]
    layers += [LayerDesc(Block, d, seed=1 + i) for i in range(4)]
    layers += [LayerDesc(Head, d, vocab, seed=5)]
    model = PipelineLayer(layers=layers, num_stages=2, loss_fn=cross_entropy,
                          seg_method="layer:Block", accumulate_steps=4)
    loss = model.train_batch([tokens, labels], optax.adam(1e-3))  # on every process

``train_batch`` runs one step of 1F1B over ``accumulate_steps`` microbatches (the
``PipelineStage`` and 1F1B schedule of ``jaxpg.pipeline``), updates this stage's
parameters with the optax optimizer (its state kept per optimizer), and returns the
mean loss over the microbatches on every process of the pipeline (Paddle broadcasts it
from the last stage too). Unlike Paddle, ``PipelineLayer`` trains itself: there is no
``fleet.distributed_model`` wrapper to make first.

Under a :class:`~jaxpg.HybridCommunicateGroup` (``dp_degree``, ``sharding_degree``,
``pp_degree``, ``mp_degree``), as under Paddle's ``fleet.init``, the pipeline is its
``pp`` group, and the processes of the other ``dp`` and ``sharding`` coordinates are
data-parallel replicas: each calls ``train_batch`` with its own samples, the stage's
gradients are averaged over them (the ``dp x sharding`` group) before the update, and
every replica takes the same step, the one of the whole batch's mean loss; the loss
returned is the replica's own. Layouts that would not train as one device would are
refused when the layer is made: sequence or expert parallelism (``sep_degree``,
``ep_degree``), a ``group=`` other than the hybrid group's pipeline, a pipeline that does
not hold every process without a hybrid group to say what the others are, and one process
holding several ranks of the pipeline (``jaxpg.pipeline.process.stage_processes``).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpg.pipeline.layer_groups import layer_groups
from jaxpg.pipeline.process.stage_processes import refuse_local_ranks
from jaxpg.pipeline.schedule.builders import one_f_one_b
from jaxpg.pipeline.schedule.timetable import Timetable
from jaxpg.pipeline.stage.pipeline_stage import PipelineStage, _pipeline_group
from jaxpg.pipeline.torch_api import PipelineScheduleSingle

__all__ = ["LayerDesc", "PipelineLayer", "segment_layers"]


class LayerDesc:
    """A layer to build on the process that runs it: ``layer_func(*inputs, **kwargs)``.

    Args:
        layer_func: an ``nnx.Module`` class.
        inputs: its constructor's positional arguments (seed it by an argument, so that
            every process builds the same weights).
        kwargs: its constructor's keyword arguments.
    """

    def __init__(self, layer_func: type, *inputs: Any, **kwargs: Any) -> None:
        if not (isinstance(layer_func, type) and issubclass(layer_func, nnx.Module)):
            raise TypeError(f"LayerDesc layer_func must be an nnx.Module class, got "
                            f"{layer_func!r}.")
        self.layer_func, self.inputs, self.kwargs = layer_func, inputs, kwargs

    def build_layer(self) -> nnx.Module:
        """Builds the layer."""
        return self.layer_func(*self.inputs, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerDesc({self.layer_func.__name__})"


def _name(item: Any) -> str:
    if isinstance(item, LayerDesc):
        return item.layer_func.__name__
    return type(item).__name__ if isinstance(item, nnx.Module) else getattr(item, "__name__", "")


def segment_layers(layers: Sequence[Any], num_parts: int, seg_method: str) -> list[int]:
    """Paddle's ``SegmentLayers``: the ``num_parts + 1`` boundaries of the stages' layers.

    Example:
        >>> segment_layers(["e", "b", "b", "b", "b", "h"], 2, "uniform")
        [0, 3, 6]
    """
    n = len(layers)
    if seg_method == "uniform":
        if n < num_parts:
            raise ValueError(f"seg_method='uniform' needs at least num_stages={num_parts} "
                             f"layers, got {n}.")
        size, extra = divmod(n, num_parts)
        bounds = [0]
        for i in range(1, num_parts + 1):
            bounds.append(bounds[-1] + size + (1 if i > num_parts - extra else 0))
        return bounds
    if not isinstance(seg_method, str) or not seg_method.startswith("layer:"):
        raise ValueError(f"seg_method={seg_method!r} must be 'uniform' or 'layer:<class name "
                         "regex>' (e.g. 'layer:Block').")
    pattern = seg_method.split(":", 1)[1]
    weights = [1 if re.search(pattern, _name(item)) else 0 for item in layers]
    total = sum(weights)
    if total == 0 or total % num_parts:
        raise ValueError(f"seg_method={seg_method!r} matches {total} layers, which do not "
                         f"divide into num_stages={num_parts} equal parts.")
    part = total // num_parts
    bounds, count = [0], 0
    for i, w in enumerate(weights):
        count += w
        if count == part and len(bounds) < num_parts:
            bounds.append(i + 1)
            count = 0
    bounds.append(n)
    return bounds


class _Segment(nnx.Module):
    """One stage's layers, called in order."""

    def __init__(self, layers: list[Any]) -> None:
        self.count = len(layers)
        for i, layer in enumerate(layers):
            setattr(self, f"layer_{i}", layer)

    def __call__(self, *x: Any) -> Any:
        for i in range(self.count):
            out = getattr(self, f"layer_{i}")(*x)
            x = tuple(out) if isinstance(out, tuple) else (out,)
        return x[0] if len(x) == 1 else x


class _PaddleOneFOneB(PipelineScheduleSingle):
    """1F1B over any number of microbatches: Paddle's pipeline takes ``accumulate_steps``
    below the stage count (its default is 1), where torch's ``Schedule1F1B`` refuses."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return one_f_one_b(p, m)


class PipelineLayer:
    """Paddle's ``PipelineLayer``: this process's stage of a list of layers.

    Args:
        layers: ``LayerDesc`` s, ``nnx.Module`` s or plain functions, in model order.
        num_stages: the pipeline's stages (the pipeline group's size).
        loss_fn: ``loss_fn(output, label)``, the mean loss of a microbatch.
        seg_method: ``"uniform"`` or ``"layer:<class name regex>"``.
        accumulate_steps: microbatches per ``train_batch`` (Paddle's pipeline config).
        group: the pipeline's process group (default: the hybrid group's ``pp`` group, or
            the world without one).
        hcg: the ``HybridCommunicateGroup`` of the layout (default: the world's latest, as
            Paddle's ``fleet.get_hybrid_communicate_group()``). Its ``dp`` and
            ``sharding`` ranks are data-parallel replicas of this stage: each trains on its
            own samples, and ``train_batch`` averages their gradients.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int, loss_fn: Callable,
                 seg_method: str = "uniform", *, accumulate_steps: int = 1,
                 group: Any = None, hcg: Any = None) -> None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral):
            raise ValueError(f"PipelineLayer num_stages={num_stages!r} must be an int.")
        self.group, self.data_parallel_group = layer_groups(group, hcg, _pipeline_group)
        if num_stages != self.group.size():
            raise ValueError(f"PipelineLayer num_stages={num_stages} must equal the pipeline "
                             f"group's size {self.group.size()} (one stage per process).")
        for item in layers:
            if not (isinstance(item, LayerDesc | nnx.Module) or callable(item)):
                raise TypeError(f"PipelineLayer layers must be LayerDesc, nnx.Module or "
                                f"callables, got {item!r}.")
        self.segment_parts = segment_layers(list(layers), int(num_stages), seg_method)
        self.stage_id = self.group.rank()
        lo, hi = self.segment_parts[self.stage_id], self.segment_parts[self.stage_id + 1]
        built = [i.build_layer() if isinstance(i, LayerDesc) else i for i in layers[lo:hi]]
        self.run_function = _Segment(built)
        self.stage = PipelineStage(self.run_function, self.stage_id, int(num_stages),
                                   group=self.group,
                                   data_parallel_group=self.data_parallel_group)
        refuse_local_ranks([self.stage], "PipelineLayer")
        self._schedule = _PaddleOneFOneB(self.stage, accumulate_steps, loss_fn=loss_fn)
        self._opt_states: dict[int, tuple[Any, Any]] = {}

    def parameters(self) -> nnx.State:
        """This stage's parameters."""
        return nnx.state(self.run_function, nnx.Param)

    def train_batch(self, data: Sequence[Any], optimizer: optax.GradientTransformation,
                    lr_scheduler: Any = None, scaler: Any = None) -> Any:
        """One training step over ``data = [inputs, labels]``; returns the mean loss.

        Every process of the pipeline calls it with the same ``data`` (the first stage
        reads the inputs, the last the labels); each data-parallel replica (``dp`` and
        ``sharding`` coordinates of the hybrid group) with its own samples.
        ``lr_scheduler`` and ``scaler`` are Paddle's; give the schedule to the optax
        optimizer instead (must be None here).
        """
        if lr_scheduler is not None or scaler is not None:
            raise ValueError("PipelineLayer.train_batch: pass the learning-rate schedule in "
                             "the optax optimizer (optax.adam(schedule)); lr_scheduler and "
                             "scaler must be None.")
        if not isinstance(data, list | tuple) or len(data) != 2:
            raise ValueError(f"PipelineLayer.train_batch data must be [inputs, labels], got "
                             f"{type(data).__name__} of length {len(data)}.")
        x, y = data
        losses: list = []
        self.stage.zero_grad()
        if self.stage.is_first:
            self._schedule.step(x)
        elif self.stage.is_last:
            self._schedule.step(target=y, losses=losses)
        else:
            self._schedule.step()
        params = self.parameters()
        key = id(optimizer)
        if key not in self._opt_states or self._opt_states[key][0] is not optimizer:
            self._opt_states[key] = (optimizer, optimizer.init(params))
        updates, state = optimizer.update(self.stage.grads, self._opt_states[key][1], params)
        self._opt_states[key] = (optimizer, state)
        nnx.update(self.run_function, optax.apply_updates(params, updates))
        return self._broadcast_loss(losses)

    def _broadcast_loss(self, losses: list) -> Any:
        from jaxpg.collectives import broadcast

        last = self.group.global_rank(self.group.size() - 1)
        mine = (jnp.mean(jnp.stack(losses)).reshape(1) if losses
                else jnp.zeros(1, jnp.float32))  # fmt: skip
        return np.asarray(broadcast(mine, src=last, group=self.group))[0]

    def __repr__(self) -> str:
        return (f"PipelineLayer(stage {self.stage_id} of {len(self.segment_parts) - 1}, "
                f"layers {self.segment_parts[self.stage_id]}..."
                f"{self.segment_parts[self.stage_id + 1] - 1})")
