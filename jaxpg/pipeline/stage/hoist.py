"""Hoist a stage's parameter-only layout work out of its per-microbatch programs.

A stage often holds several layers stacked in one array and picks layer ``i`` with
``w[i]``: a ``slice`` and a ``squeeze`` of a parameter. Inside one program XLA:CPU
copies such a slice before a matmul reads it, and the weight gradient of a stacked
parameter is assembled by padding each layer's gradient to the stack's shape and
adding them up. The SPMD executor runs all microbatches in one loop, where XLA hoists
the slices out of the loop; the process executor runs each action as a program of its
own, so each would copy every layer's weights and pad every layer's gradient again,
and run slower than the same stage written over per-layer arrays (docs/pipeline_mp.md
has the figures).

:func:`hoist_stage` cuts the stage's jaxpr in two:

* ``prepare(p) -> q``: the equations that read only parameters and only move them
  (``slice``, ``squeeze``, ``reshape``, ``transpose``, ...; all linear), run once per
  step;
* ``stage(q, x) -> y``: the rest, which the per-action programs run on ``q``.

Weight gradients are then made and added up per layer, in ``q``'s terms, and turned
into gradients of ``p`` once per step by ``grad_back``, the transpose of ``prepare``
(``jax.linear_transpose``). ``stage(prepare(p), x)`` is ``stage_fn(p, x)``, equation
for equation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.extend.core import Literal

from jaxpg.pipeline.stage.trace_tools import eval_eqns, is_var, tree_key

__all__ = ["HOISTABLE", "HoistedStage", "hoist_stage"]

#: Parameter-only primitives that move data without computing: hoisted out of the
#: per-microbatch programs (each is linear, so ``prepare`` can be transposed).
HOISTABLE = frozenset(
    "slice squeeze reshape transpose expand_dims rev copy copy_p dynamic_slice".split()
)


class HoistedStage(NamedTuple):
    """A stage cut into its parameter layout work and the rest (see the module docstring).

    Attributes:
        prepare: ``prepare(p) -> q``, a tuple of arrays.
        stage: ``stage(q, x) -> y``.
        grad_back: ``grad_back(dq) -> dp``, the transpose of ``prepare``.
        q_structs: shapes and dtypes of ``q``.
        hoisted: the primitive names ``prepare`` runs.
    """

    prepare: Callable
    stage: Callable
    grad_back: Callable
    q_structs: tuple
    hoisted: tuple[str, ...]


def hoist_stage(stage_fn: Callable, params: Any, act: Any) -> HoistedStage | None:
    """Cuts ``stage_fn``'s parameter-only layout work out; None if it has none.

    Args:
        stage_fn: ``stage_fn(p, x) -> y``.
        params: one stage's parameters (arrays or shape structs).
        act: one activation (arrays or shape structs).
    """
    return _hoist(stage_fn, tree_key(params), tree_key(act))


@functools.lru_cache(maxsize=32)
def _hoist(stage_fn: Callable, p_key: tuple, x_key: tuple) -> HoistedStage | None:
    p_struct = jax.tree.unflatten(p_key[0], [jax.ShapeDtypeStruct(s, d) for s, d in p_key[1]])
    x_struct = jax.tree.unflatten(x_key[0], [jax.ShapeDtypeStruct(s, d) for s, d in x_key[1]])
    closed = jax.make_jaxpr(stage_fn)(p_struct, x_struct)
    jaxpr, consts = closed.jaxpr, closed.consts
    n_p = p_key[0].num_leaves
    p_vars, x_vars = jaxpr.invars[:n_p], jaxpr.invars[n_p:]
    on_params = set(p_vars)
    hoisted = []
    for i, eqn in enumerate(jaxpr.eqns):
        reads = [v for v in eqn.invars if is_var(v)]
        if eqn.primitive.name in HOISTABLE and reads and all(v in on_params for v in reads):
            hoisted.append(i)
            on_params.update(eqn.outvars)
    if not hoisted:
        return None
    hoisted_set = set(hoisted)
    rest = [e for i, e in enumerate(jaxpr.eqns) if i not in hoisted_set]
    used = {v for e in rest for v in e.invars if is_var(v)} | {
        v for v in jaxpr.outvars if is_var(v)}
    order = {v: n for n, v in enumerate(list(p_vars) + [
        v for i in hoisted for v in jaxpr.eqns[i].outvars])}
    q_vars = sorted((v for v in order if v in used), key=order.__getitem__)
    prep_eqns = [jaxpr.eqns[i] for i in hoisted]

    def prepare(p):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(p_vars, jax.tree.leaves(p), strict=True))
        eval_eqns(prep_eqns, env)
        return tuple(env[v] for v in q_vars)

    out_tree = jax.tree.structure(jax.eval_shape(stage_fn, p_struct, x_struct))

    def stage(q, x):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(q_vars, q, strict=True))
        env.update(zip(x_vars, jax.tree.leaves(x), strict=True))
        eval_eqns(rest, env)
        return jax.tree.unflatten(out_tree, [v.val if isinstance(v, Literal) else env[v]
                                             for v in jaxpr.outvars])

    transpose = jax.linear_transpose(prepare, p_struct)

    def grad_back(dq):
        return transpose(tuple(dq))[0]

    q_structs = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in q_vars)
    return HoistedStage(prepare, stage, grad_back, q_structs,
                        tuple(e.primitive.name for e in prep_eqns))
