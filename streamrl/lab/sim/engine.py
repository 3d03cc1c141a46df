"""The generation pool: continuous-batching instances in a discrete-event simulation.

Dataflow of one ``simulate_generation`` call::

    requests --dispatch policy--> per-instance queues (in the order policy's order)
    instance: admit from its queue while batch slots and KV cache allow
              -> decode steps (cost model) -> a request finishes -> admit the next ...
    finished requests --> the stream (finish time per request), consumed by the trainer model

Invariants: events sit on one heap of ``(time, seq, instance)`` (the simpy core, without
processes); between two events an instance's batch is fixed; a stale event is skipped.
Rebalancing (``Rebalancing``) runs the live SGS's check, ``scheduling.rebalance.plan_round``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from streamrl.scheduling.latency import LatencyModel
from streamrl.scheduling.rebalance import Unfinished, plan_round


class DecodeCost(Protocol):
    max_batch: int

    @property
    def kv_capacity_tokens(self) -> int: ...

    def step_s(self, batch: int, context_tokens: float) -> float: ...

    def prefill_s(self, tokens: float) -> float: ...

    def latency_model(self, mean_context: float) -> LatencyModel: ...


@dataclass(frozen=True)
class Rebalancing:
    """What the simulated SGS's rebalancing check reads.

    Rebalancing (beyond the paper; after Seer's critique of atomic dispatch) runs the live SGS's
    check, ``scheduling.rebalance.plan_round``, whenever an instance with free batch slots has
    an empty queue (``_Pool.steal_into``). What the check reads is what the SGS would read: the
    *predicted* lengths (the true ones if none are given), each running request's progress
    (interpolated within its instance's span), ``remaining_estimate``'s overshoot from the
    ``recent`` lengths. Left out: moves into an instance other than the one whose event is
    handled (the SGS checks on a timer, here on events)."""

    latency: LatencyModel
    """The latency model of the check (the live SGS: the instances' PTL profile)."""
    threshold: float = 0.25
    recent: Sequence[float] = ()
    """Recent output lengths (``remaining_estimate``'s overshoot for requests past their prediction)."""
    max_new_tokens: int | None = None
    """The requests' token budget; None: the batch's longest output."""
    running: bool = True
    """Running requests may move too (``generation.rebalance_running``)."""


@dataclass(frozen=True)
class GenResult:
    finish_s: np.ndarray
    """Completion time of each request, seconds after the call started."""
    instance: np.ndarray
    """Instance that finished each request."""
    busy_s: np.ndarray
    """Per instance: time from the start to its last completion."""
    preemptions: int
    steals: int

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max()) if len(self.finish_s) else 0.0


class _Instance:
    def __init__(self, idx: int, cost: DecodeCost, queue: Sequence[int]) -> None:
        self.idx, self.cost = idx, cost
        self.cap = cost.kv_capacity_tokens
        self.queue: deque[int] = deque(queue)
        self.step = 0  # decode steps done
        self.finish_step: dict[int, int] = {}  # running request -> step at which it finishes
        self.heap: list[tuple[int, int]] = []
        self.admitted: list[int] = []  # running, in admission order (newest last)
        self.adm_step: dict[int, int] = {}
        self.ctx_const = 0.0  # context sum = ctx_const + B * step
        self.pending_preempt = False
        self.last_t = 0.0
        self.span = (0.0, 0, 0.0, 0, 0.0)  # decode steps under way: (start time, start step, seconds, steps, prefill s)
        self.event = -1  # sequence number of its pending event (older ones are stale)

    def context(self) -> float:
        return self.ctx_const + len(self.finish_step) * self.step

    def steps_done_at(self, t: float) -> float:
        """Decode steps this instance has done by time ``t`` (its span's prefill first, then steps)."""
        t0, step0, dt, k, prefill = self.span
        if dt <= 0 or t >= t0 + dt:
            return float(step0 + k)
        return step0 + k * max(0.0, t - t0 - prefill) / (dt - prefill)


class _Pool:
    def __init__(self, prompt: np.ndarray, out: np.ndarray, done0: np.ndarray) -> None:
        self.prompt, self.out, self.gen0 = prompt, out, done0
        self.arrival = np.zeros(len(out))  # when each request reaches its instance's queue
        self.finish = np.zeros(len(out))
        self.where = np.full(len(out), -1)
        self.preemptions = 0
        self.steals = 0
        self.rebalancing: Rebalancing | None = None
        self.predicted, self.budget, self.recent = out, 0, []
        self.moved_running: set[int] = set()
        self.seq = 0  # event sequence numbers

    def steal_into(self, inst: _Instance, insts: list[_Instance], t: float) -> list[_Instance]:
        """The SGS's rebalancing check at ``t``, with ``inst`` (free slots, empty queue) the taker;
        returns the instances whose span was cut (they must be advanced again from ``t``).

        ``inst`` takes the requests the check moves to it: queued ones on other instances (they
        have not started, so moving them costs nothing) and, with ``Rebalancing.running`` (the
        live default), running ones, each at most once: the source stops it at the decode step
        in progress, its generated tokens go with it (``gen0``) and the taker prefills prompt +
        prefix, as the SGS's continuation does. The source then continues from that step at the
        check's time (its span of decode steps is cut; it loses less than one step), and its
        pending event becomes stale."""
        rb = self.rebalancing
        state: dict[str, list[Unfinished]] = {}
        for o in insts:
            done = int(o.steps_done_at(t))
            state[str(o.idx)] = (
                [Unfinished(str(r), float(self.predicted[r]), int(self.gen0[r] + done - o.adm_step[r]), self.budget,
                            True, rb.running and r not in self.moved_running and fs > done)  # not finishing now
                 for r, fs in o.finish_step.items()]
                + [Unfinished(str(r), float(self.predicted[r]), int(self.gen0[r]), self.budget, False, True)
                   for r in o.queue])
        moves = plan_round(state, rb.latency, inst.cost.max_batch, rb.threshold, self.recent, receivers={str(inst.idx)})
        cut: dict[int, _Instance] = {}
        for m in moves:
            rid, src = int(m.request_id), insts[int(m.src)]
            if rid in src.finish_step:  # running: stop it at the step in progress, its prefix goes along
                if src.idx not in cut:
                    src.step, src.pending_preempt, src.event = int(src.steps_done_at(t)), False, -1
                    cut[src.idx] = src
                generated = src.step - src.adm_step[rid]
                self.remove(src, rid)
                self.gen0[rid] += generated
                self.moved_running.add(rid)
            else:
                src.queue.remove(rid)
            inst.queue.append(rid)
            self.steals += 1
        return list(cut.values())

    def admit(self, inst: _Instance, rid: int) -> float:
        s = inst.step
        inst.finish_step[rid] = s + int(self.out[rid] - self.gen0[rid])
        heapq.heappush(inst.heap, (inst.finish_step[rid], rid))
        inst.admitted.append(rid)
        inst.adm_step[rid] = s
        ctx = self.prompt[rid] + self.gen0[rid]
        inst.ctx_const += ctx - s
        return inst.cost.prefill_s(ctx)

    def remove(self, inst: _Instance, rid: int) -> None:
        s0 = inst.adm_step.pop(rid)
        inst.ctx_const -= self.prompt[rid] + self.gen0[rid] - s0
        del inst.finish_step[rid]
        inst.admitted.remove(rid)

    def preempt(self, inst: _Instance) -> None:
        """The KV cache is full: the most recently admitted request is preempted (vLLM's recompute
        policy: it returns to the head of the queue and its prompt plus generated tokens are
        prefilled again on re-admission)."""
        rid = inst.admitted[-1]
        done = inst.step - inst.adm_step[rid]
        self.remove(inst, rid)
        self.gen0[rid] += done
        inst.queue.appendleft(rid)
        self.preemptions += 1


def simulate_generation(
    prompt_lens: Sequence[float],
    out_lens: Sequence[float],
    assignment: Sequence[int],
    queues_order: Sequence[Sequence[int]],
    costs: Sequence[DecodeCost],
    rebalance: Rebalancing | bool = False,
    predicted: Sequence[float] | None = None,
    arrivals: Sequence[float] | None = None,
) -> GenResult:
    """Run one generation call to completion.

    ``queues_order[i]`` lists the request ids of instance ``i`` in admission order (already
    ordered by the order policy); ``assignment`` is only used for checking. ``costs[i]`` is
    instance ``i``'s cost model. ``rebalance``: the check's settings, or True for the defaults
    with instance 0's latency model at the mean prompt length; ``predicted``: the lengths it
    believes (default: the true ones). ``arrivals``: when each request joins its queue (default:
    all at 0; each queue must then list its requests in arrival order): an instance admits a
    request only once it has arrived, and a span of decode steps ends at the first step after the
    next arrival, so it joins the running batch then (continuous batching). Partial rollout's
    next iteration arrives this way while the current one's tail still runs.
    """
    n = len(out_lens)
    pool = _Pool(np.asarray(prompt_lens, float), np.maximum(np.asarray(out_lens, float), 1), np.zeros(n))
    if rebalance is True:
        rebalance = Rebalancing(costs[0].latency_model(float(pool.prompt.mean()) if n else 0.0))
    if rebalance:
        pool.rebalancing = rebalance
        pool.predicted = pool.out.copy() if predicted is None else np.asarray(predicted, float)
        if len(pool.predicted) != n:
            raise ValueError(f"{len(pool.predicted)} predicted lengths for {n} requests")
        pool.budget = int(rebalance.max_new_tokens or pool.out.max(initial=1))
        pool.recent = sorted(float(x) for x in rebalance.recent)
    if arrivals is not None:
        pool.arrival = np.asarray(arrivals, float)
        if len(pool.arrival) != n:
            raise ValueError(f"{len(pool.arrival)} arrival times for {n} requests")
        for i, q in enumerate(queues_order):
            if any(pool.arrival[a] > pool.arrival[b] for a, b in zip(q, q[1:])):
                raise ValueError(f"instance {i}'s queue is not in arrival order")
    if sum(len(q) for q in queues_order) != n:
        raise ValueError(f"queues hold {sum(len(q) for q in queues_order)} requests, batch has {n}")
    for i, q in enumerate(queues_order):
        for rid in q:
            if assignment[rid] != i:
                raise ValueError(f"request {rid} queued on instance {i} but assigned to {assignment[rid]}")
    insts = [_Instance(i, c, q) for i, c, q in zip(range(len(costs)), costs, queues_order)]
    events: list[tuple[float, int, int]] = []  # (time, sequence number, instance)
    for inst in insts:
        _advance(pool, inst, insts, 0.0, events)
    while events:
        t, seq, i = heapq.heappop(events)
        if seq == insts[i].event:  # else stale: a rebalancing check cut that span
            _advance(pool, insts[i], insts, t, events)
    busy = np.array([inst.last_t for inst in insts])
    return GenResult(pool.finish, pool.where, busy, pool.preemptions, pool.steals)


def _advance(pool: _Pool, inst: _Instance, insts: list[_Instance], t: float, events: list, check: bool = True) -> None:
    """Handle an instance's event at time ``t``: finish, preempt, admit, schedule the next one.

    The next event is the first of: a running request finishes, the KV cache fills, or (with
    arrivals) the next request arrives."""
    while inst.heap and inst.heap[0][0] <= inst.step:
        fs, rid = heapq.heappop(inst.heap)
        if inst.finish_step.get(rid) != fs:
            continue  # stale entry of a preempted request
        pool.remove(inst, rid)
        pool.finish[rid], pool.where[rid] = t, inst.idx
        inst.last_t = t
    if inst.pending_preempt and len(inst.finish_step) > 1:
        pool.preempt(inst)
    inst.pending_preempt = False
    prefill = 0.0
    if check and pool.rebalancing is not None and not inst.queue and len(inst.finish_step) < inst.cost.max_batch:
        for src in pool.steal_into(inst, insts, t):
            _advance(pool, src, insts, t, events, check=False)  # from the step it was stopped at
    while len(inst.finish_step) < inst.cost.max_batch:
        if not inst.queue:
            break
        rid = inst.queue[0]
        if pool.arrival[rid] > t:
            break  # not there yet
        need = pool.prompt[rid] + pool.gen0[rid]
        if inst.finish_step and inst.context() + need + len(inst.finish_step) + 1 > inst.cap:  # room for a step
            break
        inst.queue.popleft()
        prefill += pool.admit(inst, rid)
    while inst.heap and inst.finish_step.get(inst.heap[0][1]) != inst.heap[0][0]:
        heapq.heappop(inst.heap)
    head_arrival = pool.arrival[inst.queue[0]] if inst.queue else -1.0
    if not inst.finish_step:
        if head_arrival > t:  # idle until the next request arrives
            inst.span = (t, inst.step, 0.0, 0, 0.0)
            pool.seq += 1
            inst.event = pool.seq
            heapq.heappush(events, (float(head_arrival), pool.seq, inst.idx))
        return
    while True:
        b = len(inst.finish_step)
        c0 = inst.context()
        k_cap = math.floor((inst.cap - c0) / b)
        if k_cap > 0 or b == 1:
            break
        pool.preempt(inst)  # already full: preempt the newest now (it is not re-admitted this event)
        while inst.heap and inst.finish_step.get(inst.heap[0][1]) != inst.heap[0][0]:
            heapq.heappop(inst.heap)
    k = inst.heap[0][0] - inst.step
    if k_cap < k and b > 1:
        k, inst.pending_preempt = k_cap, True
    if head_arrival > t:  # end the span at the first step after the next arrival: it joins then
        s1 = inst.cost.step_s(b, c0)
        k_arr = max(1, math.ceil((head_arrival - t - prefill) / s1)) if s1 > 0 else k
        if k_arr < k:
            k, inst.pending_preempt = k_arr, False
    # The batch is fixed until the event, so its k decode steps are charged in closed form:
    # context grows by b tokens a step and the step cost is linear in context, so the midpoint
    # is exact while one roofline term dominates.
    dt = prefill + k * inst.cost.step_s(b, c0 + b * (k - 1) / 2)
    inst.span = (t, inst.step, dt, k, prefill)
    inst.step += k
    pool.seq += 1
    inst.event = pool.seq
    heapq.heappush(events, (t + dt, pool.seq, inst.idx))
