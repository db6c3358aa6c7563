"""Synchronised BatchNorm: torch's ``SyncBatchNorm`` through Flax's ``axis_name``.

Flax's ``nnx.BatchNorm`` (and Linen's ``nn.BatchNorm``) already know how to average their
batch statistics over a named mesh axis: given ``axis_name``, they ``pmean`` the batch
mean and mean of squares over it. DDP's train step runs per rank under ``shard_map`` with
the group's axis bound, so pointing every BatchNorm at that axis makes the statistics
those of the whole global batch, exactly torch's ``SyncBatchNorm`` (equal per-rank batch
sizes; like torch, the variance is the biased whole-batch variance).

:func:`convert_sync_batchnorm` is torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``:
call it on the module *before* wrapping it in :class:`~jaxpg.ddp.DistributedDataParallel`
(the axis name is part of the module's static graph). For Linen, construct
``nn.BatchNorm(axis_name=sync_batchnorm_axis(group))`` yourself.

A module converted this way can only run where that axis is bound (inside DDP's step, or
in ``eval`` mode with ``use_running_average=True``, which never reads the axis).
"""

from __future__ import annotations

from typing import Any

__all__ = ["convert_sync_batchnorm", "sync_batchnorm_axis"]


def sync_batchnorm_axis(group: Any = None) -> str:
    """The axis name a BatchNorm must average over to be synchronised over ``group``."""
    from jaxpg.groups import world

    return world._resolve_group(group, "sync_batchnorm_axis").axis_name


def convert_sync_batchnorm(module: Any, group: Any = None) -> Any:
    """Makes every ``nnx.BatchNorm`` in ``module`` synchronise its statistics over ``group``.

    Args:
        module: an ``nnx.Module``; it is changed in place and returned.
        group: the DDP process group (the world for None).

    Returns:
        ``module``.

    Raises:
        TypeError: if ``module`` is not an ``nnx.Module``.

    Example:
        >>> model = jaxpg.ddp.convert_sync_batchnorm(MyCNN(rngs=nnx.Rngs(0)))
        >>> ddp = jaxpg.ddp.DistributedDataParallel(model, optax.sgd(0.1))
    """
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"convert_sync_batchnorm: module must be an nnx.Module, got {type(module).__name__}; "
            "for Linen pass axis_name=sync_batchnorm_axis(group) to nn.BatchNorm."
        )
    axis = sync_batchnorm_axis(group)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = axis
    return module
