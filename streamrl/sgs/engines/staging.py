"""The files the vLLM engine hands vLLM, kept in a work dir under shm (``/dev/shm``).

    engine start:    stage_checkpoint(model, workdir) -> a checkpoint dir vLLM loads
                     checkpoint_shapes(dir)            -> name -> shape (headers only), for checks
    update_weights:  write_safetensors(update_dir/model.safetensors, state_dict)
                     -> vLLM's ``reload_weights`` reads the dir
    engine start:    remove_stale_workdirs(shm_root)   -> work dirs of dead processes removed

Pure file handling: no vLLM import, testable anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def stage_checkpoint(model: Any, workdir: Path) -> Path:
    """A checkpoint directory vLLM can load: ``model`` itself if it is one, else the
    transformers model saved under ``workdir``."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={str(model)!r}: no config.json there (expected a Hugging Face "
                                    "checkpoint directory)")
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model={str(model)!r}: no *.safetensors weights there")
        return path
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a checkpoint directory or a transformers model, got {type(model).__name__}")
    path = workdir / "checkpoint"
    model.save_pretrained(path)
    return path


def remove_stale_workdirs(root: Path) -> None:
    """Remove work dirs left in shm by engines whose process is gone (a Ray actor killed with
    ``ray.kill`` never runs ``shutdown``). The dir name carries the owner's pid."""
    for d in root.glob("streamrl-vllm-*"):
        parts = d.name.split("-")
        pid = next((int(x) for x in reversed(parts[:-1]) if x.isdigit()), None)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every safetensors file of a checkpoint (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(meta["shape"])
    return shapes


def write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` as one safetensors file, each tensor's bytes straight from its storage.

    ``safetensors.torch.save_file`` refuses tensors that share storage, which every tensor of a
    flat weight buffer does (they are views of one buffer) and tied weights do: this writer
    needs no copy for either. Writes to a temporary name and renames, so a reader never sees a
    half-written file."""
    import numpy as np
    import torch

    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {t.dtype}, not one of {sorted(_ST_DTYPES)}")
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.numel()]}
        blobs.append(raw)
        offset += raw.numel()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(memoryview(np.asarray(raw.numpy())))
    os.replace(tmp, path)
