"""The SGS's part in multi-turn trajectories (``agent.loop``): a finished turn goes to the
environment, not to the caller; the next turn goes back to the instance that ran the last one.

Invariants: a trajectory is one ledger record from submit to its completion (``sgs/ledger.py``:
``turn_done`` -> env -> ``next_turn``), so faults, rebalancing and the staleness bound treat it
as any request; only its last turn's end hands it out, whole.
"""

from __future__ import annotations

from streamrl.types import Completion, GenRequest


class Trajectories:
    def _turn_done(self, c: Completion) -> None:
        so_far = self.ledger.turn_done(c)
        if so_far is None:
            self.counters["sgs/duplicates"] += 1
        else:
            self.agent.on_turn(c, so_far)

    def _wait_for_envs(self, timeout: float) -> list[Completion]:
        self.agent.wait(timeout)
        return self._advance_trajectories()

    def _send_to(self, name: str, requests: list[GenRequest]) -> None:
        for r in requests:
            self.ledger.sent(r, name)
        self._gather({name: self.pool[name].actor.submit.remote(requests)}, "submit")

    def _advance_trajectories(self) -> list[Completion]:
        """Trajectories whose environment answered: each next turn goes to the instance that ran
        the last one (its KV prefix is there), or through dispatch if that one is gone; each
        finished trajectory is handed out whole."""
        out: list[Completion] = []
        for rid, ids, episode in self.agent.collect():
            if ids is None:
                done = self.ledger.finish(rid, episode)
                self._recent.append(done.generated)
                out.append(done)
                continue
            request = self.ledger.next_turn(rid, ids)
            home = self.ledger.record(rid).turn_instance
            if home in self.pool and not self.pool[home].retiring:
                self._send_to(home, [request])
            else:
                self._redispatch([request])
        return out

