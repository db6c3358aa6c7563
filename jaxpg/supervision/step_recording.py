"""A jitted step is a recorded collective call: ``recorded_step(fn, group, name=...)``.

A compiled program whose collectives span processes (DDP's ``train_step``, the pipeline's
step, a function run by ``jaxpg.spmd``) can hang inside XLA where no Python runs. Wrapped
by :func:`recorded_step`, each launch of it in a multi-process world is one call on its
group, exactly like an eager collective (``jaxpg.supervision.collective_call``): it takes the
group's next sequence number, is noted as this process's progress and in the flight
recorder (with the collectives of its compiled program, read from the HLO once per
program), and runs by the world's semantics. On gloo the caller waits until the step's
outputs are ready, for at most the group's timeout (compile time excluded), and then
raises ``DistTimeoutError`` naming the ranks that never started it; on NCCL/TPU the step
returns at once and the watchdog ends the process with that text. A failure inside XLA's
collectives (``Gloo all-reduce failed ... Connection closed by peer``) becomes
``DistNetworkError`` naming the peer.

Before each launch the group's ranks compare the step's signature, its name and its
arguments' shapes and dtypes (``jaxpg.supervision.signature_check``): a rank that runs
``eval_step`` while its peers run ``train_step``, or another batch shape, makes every rank
raise ``DistDesyncError`` naming each rank's step, and none runs it.

Outside a multi-process world, and when called with traced arguments (inside another
``jit``), the wrapper calls ``fn`` as it is. Attributes it does not have (``lower``,
``trace``, ``eval_shape``) are ``fn``'s.

Example (any jitted function whose collectives run over a group or mesh)::

    step = jaxpg.supervision.recorded_step(jax.jit(train_step, donate_argnums=0), group=pg,
                                           name="FullyShardedDataParallel.train_step")
    state, loss = step(state, batch)
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpg._jax_compat import jit_cache_size
from jaxpg.supervision import flight_recorder, world_link

__all__ = ["RecordedStep", "recorded_step", "hlo_collectives", "group_of_devices"]

_COLLECTIVE = re.compile(
    r"=\s*([^=\n]*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
    r"collective-permute|collective-broadcast)(?:-start)?\(")
_LAYOUT = re.compile(r"\{[^}]*\}")


def hlo_collectives(hlo: str) -> tuple[str, ...]:
    """The collectives of an HLO module's text, in order, repeats counted:
    ``("all-reduce f32[10,4] x2", "all-gather f32[8,4]")``.

    Args:
        hlo: ``jax.jit(f).lower(...).compile().as_text()`` (or a lowered module's text).
    """
    found = [f"{op} {_LAYOUT.sub('', shape).strip()}"
             for shape, op in _COLLECTIVE.findall(hlo)]
    counts = Counter(found)
    return tuple(c if counts[c] == 1 else f"{c} x{counts[c]}" for c in dict.fromkeys(found))


def group_of_devices(state: Any, devices: Any) -> Any:
    """The group a program over ``devices`` is numbered on: the world when it spans every
    rank, else a group of exactly those ranks, named after them (the same name in every
    process, made on first use, as point-to-point's pair groups are)."""
    ranks = tuple(sorted({state.rank_of_device(d) for d in devices}))
    if len(ranks) == len(state.devices):
        return state.world_group
    groups = state.__dict__.setdefault("_device_groups", {})
    group = groups.get(ranks)
    if group is None:
        contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
        name = (f"devices_{ranks[0]}-{ranks[-1]}" if contiguous
                else "devices_" + hashlib.sha1(repr(ranks).encode()).hexdigest()[:12])
        group = groups[ranks] = world_link.group_type()(state, ranks, name=name)
    return group


def _shape_key(args: Any, kwargs: Any) -> Any:
    leaves, tree = jax.tree.flatten((args, kwargs))
    key = (tree, tuple(getattr(x, "shape", None) if hasattr(x, "shape") else repr(x)
                       for x in leaves))
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key


class _Programs:
    """The collectives of each program a jitted function compiled, read from its HLO once per
    program (after the program's first launch: reading it before would compile it twice)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.single: tuple[str, ...] | None = None
        self.by_shapes: dict[Any, tuple[str, ...] | None] = {}

    def describe(self, args: Any, kwargs: Any) -> tuple[str, ...] | None:
        if isinstance(self.fn, jax.stages.Compiled):
            if self.single is None:
                self.single = self._read(args, kwargs)
            return self.single
        if not hasattr(self.fn, "lower"):
            return None
        if jit_cache_size(self.fn) == 1:  # one program: no key needed
            if self.single is None:
                self.single = self._read(args, kwargs)
            return self.single
        key = _shape_key(args, kwargs)
        if key not in self.by_shapes:
            self.by_shapes[key] = self._read(args, kwargs)
        return self.by_shapes[key]

    def _read(self, args: Any, kwargs: Any) -> tuple[str, ...] | None:
        try:
            if isinstance(self.fn, jax.stages.Compiled):
                return hlo_collectives(self.fn.as_text())
            # after the launch: JAX's caches hold the program, so this compiles nothing
            return hlo_collectives(self.fn.lower(*args, **kwargs).compile().as_text())
        except Exception:  # noqa: BLE001 (the record only lacks the list)
            return None


_LISTED = 8  # an argument of up to this many arrays lists them in the fingerprint


def _leaf_signature(x: Any) -> tuple:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:  # not an array: its type only (values may differ)
        return (None, type(x).__name__)
    return (tuple(shape), str(dtype))


def _argument(name: str, sigs: list[tuple]) -> tuple:
    """One fingerprint input for an argument: an array's shape and dtype; a pytree's arrays
    listed, or, past ``_LISTED``, counted with a digest of their shapes."""
    if len(sigs) == 1 and sigs[0][0] is not None:
        return (name, sigs[0][0], sigs[0][1])
    if len(sigs) <= _LISTED:
        parts = [dtype if shape is None else f"{dtype}{list(shape)}" for shape, dtype in sigs]
        return (name, None, "{" + ", ".join(parts) + "}")
    digest = hashlib.blake2b(repr(sigs).encode(), digest_size=4).hexdigest()
    return (name, None, f"<{len(sigs)} leaves, shapes {digest}>")


class _Signatures:
    """A step's fingerprint per argument signature: ``(name, None, inputs)``, one input per
    argument (made once per signature)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.known: dict[Any, tuple] = {}

    def of(self, args: Any, kwargs: Any) -> tuple:
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + sorted(kwargs.items())
        key = tuple((n, tuple(_leaf_signature(x) for x in jax.tree.leaves(a)))
                    for n, a in named)
        found = self.known.get(key)
        if found is None:
            if len(self.known) > 256:
                self.known.clear()
            found = self.known[key] = (self.name, None, tuple(  # no arrays (None): left out
                _argument(n, list(sigs)) for n, sigs in key if sigs))
        return found


def _is_process_group(value: Any) -> bool:
    group_type = world_link.group_type()
    return group_type is not None and isinstance(value, group_type)


def _traced(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


class RecordedStep:
    """``fn`` whose launches are recorded collective calls on a group (see the module doc).

    Args:
        fn: a ``jax.jit`` function (or a ``jax.stages.Compiled``, or any callable: then the
            record lacks the program's collectives).
        group: what the program's collectives span: a ``ProcessGroup``, a
            ``jax.sharding.Mesh`` or a ``DeviceMesh`` (numbered on the group of its
            devices: the world when it spans every rank), or None for the world.
        name: the name errors, dumps and the analyzer give it (default: ``fn``'s).
    """

    def __init__(self, fn: Any, group: Any = None, *, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"recorded_step: fn={fn!r} must be callable (a jax.jit function).")
        if group is not None and not _is_process_group(group) \
                and not isinstance(group, Mesh) and not hasattr(group, "jax_mesh"):
            raise TypeError(
                f"recorded_step: group={group!r} must be a ProcessGroup, a jax.sharding.Mesh, "
                "a DeviceMesh or None (the world).")
        if name is not None and not (isinstance(name, str) and name):
            raise TypeError(f"recorded_step: name={name!r} must be a non-empty string.")
        self.fn = fn
        self.group = group
        qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        self.name = name or (qualname.rpartition("<locals>.")[2] if qualname
                             else "recorded_step")
        self._programs = _Programs(fn)
        self._signatures = _Signatures(self.name)
        functools.update_wrapper(self, fn, updated=())

    def _group(self, state: Any) -> Any:
        target = self.group
        if target is None:
            return state.world_group
        if _is_process_group(target):
            return target
        mesh = getattr(target, "jax_mesh", target)
        return group_of_devices(state, mesh.devices.flat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = world_link.current_world(required=False)
        if state is None or not state.multiprocess or _traced(args, kwargs):
            return self.fn(*args, **kwargs)
        from jaxpg.supervision import collective_call

        group = self._group(state)
        if group._world is not state:
            raise ValueError(
                f"recorded_step {self.name!r}: group {group.group_name!r} belongs to a "
                "destroyed world; make the step again after init_process_group.")
        programs, fn = self._programs, self.fn

        def launch() -> Any:
            out = fn(*args, **kwargs)
            record = flight_recorder.current()
            if record is not None:
                record.collectives = programs.describe(args, kwargs)
            return out

        return collective_call.run_collective(group, self.name, launch,
                                              self._signatures.of(args, kwargs), kind="step")

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "fn":  # not set yet (copying, unpickling)
            raise AttributeError(attribute)
        return getattr(self.fn, attribute)

    def __repr__(self) -> str:
        return f"recorded_step({self.fn!r}, name={self.name!r})"


def recorded_step(fn: Any = None, group: Any = None, *, name: str | None = None) -> Any:
    """Makes ``fn`` a recorded collective call on ``group`` (see :class:`RecordedStep`).

    Also a decorator: ``@recorded_step(group=pg, name="my_step")`` over a ``jax.jit``
    function.
    """
    if fn is None:
        return functools.partial(recorded_step, group=group, name=name)
    return RecordedStep(fn, group, name=name)
