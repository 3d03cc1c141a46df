"""The trainer state (policy parameters and AdamW moments) as a ``torch.distributed.checkpoint``
directory: every FSDP2 rank writes its own shards, nobody gathers them.

    save (every rank)   get_state_dict(model, opt) -> DTensor shards -> dcp.save -> <dir>/__<rank>_0.distcp
    load (every rank)   the same structure, dcp.load fills it (resharded to this world size), set_state_dict
    load (one process)  the same calls without a process group: the single-process trainer resumes
                        from an FSDP2 run's checkpoint, and an FSDP2 run of another world size too

Keys are the model's parameter names and the optimizer's state is keyed by them, so the files
do not depend on the world size or on FSDP. ``trainer.pt`` names the directory (``"sharded"``).
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write this rank's shards of ``model`` and ``opt`` (a collective on FSDP2 ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, directory: str | Path) -> None:
    """Fill ``model`` and ``opt`` from a ``save_sharded`` directory, whatever world size wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"{directory}: not a sharded trainer checkpoint (no .metadata)")
    model_sd, opt_sd = get_state_dict(model, opt)  # the structure to fill (Adam's moments included)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
