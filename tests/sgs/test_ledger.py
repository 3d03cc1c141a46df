"""The request ledger alone (no Ray, no engine): states, moves with their prefix, exactly once."""

from __future__ import annotations

import pytest

from streamrl.sgs.ledger import RESUME_PRIORITY, IN_FLIGHT, Ledger, State
from streamrl.types import Completion, GenRequest, Partial


def _req(i: int, budget: int = 10) -> GenRequest:
    return GenRequest(f"p{i}/0", f"p{i}", 0, (1, 2, 3), budget)


def _done(req: GenRequest, out: tuple[int, ...], version: int = 0) -> Completion:
    return Completion(req.request_id, req.prompt_id, 0, tuple(req.prompt_ids), out, tuple(-0.5 for _ in out),
                      "stop", version, version, 1.0, 2.0, "gen-1")


def test_a_request_goes_queued_dispatched_running_done_and_is_handed_out_once():
    led, r = Ledger(), _req(0)
    rec = led.add(r, 7.0)
    assert rec.state is State.QUEUED and led.pending() == 1 and led.known(r.request_id)
    led.sent(r, "gen-0")
    assert rec.state is State.DISPATCHED and led.where() == {r.request_id: "gen-0"}
    assert led.counts(["gen-0", "gen-1"]) == {"gen-0": 1, "gen-1": 0}
    led.running([r.request_id], "gen-1")  # another instance's report changes nothing
    assert rec.state is State.DISPATCHED
    led.running([r.request_id], "gen-0")
    assert rec.state is State.RUNNING
    c = _done(r, (5, 6))
    assert led.complete(c) == c and rec.state is State.DONE and led.pending() == 0
    assert led.complete(c) is None  # a second completion of the same request is refused
    assert led.known(r.request_id)  # a resubmission would run it twice
    assert led.predicted(r.request_id) == 7.0


def test_a_moved_request_continues_from_its_prefix_and_is_joined_into_one_completion():
    led, r = Ledger(), _req(1, budget=10)
    led.add(r, 4.0)
    led.sent(r, "gen-0")
    part = Partial(r, (7, 8, 9), (-1.0, -1.0, -1.0), version_start=0, t_start=0.5, token_versions=(0, 0, 1))
    cont = led.preempted(part)
    rec = led.record(r.request_id)
    assert rec.state is State.QUEUED and rec.moved_running and rec.generated == 3
    assert cont.prompt_ids == (1, 2, 3, 7, 8, 9) and cont.max_new_tokens == 7 and cont.priority == RESUME_PRIORITY
    led.sent(cont, "gen-1")
    assert rec.state is State.MOVED and led.moved() == [r.request_id]
    tail = _done(cont, (4,), version=2)
    joined = led.complete(tail)
    assert joined.prompt_ids == (1, 2, 3) and joined.output_ids == (7, 8, 9, 4)
    assert joined.versions() == (0, 0, 1, 2) and joined.version_start == 0 and joined.t_start == 0.5
    assert led.moved() == []  # the prefix is not kept once joined


def test_a_request_preempted_twice_keeps_both_prefixes_in_order():
    led, r = Ledger(), _req(2, budget=10)
    led.add(r, 4.0)
    led.sent(r, "gen-0")
    first = led.preempted(Partial(r, (7,), (-1.0,), 0, 0.1))
    led.sent(first, "gen-1")
    second = led.preempted(Partial(first, (8, 9), (-1.0, -1.0), 1, 0.2))
    assert second.prompt_ids == (1, 2, 3, 7, 8, 9) and second.max_new_tokens == 7
    assert led.record(r.request_id).prefix.versions() == (0, 1, 1)


def test_a_request_that_had_not_started_moves_as_it_is():
    led, r = Ledger(), _req(3)
    led.add(r, 1.0)
    led.sent(r, "gen-0")
    assert led.preempted(Partial(r)) == r and not led.record(r.request_id).moved_running


def test_an_instance_lost_gives_back_what_it_held_and_nothing_else():
    led = Ledger()
    reqs = [_req(i) for i in range(4)]
    for i, r in enumerate(reqs):
        led.add(r, 1.0)
        led.sent(r, "gen-0" if i < 3 else "gen-1")
    moved = led.preempted(Partial(reqs[0], (9,), (-1.0,), 0, 0.0))
    led.sent(moved, "gen-0")
    back = led.take_from("gen-0")
    assert sorted(x.request_id for x in back) == ["p0/0", "p1/0", "p2/0"]
    assert next(x for x in back if x.request_id == "p0/0") == moved  # its continuation, not its start
    assert all(led.record(x.request_id).state is State.QUEUED for x in back)
    assert led.where()["p3/0"] == "gen-1"


def test_a_batch_ends_its_records_and_its_ids_are_remembered_for_a_few_batches():
    led = Ledger(remember_batches=2)
    batches = []
    for b in range(3):
        reqs = [_req(10 * b + i) for i in range(2)]
        for r in reqs:
            led.add(r, 1.0)
            led.sent(r, "gen-0")
            led.complete(_done(r, (1,)))
        led.end_batch([r.request_id for r in reqs], [r.request_id for r in reqs])
        batches.append(reqs)
    assert not led.known(batches[0][0].request_id)  # forgotten after two later batches
    assert led.known(batches[2][0].request_id) and led.pending() == 0


def test_with_no_instance_left_every_unfinished_request_fails():
    led = Ledger()
    for i in range(3):
        led.add(_req(i), 1.0)
    led.sent(_req(0), "gen-0")
    assert led.fail_all() == 3 and led.pending() == 0
    assert {led.record(f"p{i}/0").state for i in range(3)} == {State.FAILED}
    assert State.FAILED not in IN_FLIGHT and led.complete(_done(_req(0), (1,))) is None


def test_an_unknown_request_cannot_be_sent():
    with pytest.raises(KeyError):
        Ledger().sent(_req(9), "gen-0")
