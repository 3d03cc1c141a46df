"""A generation instance: one Ray actor around one engine (one model replica).

    service --submit(requests)--> instance.engine admission queue
    service --poll(timeout)-----> blocks in the actor until >= 1 completion (or timeout), returns
                                  a batch of finished Completions: this is the stream
    service --update(handle)----> fetch the flat weight buffer (zero-copy from the object store),
                                  pause the engine, copy in place, resume: in-flight requests
                                  keep their KV cache and continue with the new weights

The actor is threaded (``max_concurrency``), so ``submit`` and ``update`` run while a ``poll``
is blocked waiting for a completion. The engine itself is thread-safe.
"""

from __future__ import annotations

import copy
import time

import ray


@ray.remote(max_concurrency=4)
class GenerationInstance:
    def __init__(self, name: str, cfg_tree: dict, policy_path: str, threads: int, seed: int) -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from streamrl.config import config_from_dict
        from streamrl.controller.colocated import engine_kwargs
        from streamrl.models.tiny import load_policy
        from streamrl.sgs.engines.base import make_engine

        cfg = config_from_dict(cfg_tree)
        self.name = name
        model, tokenizer = load_policy(policy_path)
        self.engine = make_engine(cfg.generation.engine, model.eval(),
                                  **engine_kwargs(cfg, tokenizer, threads, name, seed))
        self.events: list[tuple] = []

    def ready(self) -> str:
        return self.name

    def submit(self, requests) -> int:
        for r in requests:
            self.engine.add_request(r)
        return len(requests)

    def poll(self, timeout: float = 0.5, max_items: int | None = None):
        return self.engine.get_completions(timeout=timeout, max_items=max_items)

    def update(self, handle, version: int) -> dict:
        """Install the weights behind ``handle`` (a ``WeightHandle``) as ``version``."""
        from streamrl.weights.flat import unflatten
        from streamrl.weights.transfer import RayObjectStoreTransport

        t0 = time.time()
        fw = RayObjectStoreTransport().fetch(handle)
        t1 = time.time()
        self.engine.update_weights(unflatten(fw), version)
        t2 = time.time()
        self.events.append((self.name, "weight_load", -1, version, t0, t2))
        return {"fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": handle.nbytes, "start": t0, "end": t2}

    def update_state_dict(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def cancel(self, request_ids) -> int:
        return sum(bool(self.engine.cancel(r)) for r in request_ids)

    def num_pending(self) -> int:
        return self.engine.num_pending()

    def version(self) -> int:
        return self.engine.version

    def stats(self) -> dict:
        return self.engine.stats()

    def drain_events(self) -> list[tuple]:
        out, self.events = self.events, []
        return out

    def shutdown(self) -> None:
        self.engine.shutdown()


def copy_model(model):
    return copy.deepcopy(model).eval()
