"""torch's PrepareModuleInput, PrepareModuleOutput and PrepareModuleInputOutput.

They leave a module's parameters alone and move its inputs (outputs) from the placement
they have (``input_layouts``) to the one the module wants (``desired_input_layouts``), e.g.
``Shard(1)`` to ``Replicate()`` in front of an attention block under sequence parallelism:
an all-gather. ``None`` in a layout tuple leaves that argument alone (a mask, say).

Inside SPMD code, an input prepared as ``Replicate`` is registered while the module runs
(:mod:`~jaxpg.tensor_parallel.shared_inputs`), so that the ColwiseParallel layers that
consume it (``wq``, ``wk``, ``wv``) share one gradient reduction: one all-reduce, or with
sequence parallelism one reduce-scatter, as in torch and Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

from jaxpg.groups.mesh_axis import MeshAxis
from jaxpg.tensor_parallel import mappings as ops
from jaxpg.tensor_parallel.placements import Placement, check_placement
from jaxpg.tensor_parallel.redistribute import redistribute_local, to_global, to_local
from jaxpg.tensor_parallel.shared_inputs import sharing
from jaxpg.tensor_parallel.styles import ParallelStyle

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]


def _layouts(value: Any, name: str, api: str) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return tuple(None if v is None else check_placement(v, name, api) for v in items)


def _kw_layouts(value: Any, name: str, api: str) -> dict[str, Placement]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{api}: {name} must be a dict of keyword argument names to placements; "
                        f"got {type(value).__name__}.")
    return {k: check_placement(v, f"{name}[{k!r}]", api) for k, v in value.items()}


def _pair(src: tuple | None, dst: tuple | None, names: tuple[str, str], api: str) -> list:
    if src is None and dst is None:
        return []
    if src is None or dst is None or len(src) != len(dst):
        raise ValueError(
            f"{api}: {names[0]}={src} and {names[1]}={dst} must both be given, with one entry "
            "per argument (None for an argument to leave alone)."
        )
    for i, (a, b) in enumerate(zip(src, dst)):
        if (a is None) != (b is None):
            raise ValueError(f"{api}: argument {i} has {names[0]} {a} but {names[1]} {b}; give "
                             "both or neither.")
    return list(zip(src, dst))


class _Moves:
    """Moves values between placements, in SPMD or host code (one call's worth)."""

    def __init__(self, tp: MeshAxis, api: str, use_local: bool):
        self.tp, self.spmd, self.use_local = tp, tp.in_spmd(api), use_local
        self.shared: list[tuple[Any, Any]] = []

    def move(self, x: Any, src: Placement | None, dst: Placement | None,
             share: bool = False) -> Any:
        if src is None:
            return x
        if not self.spmd:
            out = to_global(to_global(x, src, self.tp), dst, self.tp)
            return to_local(out, self.tp) if self.use_local else out
        axis = self.tp.axis
        if share and dst.is_replicate() and src.is_shard():
            full, twin = ops.gather_with_partial_twin(x, axis, src.dim)
            self.shared.append((full, twin))
            return full
        out = redistribute_local(x, src, dst, axis)
        if share and dst.is_replicate() and src.is_replicate():
            self.shared.append((out, ops.copy_to_tensor_parallel_region(out, axis)))
        return out


class PrepareModuleInput(ParallelStyle):
    """Moves a module's inputs to the placements it wants before it runs.

    Args:
        input_layouts: the placement of each positional input (a placement or a tuple;
            None entries are left alone).
        desired_input_layouts: the placement the module wants for each.
        input_kwarg_layouts: ``{name: placement}`` for keyword inputs.
        desired_input_kwarg_layouts: ``{name: placement}`` wanted.
        use_local_output: in host code, hand the module this process's local data (True) or
            global arrays (False, torch's default).
    """

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None,
                 use_local_output: bool = False):
        api = type(self).__name__
        self.input_layouts = _layouts(input_layouts, "input_layouts", api)
        self.desired_input_layouts = _layouts(desired_input_layouts, "desired_input_layouts", api)
        self.input_kwarg_layouts = _kw_layouts(input_kwarg_layouts, "input_kwarg_layouts", api)
        self.desired_input_kwarg_layouts = _kw_layouts(
            desired_input_kwarg_layouts, "desired_input_kwarg_layouts", api)
        self._pairs = _pair(self.input_layouts, self.desired_input_layouts,
                            ("input_layouts", "desired_input_layouts"), api)
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(f"{api}: input_kwarg_layouts and desired_input_kwarg_layouts must "
                             "name the same keyword arguments.")
        self.use_local_output = bool(use_local_output)

    def _prepare(self, tp: MeshAxis, args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
        api = type(self).__name__
        if self._pairs and len(args) != len(self._pairs):
            raise ValueError(f"{api}: the module got {len(args)} positional inputs, but "
                             f"input_layouts describes {len(self._pairs)}.")
        moves = _Moves(tp, api, self.use_local_output)
        args = tuple(moves.move(a, s, d, share=True)
                     for a, (s, d) in zip(args, self._pairs or [(None, None)] * len(args)))
        kwargs = dict(kwargs)
        for name, src in self.input_kwarg_layouts.items():
            if name in kwargs:
                kwargs[name] = moves.move(kwargs[name], src, self.desired_input_kwarg_layouts[name],
                                          share=True)
        return args, kwargs, moves.shared

    def call(self, module: nnx.Module, original: Any, tp: MeshAxis, args: tuple,
             kwargs: dict) -> Any:
        args, kwargs, shared = self._prepare(tp, args, kwargs)
        with sharing(shared):
            return original(module, *args, **kwargs)


class PrepareModuleOutput(ParallelStyle):
    """Moves a module's outputs to the placements the caller wants after it runs.

    Args:
        output_layouts: the placement of each output (one, or a tuple for a tuple output).
        desired_output_layouts: the placement wanted for each.
        use_local_output: in host code, return this process's local data (True, torch's
            default) or the global arrays.
    """

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True):
        api = type(self).__name__
        self.output_layouts = _layouts(output_layouts, "output_layouts", api)
        self.desired_output_layouts = _layouts(desired_output_layouts,
                                               "desired_output_layouts", api)
        self._pairs = _pair(self.output_layouts, self.desired_output_layouts,
                            ("output_layouts", "desired_output_layouts"), api)
        self.use_local_output = bool(use_local_output)

    def _finish(self, tp: MeshAxis, out: Any) -> Any:
        api = type(self).__name__
        moves = _Moves(tp, api, self.use_local_output)
        single = not isinstance(out, (tuple, list))
        outs: Sequence[Any] = (out,) if single else out
        if len(outs) != len(self._pairs):
            raise ValueError(f"{api}: the module returned {len(outs)} outputs, but "
                             f"output_layouts describes {len(self._pairs)}.")
        moved = [moves.move(o, s, d) for o, (s, d) in zip(outs, self._pairs)]
        return moved[0] if single else type(out)(moved)

    def call(self, module: nnx.Module, original: Any, tp: MeshAxis, args: tuple,
             kwargs: dict) -> Any:
        return self._finish(tp, original(module, *args, **kwargs))


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module (torch's class of that name).

    Arguments as the two; ``use_local_input`` is PrepareModuleInput's ``use_local_output``.
    """

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None,
                 use_local_input: bool = False, output_layouts: Any = None,
                 desired_output_layouts: Any = None, use_local_output: bool = True):
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def call(self, module: nnx.Module, original: Any, tp: MeshAxis, args: tuple,
             kwargs: dict) -> Any:
        args, kwargs, shared = self.prepare_input._prepare(tp, args, kwargs)
        with sharing(shared):
            out = original(module, *args, **kwargs)
        return self.prepare_output._finish(tp, out)
