"""FSDP2 on two gloo CPU ranks with SmolLM2-135M-Instruct (``make install-smollm2``): meta-device
start, then a sharded checkpoint (``trainer.sharded_ckpt``) against the full state gathered on
rank 0: seconds, file sizes and each rank's peak resident memory (docs/results.md)."""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLICY = ".cache/smollm2-135m-instruct"  # built by `streamrl train configs/smollm2.yaml` or models.recipes


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def run(rank, world, out, port):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from streamrl.trainer.fsdp import init_distributed, shard_policy
    from streamrl.trainer.meta_init import build_sharded_policy
    from streamrl.trainer.sharded_ckpt import load_sharded, save_sharded

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "gloo")
    t = time.time()
    model, info = build_sharded_policy(POLICY, lambda m: shard_policy(m), torch.device("cpu"))
    t_build = time.time() - t
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 1000, (1, 16))
    model(input_ids=ids).logits.float().mean().backward()
    opt.step()
    r0 = rss_mb()
    dist.barrier()
    t = time.time()
    save_sharded(model, opt, out / "sharded")
    dist.barrier()
    t_shard = time.time() - t
    r1 = rss_mb()
    t = time.time()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": msd, "opt": osd}, out / "full.pt")
    dist.barrier()
    t_full = time.time() - t
    r2 = rss_mb()
    t = time.time()
    load_sharded(model, opt, out / "sharded")
    dist.barrier()
    t_load = time.time() - t
    files = sorted((out / "sharded").glob("*.distcp"))
    if rank == 0:
        print(f"meta build {t_build:.1f}s largest full tensor {info.largest_full_tensor_bytes/1e6:.0f} MB of {info.model_bytes/1e6:.0f} MB")
        print(f"sharded save {t_shard:.2f}s files {[f'{f.stat().st_size/1e6:.0f} MB' for f in files]}; load {t_load:.2f}s")
        print(f"gathered save (rank 0 writes) {t_full:.2f}s file {(out/'full.pt').stat().st_size/1e6:.0f} MB")
    print(f"rank {rank} peak RSS MB: after build+step {r0}, after sharded save {r1}, after gathered save {r2}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from streamrl.weights.transfer import free_port

    out = Path(tempfile.mkdtemp())
    try:
        mp.spawn(run, args=(2, out, free_port()), nprocs=2)
    finally:
        shutil.rmtree(out)
