"""Alpha-beta costs of collectives, and which link level each mesh axis crosses.

A collective over ``n`` ranks moving ``nbytes`` (the full buffer) costs, on a link of latency
``alpha`` and bandwidth ``beta`` (bytes/s per device, one direction, times the hardware's
``collective_efficiency``), as a ring does:

=================  ===================================================
all-reduce         ``2 (n - 1) alpha + 2 (n - 1) / n * nbytes / beta``
all-gather         ``(n - 1) alpha + (n - 1) / n * nbytes / beta``
reduce-scatter     the same as all-gather
all-to-all         the same as all-gather
send (p2p)         ``alpha + nbytes / beta``
=================  ===================================================

A mesh axis's ranks are spaced by the product of the axes inside it, in ParallelDims' order
``(dp_replicate, pp, dp_shard, cp, tp)``, tp innermost. A group whose ranks all fall in one
node uses the node's link (NVLink, ICI); any other uses the link between nodes.
"""

from __future__ import annotations

from jaxpg.plan.hardware import Hardware, Link
from jaxpg.plan.layout import Layout

__all__ = ["axis_link", "collective_time", "span"]

_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def collective_time(kind: str, nbytes: float, n: int, link: Link, efficiency: float) -> float:
    """Seconds for one collective of ``nbytes`` over ``n`` ranks on ``link``."""
    if kind not in _KINDS:
        raise ValueError(f"collective_time: kind={kind!r} must be one of {_KINDS}.")
    if n <= 1 or nbytes <= 0:
        return 0.0
    beta = link.bandwidth * efficiency
    if kind == "send":
        return link.latency + nbytes / beta
    if kind == "all_reduce":
        return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / beta
    return (n - 1) * link.latency + (n - 1) / n * nbytes / beta


def span(layout: Layout, axes: tuple[str, ...]) -> int:
    """How many consecutive ranks a group over ``axes`` reaches across (its extent)."""
    order = ("tp", "cp", "dp_shard", "pp", "dp_replicate")
    stride, extent = 1, 1
    for name in order:
        size = getattr(layout, name)
        if name in axes and size > 1:
            extent = stride * size
        stride *= size
    return extent


def axis_link(layout: Layout, axes: tuple[str, ...], hardware: Hardware,
              devices_per_node: int) -> Link:
    """The link a group over ``axes`` crosses: the node's when it fits in one node."""
    return hardware.intra if span(layout, axes) <= devices_per_node else hardware.inter
