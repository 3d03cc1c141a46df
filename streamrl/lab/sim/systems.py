"""RL systems on a simulated cluster: how generation, training and weight pushes interleave.

``SYSTEMS`` names each system (a pipeline mode of ``streamrl.modes`` plus scheduling policies
and verl's settings); ``run_system`` simulates RL iterations of one on a ``Deployment`` (devices,
cost models, links) and ``run_partial`` the partial-rollout systems. Generation runs in
``sim.engine``, training on ``sim.cost``'s models, weight pushes on ``sim.hardware``'s links.

Invariant: dispatch, order and rebalancing are the live system's own code
(``streamrl.scheduling``); the staleness bound, partial rollout's admission and the trainer
actor's calls follow the live pipelines (each such function names the code it mirrors).
docs/design.md, "Simulator", and docs/simulator.md say what is modelled and what is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from streamrl.modes import get_mode
from streamrl.scheduling.dispatch import make_dispatch_policy
from streamrl.scheduling.order import make_order_policy
from streamrl.lab.sim import cost as C
from streamrl.lab.sim.engine import GenResult, Rebalancing, simulate_generation
from streamrl.lab.sim.hardware import Gpu, Link, get_gpu, node_link, weight_push_s
from streamrl.lab.sim.models import ModelShape, get_model
from streamrl.lab.sim.workload import Batch, Workload

MIN_TOKENS_PER_GPU = 8192
"""A dynamic batch starts once it holds this many tokens per training GPU (assumption: one
micro-batch of 8K tokens per device keeps it busy)."""
VERL_MFU_SCALE = 0.85
"""verl's FSDP trainer vs a Megatron-style 3D-parallel trainer: assumption (FSDP without tensor
parallelism reaches somewhat lower MFU at this scale); only the verl row uses it."""


@dataclass(frozen=True)
class SystemSpec:
    name: str
    mode: str
    """The pipeline mode it runs (``streamrl.modes``): colocated or not, what overlaps, staleness."""
    dispatch: str = "skewness-aware"
    order: str = "lpt"
    max_staleness: int | None = None
    """Overrides the mode's staleness bound (None: the mode's)."""
    rebalance: bool = False
    partial: bool = False
    """Partial rollout (stream-async): new weights are installed mid-generation and the next
    iteration's requests join the instances' batches once the current one leaves slots free and
    the staleness bound allows (``run_partial``)."""
    verl: bool = False
    """verl's engine and trainer settings (eager, 0.5 KV memory, FSDP MFU, states resident)."""
    description: str = ""

    @property
    def colocated(self) -> bool:
        return get_mode(self.mode).colocated

    @property
    def pipeline(self) -> str:
        """``batch`` | ``stream`` | ``async``."""
        return get_mode(self.mode).pipeline

    @property
    def staleness(self) -> int:
        return get_mode(self.mode).max_staleness if self.max_staleness is None else self.max_staleness


SYSTEMS: dict[str, SystemSpec] = {s.name: s for s in (
    SystemSpec("verl", "colocated", "round-robin", "fifo", verl=True, description="verl-like colocated"),
    SystemSpec("colocated", "colocated", "random", "fifo", description="our engine+trainer, time-shared"),
    SystemSpec("colocated-skew", "colocated", "skewness-aware", "lpt", description="colocated + skewness-aware scheduling"),
    SystemSpec("disagg-batch", "disagg-batch", description="disaggregated, no overlap"),
    SystemSpec("stream-sync", "stream-sync", description="dynamic-batch pipelining"),
    SystemSpec("stream-async", "stream-async", description="one-step async"),
    SystemSpec("stream-async-k2", "stream-async", max_staleness=2, description="beyond paper: staleness 2"),
    SystemSpec("stream-async-k4", "stream-async", max_staleness=4, description="beyond paper: staleness 4"),
    SystemSpec("stream-async-partial", "stream-async", partial=True,
               description="beyond paper: staleness 1, partial rollout (the next iteration fills the tail's free slots)"),
    SystemSpec("stream-async-k2-partial", "stream-async", max_staleness=2, partial=True,
               description="beyond paper: staleness 2, partial rollout"),
    SystemSpec("stream-async-k4-partial", "stream-async", max_staleness=4, partial=True,
               description="beyond paper: staleness 4, partial rollout"),
    SystemSpec("stream-async-rebal", "stream-async", rebalance=True, description="beyond paper: runtime rebalancing, queued and running requests (scheduling.rebalance)"),
)}


def get_system(name: str) -> SystemSpec:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; known: {sorted(SYSTEMS)}") from None


@dataclass(frozen=True)
class Deployment:
    """Where things run. Colocated systems use ``gen_*`` for both stages."""

    model: ModelShape
    gen_gpu: Gpu
    gen_gpus: int
    tp: int
    train_gpu: Gpu
    train_gpus: int
    cross_dc: Link | None = None
    decode_override: Any = None
    """A cost object (e.g. ``cost.ProfiledDecode``) replacing the roofline model."""
    train_override: Any = None
    switch_override: float | None = None
    """Seconds of one colocated switch, replacing ``switch_s``'s model (e.g. a measured install)."""

    @property
    def instances(self) -> int:
        return self.gen_gpus // self.tp

    def decode_cost(self, spec: SystemSpec) -> Any:
        if self.decode_override is not None:
            return self.decode_override
        frac = 0.5 if spec.verl else C.KV_MEM_FRACTION
        return C.RooflineDecode(self.gen_gpu, self.model, self.tp, frac, eager=spec.verl)

    def train_cost(self, spec: SystemSpec, devices: int | None = None) -> Any:
        if self.train_override is not None:
            return replace(self.train_override, devices=devices or self.train_gpus)
        return C.RooflineTrain(self.train_gpu, self.model, devices or self.train_gpus,
                               VERL_MFU_SCALE if spec.verl else 1.0)


def colocated_deployment(model: str, gpu: str, gpus: int, tp: int) -> Deployment:
    g = get_gpu(gpu)
    return Deployment(get_model(model), g, gpus, tp, g, gpus)


def _queues(batch: Batch, spec: SystemSpec, dep: Deployment, history: np.ndarray, seed: int, cost) -> tuple:
    """Dispatch one submitted batch: (assignment, per-instance queues in admission order)."""
    n_inst = dep.instances
    kwargs: dict[str, Any] = {}
    mean_ctx = float(batch.prompt_lens.mean() + history.mean() / 2)
    if spec.dispatch == "skewness-aware":
        kwargs = {"latency": cost.latency_model(mean_ctx), "max_batch_size": cost.max_batch, "history": history}
    elif spec.dispatch == "random":
        kwargs = {"seed": seed}
    assign = make_dispatch_policy(spec.dispatch, **kwargs).assign(batch.predicted.tolist(), n_inst)
    order = make_order_policy(spec.order)
    per_inst: list[list[int]] = [[] for _ in range(n_inst)]
    for rid, inst in enumerate(assign):
        per_inst[inst].append(rid)
    return assign, [[ids[j] for j in order.order([batch.predicted[r] for r in ids])] for ids in per_inst]


def generate_stream(batches: list[Batch], arrivals: list[float], spec: SystemSpec, dep: Deployment,
                    history: np.ndarray, seed: int = 0) -> GenResult:
    """Several ``submit`` calls into one pool: batch ``b`` is dispatched on its own (as the SGS
    does each call) and reaches the queues at ``arrivals[b]``, behind every earlier batch's
    requests (the live SGS gives requests admitted ahead a lower priority). Request ids are the
    batches' concatenated in order."""
    cost = dep.decode_cost(spec)
    offsets = np.cumsum([0] + [len(b.out_lens) for b in batches])
    assign_all: list[int] = []
    queues: list[list[int]] = [[] for _ in range(dep.instances)]
    for b, batch in enumerate(batches):
        assign, qs = _queues(batch, spec, dep, history, seed + b, cost)
        assign_all.extend(assign)
        for i, q in enumerate(qs):
            queues[i].extend(int(offsets[b] + r) for r in q)
    arr = np.concatenate([np.full(len(b.out_lens), float(a)) for b, a in zip(batches, arrivals)])
    return simulate_generation(np.concatenate([b.prompt_lens for b in batches]),
                               np.concatenate([b.out_lens for b in batches]), assign_all, queues,
                               [cost] * dep.instances, False, predicted=np.concatenate([b.predicted for b in batches]),
                               arrivals=arr)


def slots(dep: Deployment, spec: SystemSpec, batch: Batch) -> int:
    """Requests the instances can run at once: batch slots, or as many full-length sequences of
    this workload (mean prompt + mean output) as the KV cache holds, whichever is fewer."""
    cost = dep.decode_cost(spec)
    per_seq = float(batch.prompt_lens.mean() + batch.out_lens.mean())
    return dep.instances * max(1, min(cost.max_batch, int(cost.kv_capacity_tokens // max(per_seq, 1.0))))


def admission_times(batches: list[Batch], spec: SystemSpec, dep: Deployment, history: np.ndarray, seed: int = 0,
                    gate: list[float] | None = None) -> tuple[list[float], GenResult]:
    """Partial rollout's admission of each batch (``controller/strategies.py``, ``LookAhead``):
    batch j joins once fewer requests of the batches before it are unfinished than the instances
    have slots (``slots``), not before batch j-1, not before iteration j-k's step began (the
    pipeline looks k iterations ahead), and not before ``gate[j]`` (the staleness bound's
    version). Found batch by batch: a later batch cannot change when the earlier ones freed their
    slots. Returns the times and the simulation of all batches."""
    k = spec.staleness
    capacity = slots(dep, spec, batches[0])
    sizes = [len(b.out_lens) for b in batches]
    offsets = np.cumsum([0] + sizes)
    arrivals = [0.0 if gate is None else float(gate[0])]
    for j in range(1, len(batches)):
        gen = generate_stream(batches[:j], arrivals, spec, dep, history, seed)
        done = np.sort(gen.finish_s)
        n = len(done)
        freed = arrivals[j - 1] if n < capacity else float(done[n - capacity])
        ends = [float(gen.finish_s[offsets[b]:offsets[b + 1]].max()) for b in range(j)]
        step_start = ends[j - k - 1] if j - k - 1 >= 0 else 0.0
        arrivals.append(max(freed, step_start, arrivals[j - 1], 0.0 if gate is None else float(gate[j])))
    return arrivals, generate_stream(batches, arrivals, spec, dep, history, seed)


def stream_period(batch: Batch, spec: SystemSpec, dep: Deployment, history: np.ndarray, seed: int = 0) -> float:
    """Generation seconds per iteration in the steady state of partial rollout (the trainer never
    holds admission back): the planner's ``P_gen`` for such a system."""
    copies = spec.staleness + 3
    _, gen = admission_times([batch] * copies, spec, dep, history, seed)
    n = len(batch.out_lens)
    ends = [float(gen.finish_s[i * n:(i + 1) * n].max()) for i in range(copies)]
    return (ends[-1] - ends[1]) / (copies - 2)


def generate(batch: Batch, spec: SystemSpec, dep: Deployment, history: np.ndarray, seed: int = 0) -> GenResult:
    """One ``generate(prompts)`` call of the SGS under ``spec``'s dispatch and order policies."""
    cost = dep.decode_cost(spec)
    n_inst = dep.instances
    mean_ctx = float(batch.prompt_lens.mean() + history.mean() / 2)
    assign, queues = _queues(batch, spec, dep, history, seed, cost)
    rebalance = Rebalancing(cost.latency_model(mean_ctx), recent=history) if spec.rebalance else False
    return simulate_generation(batch.prompt_lens, batch.out_lens, assign, queues, [cost] * n_inst, rebalance,
                               predicted=batch.predicted)


def stream_train(finish: np.ndarray, seq_s: np.ndarray, free_at: float, min_batch_s: float) -> float:
    """Trainer consuming finished samples in dynamic batches; returns when the last batch ends.

    A batch starts when the trainer is free and at least ``min_batch_s`` of work has arrived (or
    every remaining sample has); it takes every sample finished by then.
    """
    order = np.argsort(finish, kind="stable")
    times, work = finish[order], seq_s[order]
    cum = np.concatenate([[0.0], np.cumsum(work)])
    n, p, tr = len(times), 0, free_at
    while p < n:
        q = int(np.searchsorted(cum, cum[p] + min_batch_s, side="left"))
        ready = max(tr, times[min(max(q, p + 1), n) - 1])
        q2 = max(int(np.searchsorted(times, ready, side="right")), p + 1)
        tr = ready + cum[q2] - cum[p]
        p = q2
    return tr


def call_stream_train(finish: np.ndarray, seq_lens: np.ndarray, seq_s: np.ndarray, prepare_s, free_at: float,
                      step_tokens: float) -> tuple[float, float]:
    """The live trainer actor fed by the stream controller (``controller/strategies.py``,
    ``trainer/actor.py``): ``(end of its last call, its busy seconds)``.

    Outbox rule: each finished sample is sent at once in a call of its own if the trainer is free
    when it finishes; otherwise it waits in the outbox, and the outbox goes as one call when the
    next sample finishes after the trainer became free, or when generation ends. The first call of
    an iteration is sent at its first finish even if the trainer is still busy (it queues in the
    actor's mailbox: stream-async). A call costs ``prepare_s(its seq_lens)`` (one batched prepare)
    plus the optimizer steps it fires: a step whenever the buffered samples hold ``step_tokens``
    tokens, in finish order (``trainer.dynamic_batches``), and the last call steps on the
    remainder; a step costs its samples' ``seq_s``.
    """
    order = np.argsort(finish, kind="stable")
    times, lens, work = finish[order], np.asarray(seq_lens, float)[order], seq_s[order]
    n, tr, busy = len(times), free_at, 0.0
    p, buf_tokens, buf_s = 0, 0.0, 0.0

    def call(q: int) -> float:
        nonlocal p, buf_tokens, buf_s
        cost = prepare_s(lens[p:q])
        for k in range(p, q):
            buf_tokens, buf_s = buf_tokens + lens[k], buf_s + work[k]
            if buf_tokens >= step_tokens or k == n - 1:
                cost, buf_tokens, buf_s = cost + buf_s, 0.0, 0.0
        p = q
        return cost

    for k in range(n):
        if k == 0 or tr <= times[k]:
            begin = max(times[k], tr)
            cost = call(k + 1)
            tr, busy = begin + cost, busy + cost
    if p < n:
        begin = max(times[-1], tr)
        cost = call(n)
        tr, busy = begin + cost, busy + cost
    return tr, busy


@dataclass
class RunResult:
    system: str
    iterations: list[dict[str, float]] = field(default_factory=list)
    samples_per_iter: int = 0
    warmup: int = 1

    @property
    def samples_per_s(self) -> float:
        it = self.iterations
        w = min(self.warmup, len(it) - 1)
        t0 = it[w - 1]["train_end"] if w > 0 else 0.0
        return self.samples_per_iter * (len(it) - w) / (it[-1]["train_end"] - t0)

    def mean(self, key: str) -> float:
        return float(np.mean([r[key] for r in self.iterations[self.warmup:] or self.iterations]))

    @property
    def train_busy(self) -> float:
        """The trainer's busy fraction over the timed iterations (its seconds / their wall time)."""
        it = self.iterations
        w = min(self.warmup, len(it) - 1)
        t0 = it[w - 1]["train_end"] if w > 0 else 0.0
        wall = it[-1]["train_end"] - t0
        return float(sum(r["t_train"] for r in it[w:]) / wall) if wall > 0 else float("nan")


def switch_s(spec: SystemSpec, dep: Deployment) -> float:
    """Per-iteration cost of switching colocated GPUs between training and generation.

    Resharding the trainer's weights into the engine's TP layout (each GPU receives
    ``weight_bytes / tp`` over its NIC), and for our colocated system, offloading training
    states to CPU during generation and reloading them (``offload_s``). verl keeps states
    resident and gives vLLM ``gpu_memory_utilization = 0.5`` with ``enforce_eager = True`` (its
    documented rollout defaults), and trains with FSDP at ``VERL_MFU_SCALE`` of our trainer's MFU."""
    if dep.switch_override is not None:
        return float(dep.switch_override)
    reshard = dep.model.weight_bytes / dep.tp / node_link(dep.gen_gpu).bandwidth
    if spec.verl or dep.train_override is not None:
        return reshard
    return reshard + 2 * dep.train_cost(spec).offload_s()


def push_s(dep: Deployment) -> float:
    return weight_push_s(dep.model.weight_bytes, dep.gen_gpu, dep.gen_gpus, dep.tp, dep.cross_dc)


def run_system(
    spec: SystemSpec, dep: Deployment, workload: Workload, iterations: int = 4, seed: int = 0,
    length_scales: list[float] | None = None, warmup: int = 1, min_tokens_per_gpu: float | None = None,
) -> RunResult:
    """Simulate ``iterations`` RL steps; the first ``warmup`` are excluded from throughput.
    ``min_tokens_per_gpu``: the stream-sync dynamic batch threshold (None: ``MIN_TOKENS_PER_GPU``).

    Per iteration ``i`` (one RL step over the global batch)::

        colocated (verl, colocated): gen(i) on all GPUs -> switch -> train(i) on all GPUs -> switch
        disagg-batch : gen(i) -> train(i) -> push W_i -> gen(i+1)               (nothing overlaps)
        stream-sync  : trainer consumes gen(i)'s samples as they finish, in dynamic batches of at
                       least MIN_TOKENS_PER_GPU * train_gpus tokens -> push W_i -> gen(i+1); with a
                       profiled trainer (``cost.ProfiledTrain``, the live CPU trainer) the samples
                       reach it in the live controller's calls instead (``call_stream_train``:
                       batched prepare per call, samples finishing while it is busy wait for its
                       next call)
        stream-async : gen(i) needs only W_{i-1-s} (staleness s = 1 in the paper): it starts when
                       the SGS is free and that version has arrived; pushes overlap the next
                       training step
    """
    if min_tokens_per_gpu is None:
        min_tokens_per_gpu = MIN_TOKENS_PER_GPU
    if spec.partial:
        return run_partial(spec, dep, workload, iterations, seed, length_scales, warmup, min_tokens_per_gpu)
    rng = np.random.default_rng(seed)
    history = workload.sample(np.random.default_rng(seed + 10_000)).out_lens  # a profiling run
    res = RunResult(spec.name, samples_per_iter=workload.num_prompts, warmup=warmup)
    ready = [0.0]  # ready[k + 1]: time W_k is installed on the SGS (W_-1, initial, at 0)
    gen_free = train_free = 0.0
    t_switch = switch_s(spec, dep) if spec.colocated else 0.0
    t_push = 0.0 if spec.colocated else push_s(dep)
    tcost = dep.train_cost(spec)
    for i in range(iterations):
        batch = workload.sample(rng, (length_scales or [1.0] * iterations)[i])
        if spec.colocated or spec.pipeline != "async":
            start = max(ready[i], train_free, gen_free)
        else:
            start = max(gen_free, ready[max(0, i - spec.staleness)])
        gen = generate(batch, spec, dep, history, seed + i)
        finish = start + gen.finish_s
        gen_end = float(finish.max())
        seq_s = tcost.seq_train_s(batch.seq_lens)
        t_train = tcost.prepare_s(batch.seq_lens) + float(seq_s.sum()) + tcost.optimizer_step_s()
        if spec.colocated:
            train_end = gen_end + t_switch + t_train
        elif spec.pipeline == "batch":
            train_end = max(gen_end, train_free) + t_train
        elif isinstance(tcost, C.ProfiledTrain):  # the live trainer actor: prepare calls, outbox rule
            train_end, t_train = call_stream_train(finish, batch.seq_lens, seq_s, tcost.prepare_s, train_free,
                                                   min_tokens_per_gpu * dep.train_gpus)
        else:
            min_s = float(np.median(seq_s)) * min_tokens_per_gpu * dep.train_gpus / float(np.median(batch.seq_lens))
            train_end = stream_train(finish, seq_s, max(train_free, start), min_s) + tcost.optimizer_step_s()
        ready.append(train_end + t_push)
        gen_free, train_free = gen_end, train_end
        history = batch.out_lens
        res.iterations.append({
            "i": i, "gen_start": start, "gen_end": gen_end, "train_end": train_end,
            "t_gen": gen.makespan_s, "t_train": t_train, "t_push": t_push, "t_switch": t_switch,
            "preemptions": gen.preemptions, "mean_len": float(batch.out_lens.mean()),
        })
    return res


def _train_chain(spec: SystemSpec, dep: Deployment, batches: list[Batch], finish: list[np.ndarray], starts: list[float],
                 min_tokens_per_gpu: float) -> tuple[list[float], list[float], list[float]]:
    """The stream-async trainer over batches whose samples finish at ``finish``: (train_end,
    t_train, ready) with ``ready[v]`` the time version v is installed on the SGS."""
    tcost = dep.train_cost(spec)
    t_push = push_s(dep)
    ready, ends, busy, train_free = [0.0], [], [], 0.0
    for i, batch in enumerate(batches):
        seq_s = tcost.seq_train_s(batch.seq_lens)
        if isinstance(tcost, C.ProfiledTrain):
            train_end, t_train = call_stream_train(finish[i], batch.seq_lens, seq_s, tcost.prepare_s, train_free,
                                                   min_tokens_per_gpu * dep.train_gpus)
        else:
            t_train = tcost.prepare_s(batch.seq_lens) + float(seq_s.sum()) + tcost.optimizer_step_s()
            min_s = float(np.median(seq_s)) * min_tokens_per_gpu * dep.train_gpus / float(np.median(batch.seq_lens))
            train_end = stream_train(finish[i], seq_s, max(train_free, starts[i]), min_s) + tcost.optimizer_step_s()
        ready.append(train_end + t_push)
        ends.append(train_end)
        busy.append(t_train)
        train_free = train_end
    return ends, busy, ready


def run_partial(spec: SystemSpec, dep: Deployment, workload: Workload, iterations: int = 4, seed: int = 0,
                length_scales: list[float] | None = None, warmup: int = 1,
                min_tokens_per_gpu: float | None = None, max_rounds: int = 200) -> RunResult:
    """Stream-async with partial rollout and staleness bound k, as the live pipeline runs it
    (``controller/strategies.py``, ``LookAhead``): iteration i's requests are admitted during
    iteration i-1's generation, once fewer of i-1's requests are unfinished than the instances
    have batch slots and version i - k is installed (new versions are installed mid-generation);
    they queue behind i-1's and join the running batches as slots free. The trainer takes
    iteration i's samples after i-1's last one (the step boundary).

    The version gate depends on training, and training on the finish times the admissions
    produce: the gates are found by fixed-point iteration, each round only moving a gate later,
    until every admission satisfies the bound against the simulation it produced."""
    if min_tokens_per_gpu is None:
        min_tokens_per_gpu = MIN_TOKENS_PER_GPU
    rng = np.random.default_rng(seed)
    history = workload.sample(np.random.default_rng(seed + 10_000)).out_lens
    scales = length_scales or [1.0] * iterations
    batches = [workload.sample(rng, scales[i]) for i in range(iterations)]
    offsets = np.cumsum([0] + [len(b.out_lens) for b in batches])
    k = spec.staleness
    gates = [0.0] * iterations
    for _ in range(max_rounds):
        arrivals, gen = admission_times(batches, spec, dep, history, seed, gate=gates)
        raw = [gen.finish_s[offsets[i]:offsets[i + 1]] for i in range(iterations)]
        gen_end = [float(f.max()) for f in raw]
        # the trainer gets iteration i's samples at the earliest when i-1's generation has ended
        finish = [raw[0]] + [np.maximum(raw[i], gen_end[i - 1]) for i in range(1, iterations)]
        ends, busy, ready = _train_chain(spec, dep, batches, finish, arrivals, min_tokens_per_gpu)
        new = [max(g, ready[max(0, i - k)]) for i, g in enumerate(gates)]
        if all(abs(a - b) <= 1e-9 for a, b in zip(new, gates)):
            break
        gates = new
    else:
        raise RuntimeError(f"run_partial: the version gates did not settle in {max_rounds} rounds")
    res = RunResult(spec.name, samples_per_iter=workload.num_prompts, warmup=warmup)
    for i in range(iterations):
        res.iterations.append({
            "i": i, "gen_start": arrivals[i], "gen_end": gen_end[i], "train_end": ends[i],
            "t_gen": gen_end[i] - max(arrivals[i], gen_end[i - 1] if i else 0.0), "t_train": busy[i],
            "t_push": push_s(dep), "t_switch": 0.0, "preemptions": gen.preemptions,
            "mean_len": float(batches[i].out_lens.mean()),
            "staleness_max": float(i - max(v for v in range(i + 1) if ready[v] <= arrivals[i] + 1e-9)),
        })
    return res
