"""safetensors files: lazy slices in (``safe_open(..., framework="numpy")``), streamed out.

:class:`CheckpointReader` resolves a tensor name to its file (through
``model.safetensors.index.json`` when the checkpoint is sharded) and reads only the slice
asked for. :class:`StreamWriter` writes one file tensor by tensor: the header (names,
dtypes, shapes, offsets) first, then each tensor's bytes as it arrives, so a writer holds
one tensor at a time, never the file's contents.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

__all__ = ["CheckpointReader", "StreamWriter", "DTYPES", "INDEX"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointReader:
    """Slices of the tensors of a Hugging Face checkpoint folder.

    Raises:
        FileNotFoundError: a folder with neither ``model.safetensors`` nor the index.
    """

    def __init__(self, folder: str, api: str):
        self.folder, self.api = folder, api
        index = os.path.join(folder, INDEX)
        self._files: dict[str, Any] = {}
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map = dict(json.load(f)["weight_map"])
        elif os.path.exists(os.path.join(folder, SINGLE)):
            with safe_open(os.path.join(folder, SINGLE), framework="numpy") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise FileNotFoundError(
                f"{api}: {folder!r} holds neither {SINGLE} nor {INDEX}; pass the folder "
                "save_pretrained(..., safe_serialization=True) wrote.")
        self.bytes_read = 0

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(f"{self.api}: the checkpoint in {self.folder!r} has no tensor "
                           f"{name!r}; is it the model its config.json describes?")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.folder, file), framework="numpy")
        return self._files[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]``, reading only that slice from its file."""
        part = self._slice(name)
        out = np.asarray(part[index])
        dtype = DTYPES.get(part.get_dtype())
        if dtype is not None and out.dtype != dtype and out.dtype.itemsize == dtype.itemsize:
            out = out.view(dtype)
        self.bytes_read += out.nbytes
        return out

    def close(self) -> None:
        for f in self._files.values():
            exit_ = getattr(f, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._files.clear()


class StreamWriter:
    """One safetensors file, written tensor by tensor in the order of ``entries``.

    Args:
        path: the file.
        entries: ``(name, shape, numpy dtype)`` of every tensor, in writing order.
    """

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected = []
        for name, shape, dtype in entries:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._expected.append((name, tuple(shape), np.dtype(dtype)))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        """Appends tensor ``name`` (the next one of ``entries``)."""
        want, shape, dtype = self._expected[self._next]
        if name != want or tuple(array.shape) != shape:
            raise ValueError(f"StreamWriter: expected {want} {shape}, got {name} "
                             f"{tuple(array.shape)}.")
        self._file.write(np.ascontiguousarray(array, dtype=dtype).tobytes())
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            raise ValueError(f"StreamWriter: {len(self._expected) - self._next} tensors were "
                             "not written.")
