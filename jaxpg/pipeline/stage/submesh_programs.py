"""A sub-mesh stage's programs: SPMD programs over the stage's own mesh.

The same five programs as a plain stage's (``jaxpg.pipeline.stage.programs.StagePrograms``),
each one ``jax.shard_map`` over the stage's mesh, for the two layouts of a stage over its
sub-mesh: a tensor-parallel stage (``jaxpg.pipeline.stage.tp.StageTP``), in which the
tensor-parallel layers see their local shards and issue Megatron's collectives, its
activations replicated over tp; and a fully sharded one (``jaxpg.pipeline.stage.fsdp.StageFSDP``),
whose parameters are all-gathered inside each program and whose gradients leave reduce-scattered
(the all-gather's transpose), its activations split over the batch. Activations, targets
and losses go in and out as this process's local arrays (what the lanes move); parameters
and gradients stay global arrays with the layout's specs.

The pullback is taken inside the SPMD program (``jax.vjp`` per rank), never by
differentiating the ``shard_map`` itself: Megatron's convention (the gradient of a value
the same on every tp rank is complete on every rank) then holds as the layers assume. Its
residuals leave the forward as per-rank values (a leading axis over the stage's axis) and
enter the backward the same way; their structure is kept by the program, found when it is
traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.pipeline.stage.programs import StagePrograms
from jaxpg.pipeline.stage.trace_tools import add_grads

__all__ = ["submesh_stage_programs", "submesh_output_structs"]


class _Pullback(NamedTuple):
    """A forward's residuals (per-rank, leading axis over the stage's axis) and their
    structure."""

    tree: Any
    residuals: tuple


def _key(tree: Any) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(tree))


def _smap(layout: Any, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
    return jax.shard_map(f, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _data(layout: Any, tree: Any) -> Any:
    """The specs of activations ``tree`` (their leaves' :meth:`data_spec`)."""
    return jax.tree.map(layout.data_spec, tree)


def submesh_output_structs(graphdef: Any, layout: Any, params: Any, rest: Any,
                           inputs: tuple) -> tuple:
    """The shapes and dtypes of a sub-mesh stage's outputs, as this process holds them, for
    inputs of ``inputs``' (this process's) shapes."""
    pspecs, rspecs = layout.specs()
    inputs = tuple(layout.global_struct(a) for a in inputs)

    def call(p, r, args):
        out = nnx.merge(graphdef, layout.gather(p), r)(*args)
        return tuple(out) if isinstance(out, tuple | list) else (out,)

    out = jax.eval_shape(lambda p, r, a: _smap(
        layout, call, (pspecs, rspecs, _data(layout, a)), layout.out_spec)(p, r, a),
        params, rest, inputs)
    return tuple(layout.local_struct(a) for a in out)


@functools.lru_cache(maxsize=64)
def submesh_stage_programs(graphdef: Any, loss_fn: Callable | None, first: bool,
                           layout: Any) -> StagePrograms:
    """The programs of a sub-mesh stage (shared by stages of the same structure)."""
    base = layout.base_programs(graphdef, loss_fn, first)
    pspecs, rspecs = layout.specs()
    ax = layout.axis
    out_spec = layout.out_spec
    trees: dict[tuple, Any] = {}  # the pullback's structure, by program and input shapes

    def keep(key, vjp):
        leaves, trees[key] = jax.tree.flatten(vjp)
        return tuple(jnp.expand_dims(leaf, 0) for leaf in leaves)

    def forward(p, rest, args):
        key = ("F", *_key(args))

        def body(p, rest, args):
            out, vjp = base.forward(p, rest, args)
            return out, keep(key, vjp)

        return _smap(layout, body, (pspecs, rspecs, _data(layout, args)),
                     (out_spec, P(ax)))(p, rest, args)

    def forward_loss(p, rest, args, target):
        key = ("L", *_key((args, target)))

        def body(p, rest, args, target):
            loss, out, vjp = base.forward_loss(p, rest, args, target)
            return layout.reduce_loss(loss), out, keep(key, vjp)

        return _smap(layout, body, (pspecs, rspecs, _data(layout, args), _data(layout, target)),
                     (P(), out_spec, P(ax)))(p, rest, args, target)

    def pull(tree, residuals, dy, weights, inputs):
        def body(residuals, dy):
            grads = jax.tree.unflatten(tree, [r[0] for r in residuals])(dy)
            return (layout.weight_grads(grads[0]) if weights else None), (
                tuple(grads[1:]) if inputs else None)

        return _smap(layout, body, (P(ax), _data(layout, dy)),
                     (layout.grad_specs() if weights else P(), out_spec))(residuals, dy)

    def backward(tree, residuals, dy, g):
        dp, dx = pull(tree, residuals, dy, True, True)
        return dx, add_grads(g, dp)

    def backward_input(tree, residuals, dy):
        return pull(tree, residuals, dy, False, True)[1]

    def weight(tree, residuals, dy, g):
        return add_grads(g, pull(tree, residuals, dy, True, False)[0])

    fwd, fwd_loss = jax.jit(forward), jax.jit(forward_loss)
    bwd = jax.jit(backward, static_argnums=0, donate_argnums=(3,))
    bwd_input = jax.jit(backward_input, static_argnums=0)
    wgt = jax.jit(weight, static_argnums=0, donate_argnums=(3,))

    checked: set[tuple] = set()  # the programs whose outputs were found replicated

    def check_once(key, values, what):
        if key not in checked:
            layout.check_outputs(values, what)
            checked.add(key)

    def run_forward(p, rest, args):
        args = layout.to_global(args)
        out, res = fwd(p, rest, args)
        key = ("F", *_key(args))
        check_once(key, out, "output")
        return layout.to_local(out), _Pullback(trees[key], res)

    def run_forward_loss(p, rest, args, target):
        args, target = layout.to_global(args), layout.to_global(target)
        loss, out, res = fwd_loss(p, rest, args, target)
        key = ("L", *_key((args, target)))
        check_once(key, (loss, out), "loss or output")
        return (layout.to_local(loss), layout.to_local(out), _Pullback(trees[key], res))

    def run_backward(vjp, dy, g):
        dx, g = bwd(vjp.tree, vjp.residuals, layout.to_global(dy), g)
        return layout.to_local(dx), g

    def run_backward_input(vjp, dy):
        return layout.to_local(bwd_input(vjp.tree, vjp.residuals, layout.to_global(dy)))

    def run_weight(vjp, dy, g):
        return wgt(vjp.tree, vjp.residuals, layout.to_global(dy), g)

    return StagePrograms(run_forward, run_forward_loss, run_backward, run_backward_input,
                         run_weight)
