"""Stage-event timeline: busy fractions, JSON round trip, Gantt picture."""

import threading

import pytest

from streamrl.metrics.timeline import Event, Timeline, busy_fraction, gantt, merge_intervals


def ev(who, what, start, end, iteration=0, version=0, **meta):
    return Event(who, what, iteration, version, start, end, meta)


def pipeline_timeline(iterations: int = 3) -> Timeline:
    """A hand-made stream-async run: two instances generate iteration i+1 while the trainer
    trains iteration i, then the weights move; gen-1 has a long tail, then waits."""
    tl = Timeline()
    t = 100.0
    for it in range(iterations):
        for i, tail in enumerate([0.0, 1.5]):
            tl.add(f"gen-{i}", "generate", it, it, t, t + 3.0 + tail, samples=8)
            tl.add(f"gen-{i}", "generate", it, it, t + 0.5, t + 2.0)  # a concurrent request
            tl.add(f"gen-{i}", "weight_load", it, it + 1, t + 5.0, t + 5.2)
        if it > 0:
            tl.add("trainer", "prepare", it - 1, it - 1, t, t + 0.5)
            tl.add("trainer", "train", it - 1, it - 1, t + 0.5, t + 4.0)
            tl.add("trainer", "weight_push", it - 1, it, t + 4.0, t + 4.8, bytes=4_000_000)
        tl.add("gen-1", "idle", it, it, t + 4.5, t + 5.0)
        t += 5.2
    return tl


def test_merge_intervals_joins_overlaps_and_touches_and_keeps_gaps():
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 6)]) == [(0, 2.5), (3, 4), (5, 6)]
    assert merge_intervals([]) == []


def test_busy_fraction_counts_overlaps_once_and_gaps_as_idle():
    evs = [
        ev("gen-0", "generate", 0, 4),
        ev("gen-0", "generate", 2, 5),  # overlaps the first: union is [0, 5]
        ev("gen-0", "weight_load", 8, 9),
        ev("gen-0", "idle", 5, 8),
        ev("trainer", "train", 0, 10),
    ]
    assert busy_fraction(evs, "gen-0", ["generate"], 0, 10) == pytest.approx(0.5)
    assert busy_fraction(evs, "gen-0", None, 0, 10) == pytest.approx(0.6)  # idle is not busy
    assert busy_fraction(evs, "gen-0", ["generate", "weight_load"], 0, 10) == pytest.approx(0.6)
    assert busy_fraction(evs, "gen-0", ["generate"], 3, 13) == pytest.approx(0.2)  # clipped to window
    assert busy_fraction(evs, "gen-1", None, 0, 10) == 0.0
    with pytest.raises(ValueError, match="t1 > t0"):
        busy_fraction(evs, "gen-0", None, 5, 5)


def test_summary_reports_busy_per_row_and_kind():
    tl = Timeline([ev("trainer", "train", 0, 6), ev("trainer", "weight_push", 5, 8), ev("gen-0", "generate", 0, 10)])
    s = tl.summary()
    assert s["timeline/wall_s"] == 10
    assert s["busy/trainer"] == pytest.approx(0.8)
    assert s["busy/trainer/train"] == pytest.approx(0.6)
    assert s["busy/trainer/weight_push"] == pytest.approx(0.3)
    assert s["busy/gen-0"] == pytest.approx(1.0)


def test_event_rejects_negative_duration():
    with pytest.raises(ValueError, match="start=2.*end=1"):
        ev("gen-0", "generate", 2.0, 1.0)


def test_timeline_collects_from_threads_and_merges_other_processes_lists():
    tl = Timeline()

    def worker(i):
        for j in range(50):
            tl.add(f"gen-{i}", "generate", j, 0, float(j), j + 0.5)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    remote = Timeline()
    with remote.span("trainer", "train", 0, 0) as meta:
        meta["tokens"] = 12
    tl.extend(remote.events())
    assert len(tl) == 201
    assert tl.rows()[0] == "trainer" and tl.events()[0].start == 0.0
    assert [e for e in tl.events() if e.who == "trainer"][0].meta == {"tokens": 12}
    with pytest.raises(TypeError, match="non-Event"):
        tl.extend([("trainer", "train")])


def test_json_round_trip(tmp_path):
    tl = pipeline_timeline()
    tl.to_json(tmp_path / "run" / "timeline.json")
    back = Timeline.from_json(tmp_path / "run" / "timeline.json")
    assert back.events() == tl.events()
    assert back.summary() == tl.summary()


def test_spilled_timeline_keeps_nothing_in_memory_and_reads_back_every_event(tmp_path):
    whole = pipeline_timeline(iterations=4)
    tl = Timeline(whole.events()[:5])
    spill = tmp_path / "timeline.jsonl"
    tl.spill_to(spill)  # the events held so far go first
    tl.extend(whole.events()[5:-1])
    last = whole.events()[-1]
    tl.add(last.who, last.what, last.iteration, last.version, last.start, last.end, **last.meta)
    assert tl._events == [] and len(tl) == len(whole)
    assert len(spill.read_text().splitlines()) == len(whole)
    assert tl.events() == whole.events() and tl.summary() == whole.summary()
    assert Timeline.from_json(spill).events() == whole.events()
    tl.unspill()
    assert not spill.exists() and tl.events() == whole.events() and len(tl) == len(whole)
    tl.add("trainer", "eval", 9, 9, 200.0, 201.0)  # in memory again
    assert len(tl) == len(whole) + 1 and not spill.exists()


def test_gantt_writes_png_with_one_row_per_worker(tmp_path):
    tl = pipeline_timeline(iterations=4)
    tl.add("gen-10", "generate", 1, 1, 106.0, 107.0)  # natural order: gen-10 after gen-1
    png = tmp_path / "gantt.png"
    rows = gantt(tl, png, title="stream-async (hand-made)")
    assert rows == ["trainer", "gen-0", "gen-1", "gen-10"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no events"):
        gantt(Timeline(), tmp_path / "empty.png")
    with pytest.raises(ValueError, match="gen-1"):
        gantt(tl, tmp_path / "bad.png", rows=["trainer", "gen-0"])
