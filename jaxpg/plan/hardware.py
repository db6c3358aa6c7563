"""Hardware profiles: peak FLOP/s, HBM, and the links within and across nodes.

A :class:`Hardware` is what the time and memory models read: peak dense FLOP/s per dtype,
HBM bytes and bandwidth, and two link levels (within a node: NVLink or ICI; across nodes:
InfiniBand or DCN), each a bandwidth per device and a latency. Two efficiency factors say how
much of the peaks real programs reach: ``matmul_efficiency`` (large matmuls against peak
FLOP/s) and ``collective_efficiency`` (a ring collective's bus bandwidth against the link's).
The presets use typical figures for the parts (vendors' peaks; matmuls at about 3/4 of peak,
collectives at about 3/4 of the link); ``--calibrate`` measures both for a ``local`` profile.

A TOML file gives the same fields::

    name = "my-gpu"
    hbm_bytes = 80e9
    hbm_bandwidth = 2.0e12
    devices_per_node = 8
    [flops]
    bf16 = 312e12
    fp32 = 19.5e12
    [intra]
    bandwidth = 300e9
    latency = 5e-6
    [inter]
    bandwidth = 25e9
    latency = 1e-5

and, optionally, the :class:`Hardware` fields with defaults (``matmul_efficiency``,
``overlap``, ``op_overhead``, ``per_tensor_collectives``, ``fused_expert_mlp``, ...) at the
top level.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from collections.abc import Mapping

__all__ = ["HARDWARE", "Hardware", "Link", "available_hardware", "get_hardware",
           "load_hardware", "save_hardware"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One link level: bandwidth per device, one direction (bytes/s), and latency (s)."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"Link: bandwidth={self.bandwidth!r} must be > 0 and "
                             f"latency={self.latency!r} >= 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device kind and its links.

    Args:
        name: a label.
        flops: peak dense FLOP/s per dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``).
        hbm_bytes: device memory in bytes.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        intra: the link between devices of one node.
        inter: the link between nodes (per device).
        devices_per_node: devices that share the ``intra`` link.
        matmul_efficiency: the fraction of peak FLOP/s large matmuls reach.
        collective_efficiency: the fraction of a link's bandwidth a ring collective reaches.
        memory_fraction: the fraction of ``hbm_bytes`` a program may use (the runtime, its
            allocator's fragmentation and the compiler's buffers take the rest).
        matmul_half_width: the matmul width (its smallest per-device dimension) at which
            throughput is half of large matmuls': a matmul of width ``w`` runs at
            ``w / (w + matmul_half_width)`` of ``matmul_efficiency``. 0 (the presets): no
            penalty; ``calibrate()`` measures it.
        overlap: whether communication runs alongside compute (GPU streams, TPU async
            collectives). XLA:CPU runs one operation at a time, so a ``local`` CPU profile
            has False: every collective is exposed.
        op_overhead: seconds each operation (kernel) of a program costs beyond its work
            (its dispatch and launch). 0 (the presets): not modelled; ``calibrate()``
            measures it.
        per_tensor_collectives: whether the compiler leaves FSDP/ZeRO's collectives one
            per parameter tensor (XLA:CPU), each paying the link's latency, rather than
            merging them into one per FSDP unit (XLA's GPU and TPU combiners, as torch's
            ``fully_shard`` issues them). False on the presets; ``calibrate()`` reads it
            from a compiled program (:func:`jaxpg.plan.calibrate.collectives_per_tensor`).
        fused_expert_mlp: whether an MoE's experts run their MLP as one tiled loop over
            the routed rows (jaxpg's ``"tiled"`` grouped matmul, its choice on CPU), so
            that the activation skips the dispatch buffer's unused rows, rather than as
            two grouped matmuls with the activation over the whole buffer between them
            (the Mosaic kernels and ``ragged_dot`` on GPU and TPU). False on the presets;
            ``calibrate()`` reads jaxpg's choice for its devices.
    """

    name: str
    flops: Mapping[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    intra: Link
    inter: Link
    devices_per_node: int
    matmul_efficiency: float = 0.75
    collective_efficiency: float = 0.75
    memory_fraction: float = 0.9
    matmul_half_width: float = 0.0
    overlap: bool = True
    op_overhead: float = 0.0
    per_tensor_collectives: bool = False
    fused_expert_mlp: bool = False

    def __post_init__(self) -> None:
        if not self.flops or any(not v > 0 for v in self.flops.values()):
            raise ValueError(f"Hardware {self.name!r}: flops={dict(self.flops)!r} needs a "
                             "positive peak for at least one dtype.")
        for field in ("hbm_bytes", "hbm_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware {self.name!r}: {field} must be > 0.")
        if isinstance(self.devices_per_node, bool) or self.devices_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: devices_per_node="
                             f"{self.devices_per_node!r} must be an int >= 1.")
        for field in ("matmul_efficiency", "collective_efficiency", "memory_fraction"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Hardware {self.name!r}: {field}={getattr(self, field)!r} "
                                 "must be in (0, 1].")
        if not self.op_overhead >= 0:
            raise ValueError(f"Hardware {self.name!r}: op_overhead={self.op_overhead!r} "
                             "must be >= 0 seconds.")

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (``bf16`` and ``fp16`` stand in for each other)."""
        for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype), "fp32"):
            if name in self.flops:
                return float(self.flops[name])
        return float(max(self.flops.values()))

    def matmul_rate(self, dtype: str, width: float) -> float:
        """FLOP/s of a matmul whose smallest per-device dimension is ``width``."""
        shape = width / (width + self.matmul_half_width) if self.matmul_half_width else 1.0
        return self.peak_flops(dtype) * self.matmul_efficiency * shape

    @property
    def usable_bytes(self) -> float:
        """The memory budget of one device: ``hbm_bytes x memory_fraction``."""
        return self.hbm_bytes * self.memory_fraction

    def replace(self, **changes) -> Hardware:
        """A copy with ``changes`` (``devices_per_node=4``, say)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The profile as the TOML file's fields."""
        out = dataclasses.asdict(self)
        out["flops"] = dict(self.flops)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> Hardware:
        """The profile :meth:`to_dict` wrote (a stored result's ``calibrated``, say)."""
        return _from_dict(data, str(data.get("name", "a profile")))


_NVLINK_A100 = Link(bandwidth=300e9, latency=5e-6)
_NVLINK_H100 = Link(bandwidth=450e9, latency=4e-6)
_HDR = Link(bandwidth=25e9, latency=1e-5)   # 200 Gb/s per GPU
_NDR = Link(bandwidth=50e9, latency=1e-5)   # 400 Gb/s per GPU

HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="a100-80gb", flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
             hbm_bytes=80 * 2**30, hbm_bandwidth=2.039e12, intra=_NVLINK_A100, inter=_HDR,
             devices_per_node=8),
    Hardware(name="h100-80gb", flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
             hbm_bytes=80 * 2**30, hbm_bandwidth=3.35e12, intra=_NVLINK_H100, inter=_NDR,
             devices_per_node=8),
    Hardware(name="h200", flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
             hbm_bytes=141e9, hbm_bandwidth=4.8e12, intra=_NVLINK_H100, inter=_NDR,
             devices_per_node=8),
    # a v5p slice's chips share the ICI torus (the "node"); DCN joins slices
    Hardware(name="tpu-v5p", flops={"bf16": 459e12, "fp32": 459e12 / 4},
             hbm_bytes=95 * 2**30, hbm_bandwidth=2.765e12,
             intra=Link(bandwidth=180e9, latency=5e-6), inter=Link(bandwidth=6.25e9,
                                                                  latency=2e-5),
             devices_per_node=8960),
)}
"""The presets, by name."""


def available_hardware() -> tuple[str, ...]:
    """The preset names :func:`get_hardware` knows."""
    return tuple(HARDWARE)


def _from_dict(data: Mapping, where: str) -> Hardware:
    try:
        fields = dict(data)
        fields["intra"] = Link(**fields["intra"])
        fields["inter"] = Link(**fields["inter"])
        fields["flops"] = {k: float(v) for k, v in fields["flops"].items()}
        for key in ("hbm_bytes", "hbm_bandwidth", "matmul_efficiency",
                    "collective_efficiency", "memory_fraction", "matmul_half_width",
                    "op_overhead"):
            if key in fields:
                fields[key] = float(fields[key])
        fields.setdefault("name", pathlib.Path(where).stem)
        for key in ("overlap", "per_tensor_collectives"):
            if key in fields:
                fields[key] = bool(fields[key])
        return Hardware(**fields)
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"Hardware file {where}: {error}; it needs name, flops (a table of dtype = "
            "FLOP/s), hbm_bytes, hbm_bandwidth, devices_per_node, and [intra] and [inter] "
            "tables of bandwidth and latency.") from None


def load_hardware(path: str | pathlib.Path) -> Hardware:
    """Reads a hardware profile from a TOML file (the module docstring shows the fields)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"Hardware file {str(path)!r} does not exist.")
    return _from_dict(tomllib.loads(path.read_text()), str(path))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def save_hardware(hardware: Hardware, path: str | pathlib.Path) -> pathlib.Path:
    """Writes ``hardware`` as a TOML file :func:`load_hardware` reads back."""
    data = hardware.to_dict()
    tables = {k: data.pop(k) for k in ("flops", "intra", "inter")}
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items()]
    for table, values in tables.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def get_hardware(name_or_path: str | Hardware) -> Hardware:
    """A preset by name, or a profile read from a TOML file path."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    if str(name_or_path).endswith(".toml") or pathlib.Path(name_or_path).is_file():
        return load_hardware(name_or_path)
    raise ValueError(f"Unknown hardware {name_or_path!r}; choose one of "
                     f"{available_hardware()}, 'local' (after --calibrate), or a TOML file.")
