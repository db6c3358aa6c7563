"""Point-to-point lanes: ordered transfers between this process's pipeline rank and a peer.

Between two processes XLA's only transfer is a collective: a two-device ``ppermute``
that both processes must enter (gloo on CPU, NCCL on GPU). A :class:`PairLane` holds
one such two-device mesh, its compiled ``ppermute`` kernels (one per direction), and
one thread of its own (a :class:`jaxpg.supervision.runner.Runner`), on which it runs the
transfers of one pipeline step in the order both ranks agree on
(``jaxpg.pipeline.process.rank_ops.pair_transfers``). Both ends run the same list, so the
collectives always pair up; a collective blocks only the lane's thread, so the rank's
actions go on meanwhile (XLA runs a ``ppermute`` on the thread that calls it). A send
starts as soon as the action that made the message is done; a receive is posted as
soon as the lane gets to it, and the rank's host thread waits for it only right before
the action that reads it: started early, waited late. A lane per peer keeps the pairs
independent: a slow rank holds up only its neighbours' lanes with it.

The first step of a lane exchanges the metadata of what each end sends, in the seed's
``send_meta``/``recv_meta`` form (``jaxpg.collectives.p2p_meta``): the header length,
then the header, both ways. The receive buffers are made from the header received, and
an end that expects other shapes or dtypes than its peer sends raises ``ValueError``
naming both ranks and both shapes, before any tensor travels (a mismatched collective
would abort the process inside gloo).

:class:`StepMail` is one step's meeting point of the host thread and the lanes: the
messages the actions made (posted), and the ones that arrived (delivered). Its
``receive`` waits with the world's timeout and names the rank at fault: a peer the
coordination service lost (``DistNetworkError``), or one that sent nothing in time
(``DistTimeoutError``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.collectives.p2p_meta import TensorMeta, decode_meta, encode_meta
from jaxpg.errors import DistNetworkError, DistTimeoutError
from jaxpg.groups import callbacks
from jaxpg.pipeline.stage.metadata import format_struct
from jaxpg.pipeline.stage.trace_tools import leaves_key
from jaxpg.supervision import liveness
from jaxpg.supervision.runner import Runner

__all__ = ["PairLane", "StepMail", "describe_key", "lane_between"]

_SLICE = 0.1  # how often a waiting host thread looks for lost peers (seconds)


def _heartbeat_s() -> float:
    """The coordination service's heartbeat timeout (``JAXPG_HEARTBEAT_TIMEOUT``)."""
    try:
        return float(os.environ.get("JAXPG_HEARTBEAT_TIMEOUT", "10"))
    except ValueError:
        return 10.0


def describe_key(key: tuple[str, int, int]) -> str:
    """``"the activation into stage 2, microbatch 3"``-style text for a message key."""
    what, stage, mb = key
    if what == "act":
        return f"the activation into stage {stage}, microbatch {mb}"
    return f"the gradient of stage {stage}'s output, microbatch {mb}"


class StepMail:
    """One step's messages between the host thread and the lanes (see the module docstring).

    Args:
        me: this process's rank (global, for messages).
        timeout: seconds a ``receive`` or the end of the step waits before
            ``DistTimeoutError``.
        what: the step, for error messages (e.g. ``"pipeline 1f1b"``).
        process_of: the process of each peer's global rank (for the lost-peer check).
    """

    def __init__(self, me: int, timeout: float, what: str, process_of: dict[int, int]) -> None:
        self.me, self.timeout, self.what = me, timeout, what
        self._process_of = process_of
        self._cv = threading.Condition()
        self._outbox: dict = {}
        self._inbox: dict = {}
        self.error: BaseException | None = None
        self.cancelled = False

    # host side -------------------------------------------------------------------------
    def post(self, key: tuple, dst: int, value: Any) -> None:
        """An action made ``value`` for rank ``dst`` (this rank itself: kept here)."""
        with self._cv:
            (self._inbox if dst == self.me else self._outbox)[key] = value
            self._cv.notify_all()

    def receive(self, key: tuple, src: int) -> Any:
        """The message ``key`` from rank ``src``, waiting for it if it has not arrived."""
        with self._cv:
            if key in self._inbox:
                return self._inbox.pop(key)
        deadline = time.monotonic() + self.timeout
        while True:
            with self._cv:
                if key in self._inbox:
                    return self._inbox.pop(key)
                if self.error is not None:
                    raise self.error
                self._cv.wait(_SLICE)
                if key in self._inbox:
                    return self._inbox.pop(key)
            self.check_peers([src], f"waiting for {describe_key(key)} from rank {src}")
            if time.monotonic() > deadline:
                raise DistTimeoutError(
                    f"{self.what}: rank {self.me} waited {self.timeout:.1f} s for "
                    f"{describe_key(key)} from rank {src}, which did not send it; ranks that "
                    f"did not arrive: [{src}]."
                )

    def cancel(self) -> None:
        """The host thread gave up on the step: lanes stop at their next transfer."""
        with self._cv:
            self.cancelled = True
            self._cv.notify_all()

    def check_peers(self, ranks: Sequence[int], doing: str) -> None:
        """Raises ``DistNetworkError`` if the coordination service lost one of ``ranks``."""
        if not liveness.lost():
            return
        procs = sorted({self._process_of[r] for r in ranks})
        liveness.check(procs, lambda gone: [r for r in ranks if self._process_of[r] in gone],
                       f"{self.what}: rank {self.me} {doing}")

    # lane side -------------------------------------------------------------------------
    def take(self, key: tuple) -> Any | None:
        """The message ``key`` to send, once posted (None: the step was cancelled)."""
        with self._cv:
            while key not in self._outbox:
                if self.cancelled:
                    return None
                self._cv.wait()
            return self._outbox.pop(key)

    def deliver(self, key: tuple, value: Any) -> None:
        with self._cv:
            self._inbox[key] = value
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self._cv.notify_all()


class PairLane:
    """Ordered transfers between this process's device and one peer device.

    Args:
        mine: this process's device.
        peer: the peer's device (another process's).
        me: this rank's global rank; ``peer_rank``: the peer's (for messages).
    """

    def __init__(self, mine: Any, peer: Any, me: int, peer_rank: int) -> None:
        self.me, self.peer = me, peer_rank
        self.index = 0 if me < peer_rank else 1  # this end's position on the pair mesh
        devices = [mine, peer] if self.index == 0 else [peer, mine]
        self.mesh = Mesh(np.array(devices, dtype=object), ("pair",))
        self.sharding = NamedSharding(self.mesh, P("pair"))
        self.runner = Runner()
        self._kernels: dict[tuple, Callable] = {}
        self._templates: dict[tuple, list] = {}  # expected leaves -> receive buffers
        self._receive_buffers: dict[tuple, list] = {}  # of run_transfers, by structure

    def _kernel(self, perm: tuple[tuple[int, int], ...]) -> Callable:
        kernel = self._kernels.get(perm)
        if kernel is None:
            def body(*xs):
                return tuple(lax.ppermute(x, "pair", list(perm)) for x in xs)

            kernel = self._kernels[perm] = jax.jit(jax.shard_map(
                body, mesh=self.mesh, in_specs=P("pair"), out_specs=P("pair"),
                check_vma=False))  # fmt: skip
        return kernel

    def _move(self, leaves: list, perm: tuple[tuple[int, int], ...], what: str) -> list:
        """Runs the ``ppermute`` over this end's ``leaves``; returns this end's results.

        Raises:
            DistNetworkError: the collective failed (naming the peer, and whether the
                coordination service lost it).
        """
        blocks = [jax.make_array_from_single_device_arrays(
            (2 * a.shape[0], *a.shape[1:]), self.sharding, [a]) for a in leaves]  # fmt: skip
        try:
            out = self._kernel(perm)(*blocks)
            out = [o.addressable_shards[0].data for o in out]
            jax.block_until_ready(out)
        except Exception as err:  # XLA reports a lost peer as a runtime error
            procs = [self.mesh.devices.flat[1 - self.index].process_index]
            gone = liveness.wait_lost(procs, _heartbeat_s() + 1.0)
            if gone:
                liveness.mark_reported()
            cause = ("the coordination service stopped hearing from it" if gone else
                     "it may have died, or run another program")
            raise DistNetworkError(
                f"{what}: the transfer between rank {self.me} and rank {self.peer} failed: "
                f"{err}; lost ranks [{self.peer}] ({cause})."
            ) from err
        return out

    def _both_ways(self, words: np.ndarray, what: str) -> np.ndarray:
        device = self.mesh.devices.flat[self.index]
        got = self._move([jax.device_put(words, device)], ((0, 1), (1, 0)), what)
        return np.asarray(got[0])

    def handshake(self, sends: Any, expects: Any, what: str) -> list:
        """Exchanges metadata (``send_meta``/``recv_meta``); returns the receive buffers.

        Args:
            sends: what this end sends (a pytree of shape structs).
            expects: what it expects from the peer.
            what: the step, for the error message.

        Raises:
            ValueError: the peer sends other shapes or dtypes than this end expects.
        """
        leaves = jax.tree.leaves(sends)
        for leaf in leaves:
            if len(leaf.shape) == 0:
                raise ValueError(f"{what}: activations must be arrays of rank >= 1 to travel "
                                 f"between processes; got {format_struct(sends)}.")
        key = leaves_key(jax.tree.leaves(expects))
        if key in self._templates:
            return self._templates[key]
        header = encode_meta([TensorMeta(tuple(a.shape), str(np.dtype(a.dtype)))
                              for a in leaves], several=True)
        length = int(self._both_ways(np.array([header.size], np.int32), what)[0])
        size = max(length, header.size)
        padded = np.zeros(size, np.int32)
        padded[: header.size] = header
        got = self._both_ways(padded, what)[:length]
        metas, _ = decode_meta(got.tolist())
        theirs = [(tuple(m.shape), m.dtype) for m in metas]
        if theirs != list(key):
            structs = [jax.ShapeDtypeStruct(s, d) for s, d in theirs]
            treedef = jax.tree.structure(expects)
            sent = format_struct(jax.tree.unflatten(treedef, structs)
                                 if treedef.num_leaves == len(structs) else structs)
            raise ValueError(
                f"{what}: rank {self.me} expects {format_struct(expects)} from rank "
                f"{self.peer}, but rank {self.peer} sends {sent} (the send_meta/recv_meta "
                "exchange). Every process must run the same model on microbatches of the "
                "same shapes."
            )
        device = self.mesh.devices.flat[self.index]
        self._templates[key] = [jax.device_put(jnp.zeros(s, d), device) for s, d in theirs]
        return self._templates[key]

    def send_meta(self, structs: Any, what: str) -> None:
        """Sends the metadata of ``structs`` to the peer (the seed's ``send_meta``).

        The peer must call :meth:`recv_meta` at the same point of its program: the length
        of the header, then the header, each one ``ppermute`` this way.
        """
        header = encode_meta([TensorMeta(tuple(a.shape), str(np.dtype(a.dtype)))
                              for a in jax.tree.leaves(structs)], several=True)  # fmt: skip
        to_peer = ((self.index, 1 - self.index),)
        device = self.mesh.devices.flat[self.index]
        self._move([jax.device_put(np.array([header.size], np.int32), device)], to_peer, what)
        self._move([jax.device_put(header, device)], to_peer, what)

    def send_no_meta(self, what: str) -> None:
        """Tells the peer's :meth:`recv_meta` that nothing will follow (this end could not
        find its shapes): a header length of ``-1``, so the peer does not wait."""
        to_peer = ((self.index, 1 - self.index),)
        device = self.mesh.devices.flat[self.index]
        self._move([jax.device_put(np.array([-1], np.int32), device)], to_peer, what)

    def recv_meta(self, what: str) -> list[jax.ShapeDtypeStruct] | None:
        """Receives what the peer's :meth:`send_meta` sends (the seed's ``recv_meta``);
        None when the peer sent :meth:`send_no_meta` instead."""
        from_peer = ((1 - self.index, self.index),)
        device = self.mesh.devices.flat[self.index]
        got = self._move([jax.device_put(np.zeros(1, np.int32), device)], from_peer, what)
        length = int(np.asarray(got[0])[0])
        if length < 0:
            return None
        got = self._move([jax.device_put(np.zeros(length, np.int32), device)], from_peer, what)
        metas, _ = decode_meta(np.asarray(got[0]).tolist())
        return [jax.ShapeDtypeStruct(m.shape, m.dtype) for m in metas]

    def _buffers(self, structs: Any) -> list:
        """Receive buffers (zeros on this end's device) for ``structs``, made once."""
        key = leaves_key(jax.tree.leaves(structs))
        if key not in self._receive_buffers:
            device = self.mesh.devices.flat[self.index]
            self._receive_buffers[key] = [jax.device_put(jnp.zeros(s, d), device)
                                          for s, d in key]  # fmt: skip
        return self._receive_buffers[key]

    def run_step(self, transfers: Sequence[Any], mail: StepMail, act: Any, what: str,
                 record: Callable[[str, str, float, float], None] | None = None) -> None:
        """Moves one step's ``transfers`` in order (runs on the lane's thread).

        Args:
            transfers: this pair's :class:`~jaxpg.pipeline.process.rank_ops.Transfer` list.
            mail: the step's messages.
            act: the activation structure (shape structs) both ends send.
            what: the step, for error messages.
            record: ``record(kind, label, start, end)`` for each transfer (a timeline).
        """
        try:
            self.handshake(act, act, what)
        except BaseException as err:  # noqa: BLE001 (handed to the host thread)
            mail.fail(err)
            raise
        self.run_transfers(transfers, mail, lambda key: act, what, record)

    def run_transfers(self, transfers: Sequence[Any], mail: StepMail,
                      structs_of: Callable[[tuple], Any], what: str,
                      record: Callable[[str, str, float, float], None] | None = None) -> None:
        """Moves ``transfers`` in order; ``structs_of(key)`` is a message's structure
        (shape structs), known to both ends (runs on the lane's thread)."""
        try:
            to_peer = ((self.index, 1 - self.index),)
            from_peer = ((1 - self.index, self.index),)
            for t in transfers:
                if mail.cancelled:
                    return
                if t.src == self.me:
                    value = mail.take(t.key)
                    if value is None:
                        return
                    leaves = jax.tree.leaves(value)
                    jax.block_until_ready(leaves)  # run the collective here, not on XLA's pool
                    start = time.perf_counter()
                    self._move(leaves, to_peer, what)
                    kind = "send"
                else:
                    structs = structs_of(t.key)
                    start = time.perf_counter()
                    got = self._move(self._buffers(structs), from_peer, what)
                    mail.deliver(t.key, jax.tree.unflatten(jax.tree.structure(structs), got))
                    kind = "recv"
                if record is not None:
                    record(kind, " ".join(map(str, t.key)), start, time.perf_counter())
        except BaseException as err:  # noqa: BLE001 (handed to the host thread)
            mail.fail(err)
            raise


_lanes: dict[tuple[int, int], PairLane] = {}


@callbacks.on_reset
def _forget_lanes() -> None:
    """``destroy_process_group``: the lanes' meshes and kernels belong to the old world."""
    _lanes.clear()


def lane_between(mine: Any, peer: Any, me: int, peer_rank: int) -> PairLane:
    """The lane between this process's device ``mine`` and ``peer`` (made once, kept)."""
    key = (mine.id, peer.id)
    if key not in _lanes:
        _lanes[key] = PairLane(mine, peer, me, peer_rank)
    return _lanes[key]
