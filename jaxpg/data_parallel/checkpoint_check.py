"""Whether a saved DDP or FSDP checkpoint step can be read, checked before a restore loads it.

A node lost in the middle of a write, a full disk or a copy cut short can leave a step that
orbax lists as committed but whose files are short, and tensorstore then fails deep inside
the restore with a long one-line error. :func:`damage` looks at a step directory the way a
restore will read it, without reading the arrays' data:

* orbax's commit record (``_CHECKPOINT_METADATA`` with its commit time) and the JSON
  records (``meta/metadata`` with the step and the arrays' paths, ``state/_METADATA`` with
  the arrays' names);
* the arrays' index: each array's ``.zarray`` (or ``zarr.json``) and as many chunks as its
  shape and chunk shape give; in orbax's OCDBT format the B+tree is walked (its nodes read,
  a few KB) and every byte range it points to must lie inside its data file.

:func:`choose_step` applies it to the candidate steps, newest first, for
``restore_checkpoint``: the newest readable one is restored, with one warning naming the
damaged steps; when none is readable, the error names every step found and what is wrong
with each. Every process checks the same files (a multi-process checkpoint lives on a
shared file system), so all choose the same step.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["damage", "choose_step"]

_MAX_TEXT = 300  # a tensorstore error's first line, cut to this many characters


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + "..."


def _json(step_dir: str, name: str) -> Any:
    """The JSON file ``name`` under ``step_dir``; raises ``_Damaged`` naming what is wrong."""
    path = os.path.join(step_dir, name)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise _Damaged(f"{name} is missing") from None
    except (OSError, ValueError) as err:
        raise _Damaged(f"{name} cannot be read ({_short(err)})") from None


class _Damaged(Exception):
    """What makes a step unreadable (internal)."""


def _array_names(state_meta: Any) -> list[str]:
    tree = state_meta.get("tree_metadata") if isinstance(state_meta, dict) else None
    if not isinstance(tree, dict):
        raise _Damaged("state/_METADATA holds no tree_metadata")
    names = []
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if not keys:
            raise _Damaged("state/_METADATA has an entry without key_metadata")
        names.append(".".join(str(k["key"]) for k in keys))
    return names


def _location(state: str, loc: str) -> tuple[str, int, int]:
    """``<type>:<base path>:<file id>:<offset>:<length>`` -> (file, offset, length)."""
    head, offset, length = loc.split(":", 1)[1].rsplit(":", 2)
    base, _, file_id = head.partition(":")
    return os.path.join(state, base, file_id), int(offset), int(length)


def _check_range(state: str, loc: str) -> None:
    path, offset, length = _location(state, loc)
    rel = os.path.relpath(path, os.path.dirname(state))
    try:
        size = os.path.getsize(path)
    except OSError:
        raise _Damaged(f"array file {rel} is missing") from None
    if offset + length > size:
        raise _Damaged(f"array file {rel} holds {size} bytes, but the checkpoint's index "
                       f"needs bytes {offset}..{offset + length} of it (the file was cut short)")


def _locations(node: Any, out: list[str]) -> None:
    if isinstance(node, dict):
        for v in node.values():
            _locations(v, out)
    elif isinstance(node, list):
        for v in node:
            _locations(v, out)
    elif isinstance(node, str) and node.startswith(("btreenode:", "value:")) \
            and node.count(":") >= 4:
        out.append(node)


def _ocdbt_keys(state: str) -> Any:
    """Walks the OCDBT database under ``state``: every node read, every byte range checked;
    returns a reader of its keys."""
    import tensorstore as ts

    url = "file://" + os.path.abspath(state) + "/"
    try:
        base = ts.KvStore.open(url).result()
        manifest = ts.ocdbt.dump(base).result()
    except Exception as err:  # noqa: BLE001 (tensorstore's errors are plain ValueErrors)
        raise _Damaged(f"state/manifest.ocdbt cannot be read ({_short(err)})") from None
    versions = manifest.get("versions") or []
    pending = [versions[-1]["root"]["location"]] if versions and \
        versions[-1].get("root", {}).get("location") else []
    while pending:
        loc = pending.pop()
        _check_range(state, loc)
        if not loc.startswith("btreenode:"):
            continue
        try:
            node = ts.ocdbt.dump(base, loc).result()
        except Exception as err:  # noqa: BLE001
            path = os.path.relpath(_location(state, loc)[0], os.path.dirname(state))
            raise _Damaged(f"array index node in {path} cannot be read ({_short(err)})") \
                from None
        found: list[str] = []
        _locations(node.get("entries", []), found)
        pending += found
    try:
        return ts.KvStore.open({"driver": "ocdbt", "base": url}).result()
    except Exception as err:  # noqa: BLE001
        raise _Damaged(f"state/ cannot be opened ({_short(err)})") from None


def _check_arrays(state: str, names: Sequence[str], count_chunks: bool) -> None:
    """Each array's zarr metadata is there, and (``count_chunks``: orbax stored every chunk,
    even one equal to the fill value) every chunk its zarr v2 shape needs."""
    if os.path.exists(os.path.join(state, "manifest.ocdbt")):
        store = _ocdbt_keys(state)
        try:
            keys = {k.decode() for k in store.list().result()}
        except Exception as err:  # noqa: BLE001
            raise _Damaged(f"the array index under state/ cannot be listed ({_short(err)})") \
                from None

        def read(key: str) -> bytes:
            return store.read(key).result().value
    else:  # plain zarr directories
        keys = {os.path.relpath(os.path.join(d, f), state).replace(os.sep, "/")
                for d, _, files in os.walk(state) for f in files}

        def read(key: str) -> bytes:
            with open(os.path.join(state, key), "rb") as f:
                return f.read()
    for name in names:
        zarr = next((f"{name}/{m}" for m in (".zarray", "zarr.json") if f"{name}/{m}" in keys),
                    None)
        if zarr is None:
            raise _Damaged(f"array {name} has no zarr metadata in state/")
        try:
            spec = json.loads(read(zarr))
        except Exception as err:  # noqa: BLE001
            raise _Damaged(f"array {name}'s {zarr.rsplit('/', 1)[1]} cannot be read "
                           f"({_short(err)})") from None
        if not count_chunks or not zarr.endswith(".zarray"):
            continue  # zarr v3 may shard its chunks: no count to compare
        shape, chunks = spec.get("shape") or [], spec.get("chunks") or []
        want = math.prod(-(-s // max(c, 1)) for s, c in zip(shape, chunks)) if shape else 1
        have = sum(1 for k in keys if k.startswith(f"{name}/") and k != zarr)
        if have < want:
            raise _Damaged(f"array {name} has {have} of its {want} chunks in state/")


def damage(step_dir: str | os.PathLike) -> str | None:
    """What makes the checkpoint in ``step_dir`` (``<root>/<step>``) unreadable, or None
    when it is complete (see the module doc)."""
    step_dir = os.fspath(step_dir)
    try:
        record = _json(step_dir, "_CHECKPOINT_METADATA")
        if not isinstance(record, dict) or not record.get("commit_timestamp_nsecs"):
            raise _Damaged("_CHECKPOINT_METADATA has no commit time (orbax never committed it)")
        meta = _json(step_dir, os.path.join("meta", "metadata"))
        if not isinstance(meta, dict) or "step" not in meta or "paths" not in meta:
            raise _Damaged("meta/metadata holds no step and paths (not a jaxpg checkpoint)")
        state_meta = _json(step_dir, os.path.join("state", "_METADATA"))
        _check_arrays(os.path.join(step_dir, "state"), _array_names(state_meta),
                      bool(state_meta.get("store_array_data_equal_to_fill_value")))
    except _Damaged as found:
        return str(found)
    return None


def choose_step(directory: str | os.PathLike, steps: Sequence[int], step: int | None,
                api: str = "restore_checkpoint") -> int:
    """The step to restore: ``step`` if it is readable, else (``step=None``) the newest
    readable one of ``steps``, with one warning naming the damaged newer ones.

    Raises:
        FileNotFoundError: if ``steps`` is empty or ``step`` is not among them.
        ValueError: if ``step`` is damaged, or (``step=None``) every step is.
    """
    root = os.fspath(directory)
    found = sorted(steps, reverse=True)
    if not found:
        raise FileNotFoundError(f"{api}: no checkpoint under {root!r}.")
    if step is not None:
        if step not in found:
            raise FileNotFoundError(f"{api}: step={step} is not saved under {root!r}; the "
                                    f"steps found are {sorted(found)}.")
        problem = damage(os.path.join(root, str(step)))
        if problem is not None:
            readable = [s for s in found if s != step
                        and damage(os.path.join(root, str(s))) is None]
            hint = (f"pass step= one of the readable steps {readable}, or step=None for the "
                    "newest" if readable else "no other step is readable either")
            raise ValueError(f"{api}: the checkpoint at step={step} under {root!r} is "
                             f"damaged: {problem}; {hint}.")
        return step
    damaged: list[tuple[int, str]] = []
    for s in found:
        problem = damage(os.path.join(root, str(s)))
        if problem is None:
            if damaged:
                what = "; ".join(f"step={d}: {p}" for d, p in damaged)
                warnings.warn(f"{api}: skipping the damaged checkpoint"
                              f"{'s' if len(damaged) > 1 else ''} under {root!r} ({what}); "
                              f"restoring step={s}, the newest readable one.",
                              UserWarning, stacklevel=4)
            return s
        damaged.append((s, problem))
    what = "; ".join(f"step={d}: {p}" for d, p in damaged)
    raise ValueError(f"{api}: no readable checkpoint under {root!r}: the steps found, "
                     f"{sorted(found)}, are all damaged ({what}). Restore from a copy, or "
                     "remove them to start afresh.")
