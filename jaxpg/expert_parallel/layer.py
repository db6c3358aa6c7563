"""Paddle's ``MoELayer`` in Flax NNX: a router and this rank's experts, split over ``ep``.

The experts' weights are global arrays of the full shape ``(E, d, f)`` and ``(E, f, d)``,
laid out on the group's mesh with the expert dimension split over the ep axis (and
replicated over every other axis), as the tensor-parallel layers hold theirs: each rank
holds exactly its experts, and a layer built with ``rngs=nnx.Rngs(s)`` holds the slice of
the unsharded layer (ep = 1) built with the same seed. The router ``gate_weight`` ``(d, E)``
is replicated.

The layer runs in SPMD code (``jaxpg.spmd(mesh=...)`` or ``jax.shard_map`` over the mesh,
with ``in_specs`` from ``jaxpg.tensor_parallel.param_specs``), where it sees its local
experts, and takes any leading token dimensions: ``(..., d) -> (..., d)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init
from jax.sharding import PartitionSpec as P

from jaxpg.expert_parallel.checks import check_buffer_factor
from jaxpg.expert_parallel.grouped_matmul import check_grouped_matmul
from jaxpg.expert_parallel.moe import MoEAux, moe
from jaxpg.groups.mesh_axis import resolve_mesh_axis
from jaxpg.tensor_parallel.mp_layers import make_param

__all__ = ["MoELayer", "expert_init"]

#: The experts' default initializer: LeCun normal per expert (fan-in ``d`` or ``f``).
expert_init = jax.nn.initializers.lecun_normal(batch_axis=(0,))


class MoELayer(nnx.Module):
    """A mixture-of-experts MLP: ``E`` experts ``activation(x @ w1[e]) @ w2[e]`` and a router.

    Args:
        d_model: the model width ``d``.
        d_hidden: each expert's hidden width ``f``.
        num_experts: ``E``; the group's size must divide it.
        top_k, capacity_factor, normalize_topk, activation, grouped_matmul, buffer_factor:
            as :func:`~jaxpg.expert_parallel.moe`.
        replicated_tokens: as :func:`~jaxpg.expert_parallel.moe`: the layer sits in a
            tensor-parallel region, e.g. a stage of a tensor-parallel pipeline whose model
            axis is the group.
        group: the expert-parallel group (``mesh.get_group("ep")``, ``mesh["ep"]``, a
            ProcessGroup; None: the world).
        rngs: ``nnx.Rngs``; the router, then ``w1``, then ``w2`` draw from ``rngs.params()``.
        gate_init, w1_init, w2_init: initializers ``init(key, shape, dtype)``, or full arrays.
        param_dtype: the parameters' dtype.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = None, normalize_topk: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 group: Any = None, rngs: nnx.Rngs | None = None, gate_init: Any = None,
                 w1_init: Any = None, w2_init: Any = None, param_dtype: Any = jnp.float32,
                 grouped_matmul: str = "auto", replicated_tokens: bool = False,
                 buffer_factor: float | None = 1.25):
        api = "MoELayer"
        self.buffer_factor = check_buffer_factor(buffer_factor, api)
        self.grouped_matmul = check_grouped_matmul(grouped_matmul, api)
        if not isinstance(replicated_tokens, bool):
            raise TypeError(f"{api}: replicated_tokens must be a bool; got "
                            f"{replicated_tokens!r}.")
        self.replicated_tokens = replicated_tokens
        self.ep = resolve_mesh_axis(group, "ep", api=api)
        if num_experts % self.ep.size:
            raise ValueError(f"{api}: num_experts={num_experts} must be divisible by the "
                             f"expert-parallel degree ep={self.ep.size}.")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"{api}: top_k={top_k!r} must be an int between 1 and "
                             f"num_experts={num_experts}.")
        self.d_model, self.d_hidden, self.num_experts = d_model, d_hidden, num_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.normalize_topk, self.activation = normalize_topk, activation
        mesh = self.ep
        experts = P(self.ep.axis, None, None)
        self.gate_weight = make_param(gate_init or default_kernel_init, default_kernel_init,
                                      rngs, (d_model, num_experts), param_dtype, mesh, P(), api,
                                      "gate_weight")
        self.w1 = make_param(w1_init or expert_init, expert_init, rngs,
                             (num_experts, d_model, d_hidden), param_dtype, mesh, experts, api,
                             "w1")
        self.w2 = make_param(w2_init or expert_init, expert_init, rngs,
                             (num_experts, d_hidden, d_model), param_dtype, mesh, experts, api,
                             "w2")

    @property
    def num_local_experts(self) -> int:
        """``E_local``: the experts each rank holds."""
        return self.num_experts // self.ep.size

    def __call__(self, x: jax.Array, *, return_aux: bool = False
                 ) -> jax.Array | tuple[jax.Array, MoEAux]:
        """``(..., d) -> (..., d)``; with ``return_aux``, also the :class:`MoEAux`."""
        lead = x.shape[:-1]
        y, aux = moe(x.reshape(-1, x.shape[-1]), self.gate_weight[...], self.w1[...],
                     self.w2[...], group=self.ep, top_k=self.top_k,
                     capacity_factor=self.capacity_factor, activation=self.activation,
                     normalize_topk=self.normalize_topk, grouped_matmul=self.grouped_matmul,
                     replicated_tokens=self.replicated_tokens,
                     buffer_factor=self.buffer_factor)
        y = y.reshape(*lead, y.shape[-1])
        return (y, aux) if return_aux else y
