"""`streamrl bench weights`: one weight update at a time across a shaped link, per method.

On a multi-site cluster (``streamrl.lab.cluster``: site A holds the trainer, site B at least two
nodes with a receiver each), a trainer actor takes real AdamW steps on a Qwen2-shaped model of
the configured size and publishes each version; every receiver installs it the way a
generation instance does. Methods (``METHODS``): ``naive``, ``tree`` and ``tree+delta``.

Invariant: what crossed the slow link is read from the link's interface counters, never
computed (``_update``). ``bench_weights`` builds the cluster (or uses one that is up), runs
``run_inside`` in the head node's network namespace, and takes the cluster down again.
``run_transfers`` reads the same figures from a finished run's timeline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import ray

METHODS = ("naive", "tree", "tree+delta")
"""How an update reaches the receivers::

    naive        every receiver fetches the trainer's object: one copy per remote node crosses
    tree         one relay per remote site fetches, the site's other nodes read the relay's copy
    tree+delta   the same tree, and a receiver that holds version v-1 fetches only the delta
"""


def model_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=True,
                       max_position_embeddings=256)


@ray.remote(num_cpus=0)
class BenchTrainer:
    """Real optimizer steps (AdamW, next-token loss on seeded random sequences) on a model of
    the configured size, and the trainer's weight publisher."""

    def __init__(self, cfg_kwargs: dict, lr: float, seed: int, threads: int, lora_rank: int = 0) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM(model_config(**cfg_kwargs))
        self.lora = lora_rank > 0
        if self.lora:  # the trainer's LoRA path: peft adapters, and only they are published
            from streamrl.config import LoraConfig
            from streamrl.models.lora import wrap

            self.model = wrap(self.model, LoraConfig(rank=lora_rank))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.gen = torch.Generator().manual_seed(seed)
        self.version = 0
        self.publisher = None

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def configure(self, wire_dtype: str, delta: bool, bucket_mb: float, lr: float | None = None) -> None:
        from streamrl.weights.engine import WeightPublisher

        self.publisher = WeightPublisher(wire_dtype, delta, bucket_mb)
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr

    def step(self) -> float:
        import torch

        t0 = time.perf_counter()
        x = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=self.gen)
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.version += 1
        return time.perf_counter() - t0

    def publish(self):
        from streamrl.models.lora import adapter_tensors

        state = adapter_tensors(self.model) if self.lora else self.model.state_dict()
        return self.publisher.publish(state, self.version)

    def delta_fraction(self) -> float | None:
        return self.publisher.last_delta_fraction

    def location(self):
        return self.publisher.location


@ray.remote(num_cpus=0, max_concurrency=2)
class WeightSink:
    """A generation instance's weight path without its engine: the same receiver, relay and
    install copy (``WeightReceiver`` + a copy into a model of the same shape, which is what
    pauses an engine; ``sgs.instance.GenerationInstance.update``)."""

    def __init__(self, name: str, cfg_kwargs: dict, bucket_mb: float, lora_rank: int = 0) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        from streamrl.weights.engine import WeightReceiver

        torch.set_num_threads(1)
        self.name = name
        self.model = Qwen2ForCausalLM(model_config(**cfg_kwargs))
        self.params = self.model.state_dict()
        self.merger = None
        if lora_rank:  # the engine's LoRA install: each adapter merged into the base weights in place
            from streamrl.config import LoraConfig
            from streamrl.models.lora import AdapterMerger, scale

            self.merger = AdapterMerger(self.model, scale(LoraConfig(rank=lora_rank)))
        self.receiver = WeightReceiver(name, keep=True, bucket_mb=bucket_mb)

    def reset(self) -> None:
        self.receiver.held = None

    def location(self):
        return self.receiver.location

    def update(self, handle, version: int, relay: bool = False) -> dict:
        import torch

        from streamrl.weights.engine import resolve
        from streamrl.weights.flat import unflatten

        handle = resolve(handle)
        fw, rec = self.receiver.receive(handle)
        t1 = time.perf_counter()
        state = unflatten(fw)
        if self.merger is not None:
            self.merger.merge(state, self.merger.check(state))
        else:
            with torch.no_grad():
                for name, t in state.items():
                    self.params[name].copy_(t)
        out = {"name": self.name, "kind": rec.kind, "bytes": rec.bytes, "link": rec.link, "src": rec.src,
               "fetch_start": rec.start, "fetch_s": rec.seconds, "apply_s": rec.apply_s,
               "load_s": time.perf_counter() - t1}
        if relay:
            out["handle"] = self.receiver.relay(handle, fw)
        return out


def _update(cl, trainer, sinks: dict, parents: dict) -> dict:
    """One version to every sink; what crossed the link and each site, from the counters.

    The slow link's bytes come from its interface counters (``/proc/1/net/dev``), not computed;
    bytes per site from each node's veth; the achieved bandwidth is the link bytes over the
    span of the fetches that crossed it."""
    from streamrl.lab.cluster import node_rx_bytes
    from streamrl.weights.engine import tree_calls

    handle = ray.get(trainer.publish.remote())
    a, b = cl.sites[0].name, cl.sites[1].name
    link0 = cl.link_bytes(a, b)
    nodes0 = {n.name: node_rx_bytes(n) for n in cl.nodes}
    t0 = time.time()
    refs = tree_calls(handle, parents, lambda n, src, relay: sinks[n].update.remote(src, handle.version, relay))
    results = ray.get(list(refs.values()))
    t1 = time.time()
    link1 = cl.link_bytes(a, b)
    site_bytes: dict[str, int] = {}
    for n in cl.nodes:
        site_bytes[n.site] = site_bytes.get(n.site, 0) + node_rx_bytes(n) - nodes0[n.name]
    cross = [r for r in results if "->" in r["link"]]
    span = (max(r["fetch_start"] + r["fetch_s"] for r in cross) - min(r["fetch_start"] for r in cross)) if cross else 0.0
    slow = link1[f"{a}->{b}"] - link0[f"{a}->{b}"]
    return {"version": handle.version, "model_bytes": handle.nbytes, "slow_link_bytes": slow,
            "slow_link_back_bytes": link1[f"{b}->{a}"] - link0[f"{b}->{a}"], "site_bytes": site_bytes,
            "cross_fetches": len(cross), "cross_span_s": span, "achieved_bytes_per_s": slow / span if span else 0.0,
            "all_instances_s": t1 - t0, "generation_pause_s": max(r["load_s"] for r in results),
            "kinds": sorted(r["kind"] for r in results), "delta_bytes": handle.delta_nbytes}


def run_inside(cluster_name: str, args) -> dict:
    """The bench itself, in the head's namespace (``RAY_ADDRESS`` set by ``cluster run``)."""
    from streamrl.lab.cluster import link_rate, load
    from streamrl.weights.tree import crossings, plan_tree

    cl = load(cluster_name)
    if len(cl.sites) < 2:
        raise SystemExit("bench weights needs two sites (e.g. --sites A:1,B:2)")
    home, remote = cl.sites[0], cl.sites[1]
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    kw = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
              intermediate=args.intermediate)
    trainer = BenchTrainer.options(resources={f"node_{cl.site_nodes(home.name)[0].name}": 0.001}).remote(
        kw, args.lr, args.seed, args.threads, args.lora_rank)
    sinks = {}
    for i, node in enumerate(n for n in cl.site_nodes(remote.name) for _ in range(args.per_node)):
        sinks[f"gen-{i}"] = WeightSink.options(resources={f"node_{node.name}": 0.001}).remote(f"gen-{i}", kw, args.bucket_mb, args.lora_rank)
    params = ray.get(trainer.params.remote())
    ray.get(trainer.configure.remote(args.wire, False, args.bucket_mb))
    source = ray.get(trainer.location.remote())
    where = dict(zip(sinks, ray.get([s.location.remote() for s in sinks.values()])))
    link = cl.link(home.name, remote.name)
    rows, updates = [], []
    for method in args.methods:
        delta = method.endswith("+delta")
        parents = plan_tree(source, where, method.split("+")[0], args.fanout)
        ray.get(trainer.configure.remote(args.wire, delta, args.bucket_mb))
        ray.get([s.reset.remote() for s in sinks.values()])
        ups = []
        for u in range(args.updates + (1 if delta else 0)):  # a delta run's first update is the full copy
            step_s = ray.get(trainer.step.remote())
            up = {"method": method, "update": u, "step_s": step_s, **_update(cl, trainer, sinks, parents)}
            up["delta_fraction"] = ray.get(trainer.delta_fraction.remote()) if delta and u else None
            ups.append(up)
        steady = ups[1:] if delta else ups
        mb = steady[0]["model_bytes"]
        mean = lambda key: sum(x[key] for x in steady) / len(steady)  # noqa: E731
        rows.append({"method": method, "model_bytes": mb, "planned_copies": sum(crossings(parents, source, where).values()),
                     "slow_link_bytes_per_update": mean("slow_link_bytes"),
                     "slow_link_copies_per_update": mean("slow_link_bytes") / mb,
                     "site_bytes_per_update": {s: sum(x["site_bytes"].get(s, 0) for x in steady) / len(steady)
                                               for s in (home.name, remote.name)},
                     "link_limit_bytes_per_s": link_rate(link), "achieved_bytes_per_s": mean("achieved_bytes_per_s"),
                     "achieved_of_limit": mean("achieved_bytes_per_s") / link_rate(link),
                     "all_instances_s": mean("all_instances_s"), "generation_pause_s": mean("generation_pause_s"),
                     "delta_fraction": (sum(x["delta_fraction"] for x in steady) / len(steady)) if delta else None,
                     "updates": len(steady)})
        updates += ups
    demo = None
    if args.demo_lr:
        ray.get(trainer.configure.remote(args.wire, True, args.bucket_mb, args.demo_lr))
        fractions = []
        for _ in range(args.updates + 1):
            ray.get(trainer.step.remote())
            ray.get(trainer.publish.remote())
            fractions.append(ray.get(trainer.delta_fraction.remote()))
        demo = {"lr": args.demo_lr, "delta_fractions": fractions[1:]}
    return {"cluster": cl.to_json(), "params": params, "lora_rank": args.lora_rank, "wire_dtype": args.wire, "lr": args.lr, "rows": rows,
            "updates": updates, "demo_lr": demo, "receivers": {n: [loc.node, loc.site] for n, loc in where.items()},
            "trainer": [source.node, source.site]}


def bench_weights(args) -> dict:
    """Build the cluster (unless ``--cluster`` names one that is up), run the bench inside its
    head's namespace, take the cluster down (also on failure) and return the result."""
    from streamrl.lab import cluster as C

    own = args.cluster is None
    name = args.cluster or "bw"
    if own:
        sites = C.parse_sites(args.sites)
        cl = C.up(sites, C.parse_links(args.link, sites), name=name, object_store_mb=args.object_store_mb)
    else:
        cl = C.load(name)
    try:
        print(cl.report(), flush=True)
        out = Path(cl.root) / "bench_weights.json"
        argv = [str(Path(sys.executable).with_name("streamrl")), "bench", "weights", "--inside", "--cluster", name,
                "--out", str(out), *args.passthrough]
        r = subprocess.run(cl.exec_argv(argv), timeout=args.timeout_s)
        if r.returncode != 0:
            raise SystemExit(f"bench weights failed inside the cluster (exit {r.returncode})")
        result = json.loads(out.read_text())
        result["link_measured_bytes_per_s"] = {f"{x.a}-{x.b}": x.measured_bytes_per_s for x in cl.links}
        return result
    finally:
        if own:
            C.down(name, cl.root)


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, e) - max(a0, s)) for s, e in spans)


def run_transfers(run_dir: str | Path) -> list[dict]:
    """Per weight version of a finished run (its ``timeline.json``): bytes that crossed between
    sites, the cross-site fetch, the time until every instance held it, the longest install
    pause, and how much of the fetching overlapped the trainer's training steps."""
    path = Path(run_dir) / "timeline.json"
    if not path.is_file():
        raise FileNotFoundError(f"no timeline.json in {str(run_dir)!r} (is it a finished run directory?)")
    events = json.loads(path.read_text())["events"]
    train = [(e["start"], e["end"]) for e in events if e["who"] == "trainer" and e["what"] == "train"]
    rows = []
    for v in sorted({e["version"] for e in events if e["what"] == "weight_fetch"}):
        fetch = [e for e in events if e["what"] == "weight_fetch" and e["version"] == v]
        load = [e for e in events if e["what"] == "weight_load" and e["version"] == v]
        cross = [e for e in fetch if "->" in e["meta"]["link"]]
        busy = sum(e["end"] - e["start"] for e in fetch)
        rows.append({"version": v, "instances": len(fetch), "kinds": "/".join(sorted({e["meta"]["kind"] for e in fetch})),
                     "cross_site_bytes": sum(e["meta"]["bytes"] for e in cross),
                     "cross_site_fetch_s": max((e["end"] - e["start"] for e in cross), default=0.0),
                     "all_instances_s": max(e["end"] for e in fetch + load) - min(e["start"] for e in fetch),
                     "pause_s": max((e["end"] - e["start"] for e in load), default=0.0),
                     "overlap_with_training": (sum(_overlap(e["start"], e["end"], train) for e in fetch) / busy)
                     if busy else 0.0})
    return rows
