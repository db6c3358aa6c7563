"""The default desync check: no collective runs when the ranks' calls differ.

Before each eager collective and each recorded step of a group that spans processes, the
group's ranks compare a 62-bit digest of their call's *signature*: the op (or the step's
name), the group, every input's per-rank shape and dtype, and the static arguments (reduce
op, src/dst). The comparison is a tiny XLA all-reduce (a maximum over 16 bytes) of the same
size on every rank, over the same devices as the call itself, so it pairs with its peers'
whatever they call, and every rank gets the same verdict; a call whose digests disagree
is not run on any rank. Instead every rank publishes its
fingerprint's text to the store and raises ``DistDesyncError`` naming each differing rank's
call (torch's ``ProcessGroupWrapper`` does the same check through the store under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

Because the comparison runs with every call, a rank whose call is cached cannot pair with a
peer's new one. Its cost is one small collective and one wait for its answer per call; a
world of one process does no check (there is nothing to compare against). The digest's
device array and the gather's kernel are made once per (group, signature) and per group.
``JAXPG_DEBUG=OFF`` (or ``TORCH_DISTRIBUTED_DEBUG=OFF``) turns the check off; under
``JAXPG_DEBUG=DETAIL`` the store comparison of ``jaxpg.supervision.desync`` replaces it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.errors import DistDesyncError, DistTimeoutError
from jaxpg.supervision.desync import describe_mismatch, fingerprint_text
from jaxpg.supervision.hang_diagnosis import processes_of, ranks_of_processes

__all__ = ["check_enabled", "signature_text", "dispatch", "mismatched", "raise_mismatch"]


def check_enabled() -> bool:
    """False under ``JAXPG_DEBUG=OFF`` (or ``TORCH_DISTRIBUTED_DEBUG=OFF``)."""
    value = os.environ.get("JAXPG_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG") or ""
    return value.strip().upper() != "OFF"


def _scope(group: Any) -> str:
    """What every rank of the kernel's family calls the group: its name, or for a family of
    subgroups (``new_subgroups``: each process holds another one), their rank lists."""
    family = group.family
    if len(family) == 1:
        return group.group_name
    return "family" + repr(tuple(tuple(sub) for sub in family))


def signature_text(group: Any, fingerprint: Any) -> str:
    """The text whose digest the ranks compare: the fingerprint without its sequence number."""
    return fingerprint_text(_scope(group), None, fingerprint)


def _digest(text: str) -> np.ndarray:
    """62 bits of the text's hash as two non-negative int32 (their negations fit too)."""
    raw = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), "<i4")
    return raw & np.int32(0x7FFFFFFF)


# Set by ``jaxpg.collectives``: ``group_max(group)`` gives ``fn(x)`` that, traced per rank
# over ``group.family_mesh``, returns the maximum of ``x`` over the rank's own subgroup
# (a family of ``new_subgroups`` has several; each checks its own calls, as it runs them).
group_max: list[Callable[[Any], Callable[[Any], Any]]] = []


def _kernel(group: Any) -> tuple[Any, NamedSharding]:
    """The group's check: each rank's digest in, 1 out on every rank of its subgroup when
    any two differ (one all-reduce: the maximum of the digests and of their negations,
    which meet only when every rank's is the same)."""
    entry = group.__dict__.get("_jaxpg_sigcheck_kernel")
    if entry is None:
        mesh, axis = group.family_mesh, group.axis_name
        if group_max:
            maximum = group_max[0](group)
        else:  # one subgroup: the whole axis
            def maximum(x: Any) -> Any:
                return lax.pmax(x, axis)

        def per_rank(digest: Any) -> Any:  # [1, 2], both halves in [0, 2**31)
            both = maximum(jnp.concatenate([digest, -digest], axis=1))
            return jnp.any(both[:, :2] != -both[:, 2:]).astype(jnp.int32).reshape(1)

        sharding = NamedSharding(mesh, P(axis))
        kernel = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis),
                                       out_specs=P(axis), check_vma=False))
        entry = group.__dict__["_jaxpg_sigcheck_kernel"] = (kernel, sharding)
    return entry


def _digest_array(group: Any, fingerprint: Any) -> Any:
    """The signature's digest as the kernel's global input (one row per rank held here)."""
    cache = group.__dict__.setdefault("_jaxpg_sigcheck", {})
    key = fingerprint
    try:
        array = cache.get(key)
    except TypeError:  # an unhashable static argument: keyed by its text
        key = repr(fingerprint)
        array = cache.get(key)
    if array is None:
        _, sharding = _kernel(group)
        local = group.local_members()
        rows = np.tile(_digest(signature_text(group, fingerprint)), (len(local), 1))
        array = jax.make_array_from_process_local_data(sharding, rows,
                                                       (len(group.members), 2))
        if len(cache) > 4096:  # a new signature every call: keep the cache bounded
            cache.clear()
        cache[key] = array
    return array


def dispatch(group: Any, fingerprint: Any) -> Any:
    """Starts the check of this call's signature on ``group``; returns its output (wait for
    it with :func:`mismatched`)."""
    kernel, _ = _kernel(group)
    return kernel(_digest_array(group, fingerprint))


def mismatched(flags: Any) -> bool:
    """Waits for the check started by :func:`dispatch`: whether the ranks' signatures
    differ (the same answer on every rank)."""
    return bool(np.asarray(flags.addressable_shards[0].data)[0])


def raise_mismatch(group: Any, api: str, seq: int, fingerprint: Any) -> None:
    """Raises ``DistDesyncError`` naming each rank's call, after the ranks exchanged their
    fingerprints' texts through the world's store (every rank of a mismatched check calls
    it, and all raise the same text)."""
    state = group._world
    members = tuple(sorted(group.ranks))  # this rank's subgroup: the ranks that compared
    procs = processes_of(state, members)
    me = state.process_index
    rank_of = {p: ranks_of_processes(state, [p], members)[0] for p in procs}
    # Every rank of the gather saw the same digests, so all count the same mismatches on
    # these members, whatever group each one named: the count keys the exchange.
    counts = state.__dict__.setdefault("_jaxpg_sigcheck_mismatches", {})
    n = counts[members] = counts.get(members, 0) + 1
    prefix = f"sigcheck/{hashlib.sha1(repr(members).encode()).hexdigest()[:12]}/{n}/"
    text = fingerprint_text(group.group_name, seq, fingerprint)
    store = state.store
    store.set(prefix + str(me), text)
    keys = {p: prefix + str(p) for p in procs if p != me}
    timeout = group.timeout
    try:
        store.wait(list(keys.values()), timeout)
    except Exception:  # noqa: BLE001 (the store's timeout: say who never answered)
        missing = [rank_of[p] for p, k in keys.items() if not store.check([k])]
        raise DistTimeoutError(
            f"{api} #{seq} on group {group.group_name!r}: the ranks' calls differ, and ranks "
            f"{missing} did not say what they called within {_seconds(timeout)}."
        ) from None
    texts = {rank_of[p]: store.get(k).decode() for p, k in keys.items()}
    texts[rank_of[me]] = text
    if n > 2:  # every rank has read the keys of mismatch n - 2 once any writes mismatch n
        try:
            store.delete_key(prefix.replace(f"/{n}/", f"/{n - 2}/") + str(me))
        except Exception:  # noqa: BLE001 (cleanup only)
            pass
    problem = describe_mismatch(texts) or "; ".join(
        f"rank {r} is running {t}" for r, t in sorted(texts.items()))
    ops = {t.partition("(")[0] for t in texts.values()}
    hint = _UNEVEN_HINT if len(ops) > 1 and any(o.endswith("train_step") for o in ops) else ""
    raise DistDesyncError(
        f"{api} #{seq} on group {group.group_name!r}: the ranks called different collectives "
        f"at the same point, so no rank ran it: {problem} Every rank must call the same "
        f"collectives in the same order with the same shapes, dtypes and arguments.{hint}"
    )


_UNEVEN_HINT = (" Uneven data? A rank that runs out of batches stops calling the step before "
                "the others: see `with ddp.join():` in docs/debugging.md.")


def _seconds(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds():.1f} s"
