"""A layout: the six parallel degrees with microbatches, schedule, recomputation and ZeRO.

A :class:`Layout` is data, as a timetable is: it can be parsed from text
(``"tp=8,pp=16,dp_shard=64,remat=full"``), printed, and turned into the
:class:`jaxpg.ParallelDims` that builds its mesh (:meth:`Layout.parallel_dims`, which needs no
live world: it passes ``world_size``).

Example:
    >>> lay = Layout.parse("tp=4,dp_shard=2,remat=selective")
    >>> lay.devices, lay.zero, lay.parallel_dims_kwargs()["world_size"]
    (8, 1, 8)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["DEGREES", "REMAT_POLICIES", "SCHEDULES", "Layout"]

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
REMAT_POLICIES = ("none", "selective", "full")
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")
_ALIASES = {"dp": "dp_replicate", "fsdp": "dp_shard", "mp": "tp", "sep": "cp",
            "sharding": "dp_shard", "m": "microbatches", "v": "chunks", "zero_stage": "zero",
            "recompute": "remat"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a job on its devices.

    Args:
        dp_replicate: replicated data parallelism (DDP, HSDP's replicas).
        dp_shard: sharded data parallelism (ZeRO / FSDP over ``dp_shard x cp``).
        cp: context parallelism (the sequence split over ranks, ring attention).
        tp: tensor parallelism (Megatron's column/row split of every block).
        pp: pipeline stages.
        ep: expert parallelism (borrows its ranks from ``dp_shard x cp``).
        microbatches: microbatches per step on each data-parallel replica (the pipeline's
            ``m``; gradient accumulation steps when ``pp == 1``).
        schedule: the pipeline schedule (``"none"`` when ``pp == 1``).
        chunks: model chunks per pipeline rank (``interleaved_1f1b``'s ``v``).
        remat: activation recomputation: ``"none"``, ``"selective"`` (attention's core, as
            Korthikanti et al. 2022) or ``"full"`` (each block from its input).
        zero: ZeRO stage over ``dp_shard x cp``: 0 (replicated), 1 (optimizer state),
            2 (and gradients), 3 (and parameters: FSDP). None: 0 when ``dp_shard x cp == 1``,
            else 1.
        sp: sequence parallelism within tp (norms and dropout split over tp).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    microbatches: int = 1
    schedule: str | None = None
    chunks: int | None = None
    remat: str = "none"
    zero: int | None = None
    sp: bool | None = None

    def __post_init__(self) -> None:
        for name in (*DEGREES, "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout: {name}={value!r} must be an int >= 1.")
        if self.schedule is None:
            object.__setattr__(self, "schedule", "1f1b" if self.pp > 1 else "none")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout: schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if self.pp == 1 and self.schedule != "none":
            object.__setattr__(self, "schedule", "none")
        if self.pp > 1 and self.schedule == "none":
            raise ValueError(f"Layout: pp={self.pp} needs a schedule; choose one of "
                             f"{SCHEDULES[1:]}.")
        if self.chunks is None:
            chunks = {"interleaved_1f1b": 2, "zb_v": 2}.get(self.schedule, 1)
            object.__setattr__(self, "chunks", chunks)
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Layout: remat={self.remat!r} must be one of {REMAT_POLICIES}.")
        if self.zero is None:
            object.__setattr__(self, "zero", 1 if self.dp_shard * self.cp > 1 else 0)
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout: zero={self.zero!r} must be 0, 1, 2 or 3.")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)

    # -- derived ------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        """``dp_replicate x dp_shard x cp x tp x pp`` (ep borrows its ranks)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the batch: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def zero_group(self) -> int:
        """The ranks ZeRO shards over: ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``)."""
        return self.dp_shard * self.cp if self.zero else 1

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    def parallel_dims_kwargs(self) -> dict[str, int]:
        """The keyword arguments of :class:`jaxpg.ParallelDims` for this layout."""
        return {**self.degrees(), "world_size": self.devices}

    def parallel_dims(self, **kwargs: Any):
        """This layout's :class:`jaxpg.ParallelDims` (``world_size`` given: no world needed).

        ``kwargs`` go to ``ParallelDims`` (``axis_names=PADDLE_AXIS_NAMES``, say).
        """
        from jaxpg.groups.parallel_dims import ParallelDims

        return ParallelDims(**{**self.parallel_dims_kwargs(), **kwargs})

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in self.degrees().items() if v > 1] or ["dp_replicate=1"]
        parts.append(f"microbatches={self.microbatches}")
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
            if self.chunks > 1:
                parts.append(f"chunks={self.chunks}")
        parts += [f"remat={self.remat}", f"zero={self.zero}"]
        if self.tp > 1 and not self.sp:
            parts.append("sp=0")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> Layout:
        """A layout from ``"key=value,..."`` (keys: the fields, or ``dp``, ``fsdp``, ``mp``,
        ``m``, ``v``). ``defaults`` fill what the text leaves out."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = dict(defaults)
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, raw = item.partition("=")
            key = _ALIASES.get(key.strip(), key.strip())
            if not sep or key not in fields:
                raise ValueError(
                    f"Layout: cannot read {item!r} in {text!r}; write key=value pairs with keys "
                    f"from {sorted(fields)} (e.g. 'tp=8,pp=16,dp_shard=64,remat=full').")
            raw = raw.strip()
            if key in ("schedule", "remat"):
                values[key] = raw
            elif key == "sp":
                values[key] = raw.lower() in ("1", "true", "on", "yes")
            else:
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise ValueError(f"Layout: {key}={raw!r} must be an integer.") from None
        return cls(**values)

    def with_devices(self, devices: int) -> Layout:
        """Fills ``dp_shard`` so that the layout uses ``devices`` (``dp_shard=-1``-style)."""
        others = self.devices // self.dp_shard
        if devices % others:
            raise ValueError(
                f"Layout: {others} ranks per data-parallel shard (dp_replicate x cp x tp x pp) "
                f"do not divide devices={devices}.")
        return self.replace(dp_shard=devices // others)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
