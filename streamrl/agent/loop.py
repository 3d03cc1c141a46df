"""Multi-turn trajectories: what happens between two turns of one request.

``AgentLoop.build`` opens each trajectory (its env's ``reset``, or the prompt itself when only
tools are given) and returns one ``GenRequest`` per trajectory. The SGS hands every finished turn
to ``on_turn``; the env (or tools) answer off the driver's thread, and ``collect`` returns, per
trajectory, the tokens of its next turn's context (the SGS sends the continuation to the same
instance) or its end, with the episode's account. Invariants: a trajectory is one request from
submit to completion; its reward is the sum of its turn rewards (an env that raises or hangs: 0,
counted); ``task.max_turns``, the sampled-token budget ``generation.max_new_tokens`` and the
context ``task.max_prompt_tokens + generation.max_new_tokens`` each end it, counted as a cut.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass, field

from streamrl.types import Completion, GenRequest, Partial, Prompt

log = logging.getLogger(__name__)


@dataclass
class Trajectory:
    row: dict
    messages: list[dict]  # the conversation as rendered so far (before the running turn)
    prompt_len: int
    env_texts: list[str] = field(default_factory=list)  # assistant texts the env has stepped on
    turns: int = 0
    env_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    error: str | None = None
    cut: str | None = None
    turn_start: int = 0  # where the running turn's tokens start in the trajectory's output
    text: str = ""  # the last turn's assistant text
    stopped: bool = True  # the last turn ended with the eos token
    future: cf.Future | None = None
    generated: int = 0  # output tokens so far (env tokens included)
    sampled: int = 0  # of which the policy sampled
    budget: int = 0  # sampled tokens it may have in all (generation.max_new_tokens)
    instances: list[str] = field(default_factory=list)  # the instance that ran each turn


def row_of(prompt: Prompt) -> dict:
    """The data row an env is built from: the row's columns, its prompt text, answer and id."""
    return {**prompt.meta, "prompt": prompt.text, "answer": prompt.answer, "prompt_id": prompt.prompt_id}


class AgentLoop:
    def __init__(self, cfg, renderer, runner, tokenizer, has_env: bool) -> None:
        self.cfg, self.renderer, self.runner, self.tok = cfg, renderer, runner, tokenizer
        self.has_env = has_env
        self.max_turns = cfg.task.max_turns
        self.max_context = cfg.task.max_prompt_tokens + cfg.generation.max_new_tokens
        self.trajs: dict[str, Trajectory] = {}
        self._finished: list[tuple[str, None, dict]] = []
        self.counters = {k: 0 for k in ("trajectories", "turns", "env_errors", "env_timeouts", "tool_calls",
                                        "tool_errors", "cut_max_turns", "cut_max_new_tokens", "cut_context",
                                        "reset_failed")}

    # --------------------------------------------------------------------------------- opening
    def build(self, prompts: list[Prompt], n: int, iteration: int, tag: str, max_new_tokens: int,
              max_prompt_tokens: int) -> list[GenRequest]:
        """One request per trajectory (``n`` per prompt), its first prompt from the env's reset."""
        keys = [(p, j, f"{tag}{iteration}:{p.prompt_id}/{j}") for p in prompts for j in range(n)]
        reopened = [rid for _, _, rid in keys if rid in self.trajs]
        if reopened:  # its env would be reset under a trajectory in flight
            raise RuntimeError(f"trajectories {reopened[:3]} are already open")
        if self.has_env:
            futures = {rid: self.runner.submit(rid, "reset", row_of(p), []) for p, _, rid in keys}
            firsts = {rid: f.result() for rid, f in futures.items()}
        else:
            firsts = {rid: ("ok", {"messages": [{"role": "user", "content": p.text}]}) for p, _, rid in keys}
        out = []
        for p, j, rid in keys:
            kind, value = firsts[rid]
            if kind != "ok":
                self.counters["reset_failed"] += 1
                self._env_failed(kind)
                log.warning("trajectory %s: the environment's reset failed (%s); not generated", rid,
                            str(value).splitlines()[0] if value else kind)
                continue
            messages, ids = self.renderer.start(value["messages"])
            if len(ids) > max_prompt_tokens:
                log.warning("trajectory %s: first prompt has %d tokens > task.max_prompt_tokens=%d; not generated",
                            rid, len(ids), max_prompt_tokens)
                self.counters["cut_context"] += 1
                continue
            self.trajs[rid] = Trajectory(row_of(p), messages, len(ids), budget=max_new_tokens)
            self.counters["trajectories"] += 1
            out.append(GenRequest(request_id=rid, prompt_id=p.prompt_id, sample_idx=j, prompt_ids=tuple(ids),
                                  max_new_tokens=max_new_tokens))
        return out

    def owns(self, request_id: str) -> bool:
        return request_id in self.trajs

    # --------------------------------------------------------------------------------- turns
    def on_turn(self, c: Completion, so_far: Partial) -> None:
        """A turn finished (``so_far``: the trajectory's output up to and including it)."""
        t = self.trajs[c.request_id]
        t.turns += 1
        t.instances.append(c.instance)
        self.counters["turns"] += 1
        t.generated, t.sampled = len(so_far.output_ids), sum(so_far.mask())
        t.text = self.tok.decode(list(so_far.output_ids[t.turn_start:]), skip_special_tokens=True)
        t.stopped = c.finish_reason == "stop"
        if c.finish_reason == "length" or t.sampled >= t.budget:  # no budget left for another turn
            self._finish(c.request_id, cut="max_new_tokens")
            return
        t.future = self.runner.submit(c.request_id, "step", t.row, t.env_texts + [t.text])

    def pending(self) -> int:
        """Trajectories whose env is answering, or whose end is not collected yet."""
        return sum(t.future is not None for t in self.trajs.values()) + len(self._finished)

    def wait(self, timeout: float) -> None:
        futures = [t.future for t in self.trajs.values() if t.future is not None]
        if futures and not self._finished:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def collect(self) -> list[tuple[str, tuple[int, ...] | None, dict]]:
        """``(request_id, next ids, {})`` to continue, ``(request_id, None, episode)`` for an end."""
        out, self._finished = self._finished, []
        for rid, t in list(self.trajs.items()):
            if t.future is None or not t.future.done():
                continue
            kind, value = t.future.result()
            t.future = None
            if kind != "ok":
                self._env_failed(kind)
                t.error = f"environment {kind}: {str(value).splitlines()[0] if value else ''}".strip()
                log.warning("trajectory %s scored 0.0: %s", rid, t.error)
                out.append(self._finish(rid, collect=False))
                continue
            if value.get("env_step"):
                t.env_texts.append(t.text)
                t.reward += value["reward"]
            t.tool_calls += value.get("tool_calls", 0)
            t.tool_errors += value.get("tool_errors", 0)
            self.counters["tool_calls"] += value.get("tool_calls", 0)
            self.counters["tool_errors"] += value.get("tool_errors", 0)
            if value["done"]:
                out.append(self._finish(rid, collect=False))
                continue
            if t.turns >= self.max_turns:
                out.append(self._finish(rid, cut="max_turns", collect=False))
                continue
            new = value["messages"]
            ids = tuple(self.renderer.between(t.messages, new, t.stopped))
            if t.prompt_len + t.generated + len(ids) + 1 > self.max_context:
                out.append(self._finish(rid, cut="context", collect=False))
                continue
            t.messages = t.messages + [{"role": "assistant", "content": t.text}] + new
            t.env_tokens += len(ids)
            t.turn_start = t.generated + len(ids)
            out.append((rid, ids, {}))
        return out

    # --------------------------------------------------------------------------------- ending
    def _env_failed(self, kind: str) -> None:
        self.counters["env_timeouts" if kind == "timeout" else "env_errors"] += 1

    def _finish(self, rid: str, cut: str | None = None, collect: bool = True):
        t = self.trajs.pop(rid)
        t.cut = cut
        if cut:
            self.counters[f"cut_{cut}"] += 1
        if self.has_env:
            self.runner.submit(rid, "close", {}, [])
        episode = {"turns": t.turns, "env_tokens": t.env_tokens, "tool_calls": t.tool_calls,
                   "tool_errors": t.tool_errors, "cut": cut, "error": t.error, "instances": t.instances}
        if self.has_env:
            episode["env_reward"] = 0.0 if t.error else t.reward
        item = (rid, None, episode)
        if collect:
            self._finished.append(item)
        return item

    def drop(self, request_ids) -> None:
        """Forget trajectories that will not finish (their requests failed)."""
        for rid in request_ids:
            self.trajs.pop(rid, None)

    def metrics(self) -> dict[str, float]:
        out = {f"agent/{k}": float(v) for k, v in self.counters.items()}
        out.update({f"agent/env_{k}": float(v) for k, v in self.runner.counts.items()} if self.runner else {})
        return out

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
