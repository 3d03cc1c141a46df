"""The checkpoint the vLLM engine hands vLLM at its start, kept in a work dir under shm (``/dev/shm``).

    engine start:    stage_checkpoint(model, workdir) -> a checkpoint dir vLLM loads
                     checkpoint_shapes(dir)            -> name -> shape (headers only), for checks
    engine start:    remove_stale_workdirs(shm_root)   -> work dirs of dead processes removed

Pure file handling: no vLLM import, testable anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

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
