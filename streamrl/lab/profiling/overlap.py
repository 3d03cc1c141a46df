"""How much the two stages slow each other down when they run at once on this machine.

In the overlapping modes (stream-sync, stream-async) an instance decodes while the trainer
trains, on the same CPUs' shared caches, memory bandwidth and (on a small machine) cores. Timed
alone, neither stage sees that. ``measure_overlap`` times each stage again while the other runs
in a separate process, exactly as the live system places them (one Ray actor each);
``simulate modes`` applies the slowdowns to the stream modes (``sim.live``).

``python -m streamrl.lab.profiling.overlap decode|train CONFIG_JSON THREADS SEQ_LEN`` is the load
process (``Load``): it prints ``ready`` once it works and runs until it is killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any, Sequence

import numpy as np

from streamrl.config import Config

LOAD_READY_TIMEOUT_S = 180.0


class Load:
    """A load process of ``kind`` (``decode`` | ``train``), stopped on exit."""

    def __init__(self, cfg: Config, kind: str, threads: int, seq_len: int) -> None:
        self._cfg_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(cfg.model_dump(), self._cfg_file)
        self._cfg_file.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "streamrl.lab.profiling.overlap", kind, self._cfg_file.name,
                                      str(threads), str(seq_len)], stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> "Load":
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], LOAD_READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.__exit__()
            raise RuntimeError(f"the {self.proc.args[3]} load process did not start (exit {self.proc.poll()})")
        return self

    def __exit__(self, *exc) -> None:
        import os

        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.unlink(self._cfg_file.name)


def measure_overlap(cfg: Config, model, tokenizer, samples: list, decode_points: Sequence[dict], train: dict,
                    batch_sizes: Sequence[int], prompt_len: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """The trainer timed under a decoding load, and decode latency under a training load, against
    the solo numbers ``train`` and ``decode_points`` of the same profile::

        load process: decode   (the configured engine, a full batch, EOS unreachable, refilled)
        this process: trainer  measure_train          -> train_slowdown = overlapped / alone
        load process: train    (the policy, AdamW steps on sequences of the workload's length)
        this process: decode   decode_rows            -> decode_slowdown = overlapped / alone
    """
    from streamrl.lab.profiling.measure import decode_engine, decode_rows, measure_train

    g_threads, t_threads = cfg.generation.threads_per_instance, cfg.trainer.threads
    seq_len = int(np.mean([len(s.completion.prompt_ids) + len(s.completion.output_ids) for s in samples]))
    with Load(cfg, "decode", g_threads, seq_len):
        busy_train = measure_train(cfg, samples, t_threads, repeats=repeats)
    engine = decode_engine(cfg, model, tokenizer, g_threads, cfg.run.seed)
    try:
        with Load(cfg, "train", t_threads, seq_len):
            busy_points, _ = decode_rows(engine, int(model.config.get_text_config().vocab_size), batch_sizes,
                                         prompt_len, new_tokens, cfg.run.seed, repeats)
    finally:
        engine.shutdown()
    solo = {int(p["batch_size"]): float(p["ms_per_token"]) for p in decode_points}
    per_batch = {int(p["batch_size"]): float(p["ms_per_token"]) / solo[int(p["batch_size"])]
                 for p in busy_points if solo.get(int(p["batch_size"]))}
    solo_train = train["prepare_s"] + train["train_step_s"]
    return {"train_slowdown": (busy_train["prepare_s"] + busy_train["train_step_s"]) / solo_train,
            "decode_slowdown": float(np.median(list(per_batch.values()))),
            "decode_slowdown_per_batch": per_batch, "train_under_decode": busy_train,
            "decode_points_under_train": busy_points, "load_seq_len": seq_len,
            "method": "each stage timed while the other runs in a separate process (streamrl.lab.profiling.overlap)"}


def _decode_load(cfg: Config, threads: int) -> None:
    from streamrl.models.tiny import load_policy
    from streamrl.lab.profiling.decode import random_prompts
    from streamrl.lab.profiling.measure import decode_engine
    from streamrl.types import GenRequest

    model, tok = load_policy(cfg.policy.path)
    engine = decode_engine(cfg, model.eval(), tok, threads, cfg.run.seed)
    vocab = int(model.config.get_text_config().vocab_size)
    batch = cfg.generation.max_requests_per_batch
    n = 0

    def add(k: int) -> None:
        nonlocal n
        for p in random_prompts(k, 16, vocab, n):
            engine.add_request(GenRequest(request_id=f"load-{n}", prompt_id="load", sample_idx=n, prompt_ids=p,
                                          max_new_tokens=cfg.generation.max_new_tokens))
            n += 1

    add(batch)
    print("ready", flush=True)
    while True:
        add(len(engine.get_completions(timeout=60)))


def _train_load(cfg: Config, threads: int, seq_len: int) -> None:
    import torch

    from streamrl.models.tiny import load_policy

    torch.set_num_threads(threads)
    model, _ = load_policy(cfg.policy.path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(cfg.run.seed)
    batch = max(1, cfg.trainer.micro_batch_tokens // max(seq_len, 1))
    print("ready", flush=True)
    while True:
        x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def main(argv: list[str]) -> None:
    from streamrl.config import config_from_dict

    kind, cfg_path, threads, seq_len = argv[0], argv[1], int(argv[2]), int(argv[3])
    with open(cfg_path) as f:
        cfg = config_from_dict(json.load(f))
    if kind == "decode":
        _decode_load(cfg, threads)
    elif kind == "train":
        _train_load(cfg, threads, seq_len)
    else:
        raise SystemExit(f"load kind {kind!r}: decode | train")


if __name__ == "__main__":
    main(sys.argv[1:])
