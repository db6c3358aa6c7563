"""A stage's forward and backward cut into F, B and W pieces that share saved residuals.

Without remat the executor keeps, from each microbatch's forward ``F`` until its
backward, what ``jax.vjp`` would keep (the *residuals*), and never runs the stage's
forward again. With a split backward (zero-bubble schedules) ``B`` computes only the
input gradient and ``W`` only the weight gradient, and ``W`` reuses what ``B`` already
computed, so ``F + B + W`` does exactly the work of ``F + (full backward)``.

How: ``split_stage`` traces ``y, vjp = jax.vjp(stage_fn, p, x); dp, dx = vjp(dy)`` once
into a jaxpr and sorts its equations:

* those that depend on ``dy`` are backward work. ``B`` gets the ones the input
  gradient ``dx`` needs (all of them when the backward is whole); ``W`` the rest of
  what the weight gradient ``dp`` needs. The values ``B`` computes that ``W`` reads
  (e.g. the gradient at a hidden layer) are ``W``'s residuals, saved by ``B``.
* those that depend on the activation ``x`` but not on ``dy`` are forward work, run
  by ``F``. Of the values the backward reads, the results of matmuls and other
  non-elementwise operations are ``F``'s residuals, saved; elementwise ones (an
  activation function and its derivative) are recomputed by the backward from those,
  as torch's autograd recomputes ``gelu``'s derivative from its saved input. For a
  ``x + W2 gelu(W1 x)`` block that saves one ``[b, 4d]`` array instead of the six
  ``jax.vjp`` keeps, and recomputes no matmul.
* those that depend on neither (parameters and constants only: a transpose of a
  weight, a broadcast bias, zeros) are run by whichever piece needs them, so that no
  copy of a parameter is ever saved per microbatch. The stage input ``x``, the
  parameters and ``dy`` are read from the executor's own buffers, never saved twice.

A nested ``jax.jit``, ``custom_jvp`` function or ``jax.checkpoint`` inside ``stage_fn``
stays one equation. One that calls only elementwise operations (most of ``jax.nn``) is
recomputed like one; any other's results are saved, and its backward runs whole in
``B`` (correct, only less split).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import Literal

from jaxpg.pipeline.stage.trace_tools import eval_eqns, is_var

__all__ = ["StagePieces", "split_stage", "ELEMENTWISE"]

#: Primitives the backward recomputes instead of saving their results: elementwise and
#: shape-only operations, cheap next to the matmuls whose results are saved. Keep it up
#: to date with jax: a primitive missing here is saved per microbatch (jax 0.11.2 added
#: ``one_minus_square`` to ``tanh``'s derivative, 0.12 ``polynomial``; docs/pipeline.md).
ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e "
    "bitcast_convert_type broadcast_in_dim cbrt ceil clamp clz complex conj "
    "convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 "
    "expand_dims expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow "
    "is_finite le lgamma log log1p log2 logistic lt max min mul ne neg nextafter not "
    "one_minus_square or polygamma polynomial population_count pow random_gamma_grad "
    "real reduce_precision regularized_incomplete_beta reshape rem round rsqrt select_n "
    "shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square "
    "squeeze stop_gradient sub tan tanh xor zeta".split()
)

#: Call primitives (a nested ``jax.jit``, a ``custom_jvp``/``custom_vjp`` function, a
#: ``jax.checkpoint``) that count as elementwise when everything they call is: most of
#: ``jax.nn`` is jitted, and jax 0.12 computes ``erf``'s derivative in a ``custom_jvp``.
CALLS = frozenset(
    "jit pjit closed_call core_call custom_jvp_call custom_vjp_call remat2 checkpoint".split()
)

#: What ``B`` may take over from ``W`` (see ``split_stage``): elementwise, shape and
#: reduction operations, never a matmul.
B_CAN_RUN = ELEMENTWISE | frozenset(
    "add_any reduce_sum reduce_max reduce_min transpose mul select_n".split()
)


def _inner_eqns(value: Any) -> list | None:
    """The equations of a jaxpr-valued equation parameter, else ``None``."""
    inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr holds a Jaxpr
    eqns = getattr(inner, "eqns", None)
    return eqns if isinstance(eqns, list) else None


def _elementwise(eqn: Any) -> bool:
    """Whether the backward recomputes ``eqn`` instead of saving what it makes: an
    ``ELEMENTWISE`` primitive, or a ``CALLS`` one whose calls are all elementwise."""
    name = eqn.primitive.name
    if name in ELEMENTWISE:
        return True
    if name not in CALLS:
        return False
    bodies = [b for b in map(_inner_eqns, eqn.params.values()) if b is not None]
    return bool(bodies) and all(_elementwise(e) for body in bodies for e in body)


def _slice(eqns, allowed: set[int], targets: Sequence[Any]) -> tuple[list[int], set]:
    """Indices of the ``allowed`` equations that ``targets`` need, and the vars they read
    but do not make themselves."""
    want = {v for v in targets if is_var(v)}
    made, picked = set(), []
    for i in range(len(eqns) - 1, -1, -1):
        if i in allowed and any(v in want for v in eqns[i].outvars):
            picked.append(i)
            made.update(eqns[i].outvars)
            want.update(v for v in eqns[i].invars if is_var(v))
    return picked[::-1], want - made


class StagePieces(NamedTuple):
    """The pieces of one stage; see the module docstring.

    Attributes:
        forward: ``forward(p, x) -> (y, res)``, ``res`` a tuple of arrays.
        backward: ``backward(p, x, dy, res) -> (dp, dx, wres)``; ``dp`` is ``None`` when
            the backward is split (then ``wres`` is what ``weight`` needs), else ``wres``
            is ``()``.
        weight: ``weight(p, x, dy, res, wres) -> dp`` (split backward only).
        weight_into: ``weight_into(g, p, x, dy, res, wres) -> g + dp``, adding each weight
            gradient to ``g`` before the next is made (split backward only).
        res_structs: shapes and dtypes of ``res``.
        wres_structs: shapes and dtypes of ``wres``.
        primitives: the primitive names each piece runs, by piece (``"F"``, ``"B"``,
            ``"W"``), to inspect how the work was divided.
    """

    forward: Callable
    backward: Callable
    weight: Callable | None
    weight_into: Callable | None
    res_structs: tuple[jax.ShapeDtypeStruct, ...]
    wres_structs: tuple[jax.ShapeDtypeStruct, ...]
    primitives: dict[str, tuple[str, ...]]


def split_stage(
    stage_fn: Callable[[Any, Any], Any], params: Any, act: Any, split_backward: bool
) -> StagePieces:
    """Cuts ``stage_fn`` into F, B (and W) pieces that save residuals instead of recomputing.

    Args:
        stage_fn: ``stage_fn(p, x) -> y`` with ``y`` of the same structure as ``x``.
        params: one stage's parameters (arrays or ``jax.ShapeDtypeStruct``).
        act: one activation (arrays or ``jax.ShapeDtypeStruct``).
        split_backward: whether to cut the backward into input (``B``) and weight (``W``)
            gradients.

    Returns:
        The :class:`StagePieces`.
    """

    def full(p, x, dy):
        y, vjp = jax.vjp(stage_fn, p, x)
        dp, dx = vjp(dy)
        return y, dp, dx

    closed = jax.make_jaxpr(full)(params, act, act)
    jaxpr, consts = closed.jaxpr, closed.consts
    p_tree = jax.tree.structure(params)
    x_tree = jax.tree.structure(act)
    n_p, n_x = p_tree.num_leaves, x_tree.num_leaves
    p_vars = jaxpr.invars[:n_p]
    x_vars = jaxpr.invars[n_p : n_p + n_x]
    dy_vars = jaxpr.invars[n_p + n_x :]
    y_out = jaxpr.outvars[:n_x]
    dp_out = jaxpr.outvars[n_x : n_x + n_p]
    dx_out = jaxpr.outvars[n_x + n_p :]
    eqns = jaxpr.eqns

    on_x, on_dy = set(x_vars), set(dy_vars)
    backward_eqns, forward_eqns, free_eqns = set(), set(), set()
    for i, eqn in enumerate(eqns):
        reads = [v for v in eqn.invars if is_var(v)]
        if any(v in on_dy for v in reads):
            on_dy.update(eqn.outvars)
            backward_eqns.add(i)
        elif any(v in on_x for v in reads):
            on_x.update(eqn.outvars)
            forward_eqns.add(i)
        else:
            free_eqns.add(i)

    cheap = {i for i in forward_eqns if _elementwise(eqns[i])}
    b_targets = list(dx_out) if split_backward else list(dp_out) + list(dx_out)
    b_idx, b_reads = _slice(eqns, backward_eqns | free_eqns | cheap, b_targets)
    w_idx, w_reads = [], set()
    if split_backward:
        b_set = set(b_idx)
        w_idx, _ = _slice(eqns, (backward_eqns - b_set) | free_eqns | cheap, dp_out)
        # B also runs what of W it can run from what it has, short of a matmul (the
        # activation gelu(u) a weight gradient reads, a bias gradient), so that W reads
        # those from B instead of recomputing them and re-reading their inputs.
        has = set(b_reads) | {v for i in b_set for v in eqns[i].outvars}
        for i in w_idx:
            eqn = eqns[i]
            runnable = eqn.primitive.name in B_CAN_RUN or _elementwise(eqn)
            if i in free_eqns or i in b_set or not runnable:
                continue
            if all(v in has for v in eqn.invars if is_var(v)):
                b_set.add(i)
                has.update(eqn.outvars)
        b_idx = sorted(b_set)
        w_idx, w_reads = _slice(eqns, ((backward_eqns | cheap) - b_set) | free_eqns, dp_out)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    forward_made = {v for i in forward_eqns - cheap for v in eqns[i].outvars}
    order = {v: n for n, v in enumerate(v for eqn in eqns for v in eqn.outvars)}
    res_vars = sorted((b_reads | w_reads) & forward_made, key=order.__getitem__)
    b_made = {v for i in b_idx if i not in free_eqns for v in eqns[i].outvars}
    wres_vars = sorted(w_reads & b_made, key=order.__getitem__)
    f_idx, f_reads = _slice(eqns, forward_eqns | free_eqns, list(y_out) + res_vars)
    stray = (f_reads | b_reads | w_reads) - inputs - forward_made - b_made - {
        v for i in cheap | free_eqns for v in eqns[i].outvars
    }
    if stray:  # pragma: no cover - a jaxpr always defines what it reads
        raise RuntimeError(f"split_stage: unresolved jaxpr variables {sorted(map(str, stray))}")
    f_eqns = [eqns[i] for i in f_idx]
    b_eqns = [eqns[i] for i in b_idx]
    w_eqns = [eqns[i] for i in w_idx]

    def env_of(p, x, dy=None):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(p_vars, jax.tree.leaves(p), strict=True))
        env.update(zip(x_vars, jax.tree.leaves(x), strict=True))
        if dy is not None:
            env.update(zip(dy_vars, jax.tree.leaves(dy), strict=True))
        return env

    def read(env, v):
        return v.val if isinstance(v, Literal) else env[v]

    def forward(p, x):
        env = env_of(p, x)
        eval_eqns(f_eqns, env)
        y = jax.tree.unflatten(x_tree, [read(env, v) for v in y_out])
        return y, tuple(env[v] for v in res_vars)

    def backward(p, x, dy, res):
        env = env_of(p, x, dy)
        env.update(zip(res_vars, res, strict=True))
        eval_eqns(b_eqns, env)
        dx = jax.tree.unflatten(x_tree, [read(env, v) for v in dx_out])
        if split_backward:
            return None, dx, tuple(env[v] for v in wres_vars)
        return jax.tree.unflatten(p_tree, [read(env, v) for v in dp_out]), dx, ()

    def weight(p, x, dy, res, wres):
        env = env_of(p, x, dy)
        env.update(zip(res_vars, res, strict=True))
        env.update(zip(wres_vars, wres, strict=True))
        eval_eqns(w_eqns, env)
        return jax.tree.unflatten(p_tree, [read(env, v) for v in dp_out])

    # Each weight gradient's own W equations and what they read, in the order W makes
    # them (for ``weight_into``); an equation two gradients share runs in both.
    made_at = {v: i for i in w_idx for v in eqns[i].outvars}
    w_steps = []
    for j in sorted(range(n_p), key=lambda j: made_at.get(dp_out[j], -1)):
        need, reads = _slice(eqns, set(w_idx), [dp_out[j]])
        w_steps.append((j, [eqns[i] for i in need], sorted(reads, key=str)))

    def weight_into(g, p, x, dy, res, wres, go=True):
        """``g + weight(p, x, dy, res, wres)``, one gradient at a time: each is made and
        added to ``g`` inside its own ``lax.cond`` on ``go`` (pass a traced ``True``), so
        XLA keeps one weight-gradient temporary live at a time instead of all of them."""
        base = env_of(p, x, dy)
        base.update(zip(res_vars, res, strict=True))
        base.update(zip(wres_vars, wres, strict=True))
        g = list(jax.tree.leaves(g))
        for j, step, reads in w_steps:

            def add(g, vals, j=j, step=step, reads=reads):
                env = dict(zip(reads, vals, strict=True))
                eval_eqns(step, env)
                g = list(g)
                g[j] = g[j] + read(env, dp_out[j])
                return g

            g = jax.lax.cond(go, add, lambda g, _: list(g), g, [base[v] for v in reads])
        return jax.tree.unflatten(p_tree, g)

    def structs(variables):
        return tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in variables)

    return StagePieces(
        forward, backward, weight if split_backward else None,
        weight_into if split_backward else None, structs(res_vars), structs(wres_vars),
        {k: tuple(e.primitive.name for e in v) for k, v in
         (("F", f_eqns), ("B", b_eqns), ("W", w_eqns))},
    )  # fmt: skip
