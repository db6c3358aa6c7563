"""Softmax cross-entropy over logits split on the vocabulary (Paddle's ParallelCrossEntropy).

In SPMD code each rank holds ``[..., V/tp]`` of the logits; the loss needs three reductions
over the group, all of scalars per token: the maximum (for stability), the sum of
exponentials and the target logit (held by one rank). The backward needs none:
``softmax - onehot`` of the local slice, as Megatron's ``vocab_parallel_cross_entropy``.
Tokens whose label is ``ignore_index`` get a zero loss and a zero gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.tensor_parallel.placements import Replicate, Shard
from jaxpg.tensor_parallel.redistribute import to_global

__all__ = ["ParallelCrossEntropy", "vocab_parallel_cross_entropy"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _parallel_ce(logits, labels, axis, ignore_index):
    return _ce_fwd(logits, labels, axis, ignore_index)[0]


def _ce_fwd(logits, labels, axis, ignore_index):
    part = logits.shape[-1]
    x = logits  # float32: the caller casts (and autodiff casts the gradient back)
    peak = lax.pmax(jnp.max(lax.stop_gradient(x), axis=-1), axis)
    shifted = x - peak[..., None]
    exp = jnp.exp(shifted)
    total = lax.psum(jnp.sum(exp, axis=-1), axis)
    start = lax.axis_index(axis) * part
    mine = (labels >= start) & (labels < start + part)
    local = jnp.where(mine, labels - start, 0)
    target = jnp.take_along_axis(shifted, local[..., None], axis=-1)[..., 0]
    target = lax.psum(jnp.where(mine, target, 0.0), axis)
    keep = labels != ignore_index
    loss = jnp.where(keep, jnp.log(total) - target, 0.0)
    softmax = exp / total[..., None]
    return loss, (softmax, local, mine, keep)


def _ce_bwd(axis, ignore_index, res, g):
    softmax, local, mine, keep = res
    onehot = jax.nn.one_hot(local, softmax.shape[-1], dtype=softmax.dtype) * mine[..., None]
    grad = (softmax - onehot) * jnp.where(keep, g, 0.0)[..., None]
    return grad, np.zeros(local.shape, jax.dtypes.float0)


_parallel_ce.defvjp(_ce_fwd, _ce_bwd)


def vocab_parallel_cross_entropy(logits: Any, labels: Any, tp: MeshAxis, *,
                                 ignore_index: int = -100) -> jax.Array:
    """Per-token softmax cross-entropy of logits split on their last (vocabulary) dimension.

    Args:
        logits: ``[..., V]`` (host code, a global array or this process's local data) or
            this rank's ``[..., V/tp]`` (SPMD code).
        labels: integer ``[...]``, the same on every rank.
        tp: the tensor-parallel mesh.
        ignore_index: a label whose tokens contribute zero loss and zero gradient.

    Returns:
        The loss per token, ``[...]``, float32 (zero where the label is ``ignore_index``).
    """
    api = "ParallelCrossEntropy"
    labels_dtype = jnp.result_type(labels)
    if not jnp.issubdtype(labels_dtype, jnp.integer):
        raise ValueError(f"{api}: labels must be integers; got dtype {labels_dtype}.")
    if tuple(jnp.shape(labels)) != tuple(jnp.shape(logits))[:-1]:
        raise ValueError(f"{api}: labels of shape {tuple(jnp.shape(labels))} do not match logits "
                         f"of shape {tuple(jnp.shape(logits))}; labels must be logits.shape[:-1].")
    if tp.in_spmd(api):
        return _parallel_ce(logits.astype(jnp.float32), labels, tp.axis, ignore_index)
    logits = to_global(logits, Shard(-1), tp)
    labels = to_global(labels, Replicate(), tp)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    keep = labels != ignore_index
    picked = jnp.take_along_axis(logp, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(keep, -picked, 0.0)


class ParallelCrossEntropy(nnx.Module):
    """Paddle's ``ParallelCrossEntropy``: cross-entropy over vocabulary-parallel logits.

    Args:
        mp_group: the tensor-parallel group (a ProcessGroup, 1-D DeviceMesh or
            HybridCommunicateGroup); default: the latest HybridCommunicateGroup's
            model-parallel group.
        name: a name for the layer (kept, as Paddle's).
        ignore_index: tokens with this label get zero loss and gradient (Paddle's -100).

    Call it as ``loss = ce(logits, label)`` with ``logits`` split on the vocabulary (the
    output of a ``ColumnParallelLinear(..., gather_output=False)``) and ``label`` of shape
    ``logits.shape[:-1]`` or ``logits.shape[:-1] + (1,)``. As Paddle, it returns the loss
    per token with a trailing dimension of 1, ``logits.shape[:-1] + (1,)``.

    Example:
        >>> ce = ParallelCrossEntropy(mp_group=mesh["tp"])
        >>> loss = ce(logits, labels).mean()
    """

    def __init__(self, mp_group: Any = None, name: str | None = None, ignore_index: int = -100):
        self.tp = resolve_mesh_axis(mp_group, "tp", api="ParallelCrossEntropy")
        self.name = name
        self.ignore_index = int(ignore_index)

    @property
    def world_size(self) -> int:
        return self.tp.size

    def __call__(self, input: Any, label: Any) -> jax.Array:  # noqa: A002 (Paddle's name)
        shape = tuple(jnp.shape(input))
        if tuple(jnp.shape(label)) == shape[:-1] + (1,):
            label = jnp.reshape(label, shape[:-1])
        loss = vocab_parallel_cross_entropy(input, label, self.tp, ignore_index=self.ignore_index)
        return loss[..., None]
