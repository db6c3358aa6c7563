"""A job: the model, the devices, the hardware, the batch and the precision.

Everything the planner holds fixed while it varies the :class:`~jaxpg.plan.Layout`.

By default the precision is what the published runs use: bf16 compute over fp32 master
weights, gradients reduced in fp32, fp32 Adam state (two moments).

Example:
    >>> from jaxpg.plan.presets import get_model
    >>> job = Job(model=get_model("llama3-8b"), devices=64, hardware="h100-80gb",
    ...           seq_len=8192, global_batch=128)
    >>> job.tokens_per_step
    2097152
"""

from __future__ import annotations

import dataclasses

from jaxpg.plan.hardware import Hardware, get_hardware
from jaxpg.plan.spec import TransformerSpec

__all__ = ["DTYPE_BYTES", "Job"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def _dtype(name: str, field: str) -> str:
    name = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16",
            "float": "fp32"}.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"Job: {field}={name!r} must be one of {sorted(DTYPE_BYTES)}.")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """What is trained, on what, with which batch.

    Args:
        model: the transformer.
        devices: the number of devices.
        hardware: a :class:`Hardware`, a preset name or a TOML file.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step (over all data-parallel replicas).
        devices_per_node: devices per node; None for the hardware's.
        dtype: the compute dtype (activations, matmuls, communicated activations).
        param_dtype: the master weights' dtype (fp32: a bf16 working copy is kept too).
        grad_dtype: the dtype gradients are reduced and accumulated in; None for
            ``param_dtype``.
        optimizer_states: state tensors per parameter (2 for Adam, 1 for momentum SGD).
        overlap_grad_reduce: whether the data-parallel gradient reduction overlaps the last
            backward (bucketed, as DDP does).
    """

    model: TransformerSpec
    devices: int
    hardware: Hardware | str
    seq_len: int
    global_batch: int
    devices_per_node: int | None = None
    dtype: str = "bf16"
    param_dtype: str = "fp32"
    grad_dtype: str | None = None
    optimizer_states: int = 2
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, TransformerSpec):
            raise TypeError(f"Job: model must be a TransformerSpec, got "
                            f"{type(self.model).__name__}; see jaxpg.plan.get_model.")
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        for field in ("devices", "seq_len", "global_batch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Job: {field}={value!r} must be an int >= 1.")
        if self.devices_per_node is None:
            object.__setattr__(self, "devices_per_node",
                               min(self.hardware.devices_per_node, self.devices))
        if self.devices_per_node < 1:
            raise ValueError(f"Job: devices_per_node={self.devices_per_node!r} must be >= 1.")
        object.__setattr__(self, "dtype", _dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "grad_dtype",
                           _dtype(self.grad_dtype or self.param_dtype, "grad_dtype"))
        if self.optimizer_states < 0:
            raise ValueError(f"Job: optimizer_states={self.optimizer_states!r} must be >= 0.")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (the compute dtype)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def peak_flops(self) -> float:
        return self.hardware.peak_flops(self.dtype)

    def replace(self, **changes) -> Job:
        return dataclasses.replace(self, **changes)
