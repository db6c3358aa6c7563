"""Hugging Face checkpoints in and out, on any layout, never whole on one host.

* :func:`from_hf` reads ``config.json``, builds the model abstractly (no arrays), lays it
  out on ``dims`` and creates each parameter with ``jax.make_array_from_callback``: the
  callback runs for this process's devices only and reads exactly their blocks from the
  safetensors files (lazy slices), so a process reads its share of the model.
* :func:`to_hf` writes ``config.json`` and the safetensors files (with
  ``model.safetensors.index.json`` when above ``max_shard_size``). Parameters are taken one
  at a time: each is gathered to the processes' hosts, its tensors are streamed into the
  file that holds them, and it is dropped before the next, so a host holds one parameter,
  never the model. The files are divided among the processes, each writing its own.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxpg.models.hf_config import config_from_hf, config_to_hf
from jaxpg.models.hf_names import hf_tensors, read_slice
from jaxpg.models.layout import parallelize, param_paths, value_of
from jaxpg.models.model import CausalLM
from jaxpg.models.safetensors_io import INDEX, SINGLE, CheckpointReader, StreamWriter

__all__ = ["from_hf", "to_hf"]

_IGNORED = ("rotary_emb.inv_freq",)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(size).strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def from_hf(path: str, *, dims: Any = None, dtype: Any = jnp.float32,
            sequence_parallel: bool = False, cp_method: str = "ring") -> CausalLM:
    """Loads a Hugging Face Llama 3, Qwen 3 or Qwen3-MoE checkpoint onto a layout.

    Args:
        path: the folder ``save_pretrained`` wrote (``config.json`` and
            ``model.safetensors`` or sharded files with ``model.safetensors.index.json``).
        dims: a ``jaxpg.ParallelDims`` (the model is laid out on it, each process reading
            only its devices' blocks), or None for one device.
        dtype: the parameters' and the computation's dtype.
        sequence_parallel, cp_method: as :func:`jaxpg.models.parallelize`.

    Returns:
        The ``CausalLM``; ``model(tokens)`` from host code gives the logits of one global
        batch.

    Raises:
        FileNotFoundError: no ``config.json`` or safetensors files in ``path``.
        ValueError: a config the modules do not implement, a checkpoint tensor of another
            shape than the config gives, or tensors the model has no place for.
        KeyError: a tensor the model needs that the checkpoint lacks.

    Example:
        >>> dims = jaxpg.ParallelDims(dp_shard=4, tp=2)
        >>> model = jaxpg.models.from_hf("Llama-3.2-1B", dims=dims, dtype=jnp.bfloat16)
        >>> logits = model(tokens)
    """
    api = "jaxpg.models.from_hf"
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{api}: {path!r} has no config.json; pass the folder "
                                "save_pretrained wrote.")
    with open(config_path) as f:
        config = config_from_hf(json.load(f))
    reader = CheckpointReader(path, api)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), dtype=dtype,
                                            param_dtype=dtype))
    layout = None
    if dims is not None:
        layout = parallelize(model, dims, sequence_parallel=sequence_parallel,
                             cp_method=cp_method, place=False)
    params = param_paths(model)
    _check_names(params, reader, config, api)
    device = jax.local_devices()[0]
    for name, var in params.items():
        shape = tuple(value_of(var).shape)

        def block(index, name=name, shape=shape):
            return read_slice(name, shape, index, reader.read).astype(dtype, copy=False)

        if layout is None:
            value = jax.device_put(block((slice(None),) * len(shape)), device)
        else:
            value = jax.make_array_from_callback(shape, layout.sharding(name), block)
        var.set_value(value)
    reader.close()
    return model


def _check_names(params: dict[str, Any], reader: CheckpointReader, config: Any,
                 api: str) -> None:
    wanted = {}
    for name, var in params.items():
        shape = tuple(value_of(var).shape)
        for hf, hf_shape, _ in hf_tensors(name, shape):
            wanted[hf] = hf_shape
    for hf, hf_shape in wanted.items():
        got = reader.shape(hf)
        if got != hf_shape:
            raise ValueError(f"{api}: checkpoint tensor {hf} has shape {got}, but the config "
                             f"gives {hf_shape}.")
    extra = sorted(n for n in reader.weight_map if n not in wanted
                   and not n.endswith(_IGNORED)
                   and not (config.tie_word_embeddings and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{api}: the checkpoint has tensors the model has no place for: "
                         f"{extra[:8]}{' ...' if len(extra) > 8 else ''}.")


def _host_copy(value: jax.Array) -> np.ndarray:
    """The whole parameter on this host (gathered from the other processes if need be)."""
    if value.is_fully_addressable:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def to_hf(model: CausalLM, path: str, *, max_shard_size: int | str = "5GB",
          dtype: Any = None) -> list[str]:
    """Writes ``model`` as a Hugging Face checkpoint (safetensors and ``config.json``).

    Call it on every process of the model's layout: each parameter is gathered to the
    hosts one at a time and the files are divided among the processes.

    Args:
        model: a ``CausalLM`` on any layout (or one device).
        path: the folder to write (created if need be).
        max_shard_size: the largest file, in bytes or as ``"5GB"``, ``"200MB"``; above it
            the tensors go to ``model-0000i-of-0000n.safetensors`` with an index.
        dtype: the files' dtype; None for the parameters' own.

    Returns:
        The safetensors file names, in order.
    """
    params = param_paths(model)
    entries = []  # (param path, hf name, hf shape, extract)
    for name, var in params.items():
        value = value_of(var)
        for hf, shape, extract in hf_tensors(name, tuple(value.shape)):
            entries.append((name, hf, shape, extract))
    out_dtype = np.dtype(dtype if dtype is not None else value_of(
        params["embed_tokens.embedding"]).dtype)
    limit = _parse_size(max_shard_size)
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, _, shape, _) in enumerate(entries):
        nbytes = int(np.prod(shape)) * out_dtype.itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    n = len(files)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    me, procs = jax.process_index(), jax.process_count()
    os.makedirs(path, exist_ok=True)
    file_of = {i: f for f, members in enumerate(files) for i in members}
    writers = {f: StreamWriter(os.path.join(path, names[f]),
                               [(entries[i][1], entries[i][2], out_dtype) for i in members])
               for f, members in enumerate(files) if f % procs == me}
    # one parameter at a time, in file order: gather it, stream its tensors, drop it
    order = sorted(range(len(entries)), key=lambda i: (file_of[i], i))
    current, host = None, None
    for i in order:
        name, hf, _, extract = entries[i]
        if name != current:
            current, host = name, None
            if any(file_of[j] % procs == me for j in order if entries[j][0] == name):
                host = _host_copy(value_of(params[name]))
            elif not value_of(params[name]).is_fully_addressable:
                _host_copy(value_of(params[name]))  # a collective: every process joins
        if file_of[i] % procs == me:
            writers[file_of[i]].write(hf, extract(host))
    for w in writers.values():
        w.close()
    if me == 0:
        dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_to_hf(model.config, dtype_name.get(out_dtype.name, "float32")),
                      f, indent=2)
        if n > 1:
            total = sum(int(np.prod(e[2])) * out_dtype.itemsize for e in entries)
            index = {"metadata": {"total_size": total},
                     "weight_map": {entries[i][1]: names[file_of[i]]
                                    for i in range(len(entries))}}
            with open(os.path.join(path, INDEX), "w") as f:
                json.dump(index, f, indent=2)
    if procs > 1:
        multihost_utils.sync_global_devices("jaxpg.models.to_hf")
    return names
