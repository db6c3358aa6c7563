"""Expert parallelism: mixture-of-experts layers whose experts are split over an ``ep`` axis,
with tokens dispatched by ``all_to_all`` (see docs/expert_parallel.md)."""

from jaxpg.expert_parallel.layer import MoELayer, expert_init
from jaxpg.expert_parallel.moe import MoEAux, expert_capacity, moe
from jaxpg.expert_parallel.router import Routing, route

__all__ = ["moe", "MoEAux", "expert_capacity", "route", "Routing",
           "MoELayer", "expert_init"]
