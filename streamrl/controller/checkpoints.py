"""The run's checkpoint: periodic, final, after an interruption, and resuming from it.

A checkpoint holds the trainer's state (weights, optimizer, version, lineage) and, beside it,
where the run is (iteration, prompt stream position) and the ranker's history. After an
interruption one is written only where it is exact: the trainer stepped on nothing past the
last iteration whose ``step`` returned.
"""

from __future__ import annotations

from pathlib import Path


class Checkpoints:
    def __init__(self, pipeline, out: Path, every: int, keep: bool) -> None:
        self.pipeline = pipeline
        self.path = out / "checkpoint"
        self.out, self.every, self.keep = out, every, keep

    def _extra(self, iteration: int, stream_state: dict) -> dict:
        """Where the run is, and the ranker's history."""
        return {"iteration": iteration, "stream": stream_state, "ranker": self.pipeline.ranker_state()}

    def resume(self, stream) -> int:
        """Load the checkpoint into the pipeline and ``stream``; returns the next iteration."""
        extra = self.pipeline.load(str(self.path))
        stream.load_state(extra["stream"])
        self.pipeline.restore_ranker(extra.get("ranker"))
        return int(extra["iteration"]) + 1

    def after_iteration(self, it: int, stream_state: dict) -> None:
        """Every ``run.checkpoint_every`` iterations (kept as ``checkpoints/iter-N`` with
        ``run.keep_checkpoints``), without waiting for the trainer where the mode allows."""
        if self.every and (it + 1) % self.every == 0:
            keep = str(self.out / "checkpoints" / f"iter-{it + 1}") if self.keep else None
            self.pipeline.checkpoint(str(self.path), self._extra(it, stream_state), keep_as=keep)

    def kept(self) -> str:
        """What a run stopped at once leaves behind, for the one-line message."""
        if (self.path / "trainer.pt").is_file():
            return f"stopped at once; the last checkpoint written is kept in {self.path}; continue with run.resume=true"
        return "stopped at once; no checkpoint had been written"

    def final(self, last_iteration: int, stream_state: dict) -> None:
        self.pipeline.save(str(self.path), self._extra(last_iteration, stream_state))

    def after_interrupt(self, done_it: int, start: int, done_stream: dict) -> str:
        """Save a checkpoint of iteration ``done_it`` if the trainer's state is exactly that (no
        step on the interrupted iteration); returns what happened, for the one-line message."""
        ckpt = self.path
        if done_it < start:
            return (f"stopped before iteration {start} finished; {ckpt} was left as it was"
                    if (ckpt / "trainer.pt").is_file() else f"stopped before iteration {start} finished; no checkpoint")
        if not self.pipeline.can_checkpoint_at(done_it):
            return (f"stopped during iteration {done_it + 1}, after the trainer had stepped on part of it: no exact "
                    f"checkpoint is possible, {ckpt} was left as it was")
        self.pipeline.save(str(ckpt), self._extra(done_it, done_stream))
        return f"checkpoint of iteration {done_it} saved in {ckpt}; continue with run.resume=true"
