"""The tiny CPU workload of ``streamrl bench modes`` in the simulator, from a measured profile.

``streamrl simulate modes`` closes the loop between the simulator and the live system: the same
``systems.run_system`` (same dispatch, order and pipelining code) runs on cost models read from
``streamrl profile``'s file instead of the roofline, on the workload of the bench config, and is
compared mode by mode with what ``streamrl bench modes`` measured (``compare_with_bench``).

Invariant: every assumption of the simulated tiny setup is printed by the command (the
``assumptions`` of ``simulate_tiny_modes``, whose docstring lists them); Ray's object-store hops
and actor RPCs are not modelled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from streamrl.modes import MODE_NAMES as MODES
from streamrl.scheduling.latency import LatencyModel, latency_from_dict
from streamrl.lab.sim import cost as C
from streamrl.lab.sim import systems as S
from streamrl.lab.sim.hardware import get_gpu
from streamrl.lab.sim.models import ModelShape
from streamrl.lab.sim.workload import Batch

WITHIN = 0.2
LENGTH_KEYS = ("length", "response_len", "num_response_tokens", "response_tokens", "out_len", "output_len", "resp_len")


def _lengths_from_rows(rows: list, where: str) -> list[float]:
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (int, float)):
            out.append(float(row))
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is neither a number nor an object: {row!r}")
        key = next((k for k in LENGTH_KEYS if k in row), None)
        if key is not None:
            out.append(float(row[key]))
        elif "output_ids" in row:
            out.append(float(len(row["output_ids"])))
        else:
            raise ValueError(f"{where}: row {i} has none of {LENGTH_KEYS} or output_ids (keys: {sorted(row)})")
    return out


def lengths_from_file(path: str | Path) -> list[float]:
    """Output lengths from a JSONL/samples file (one object per line with a length key, or with
    ``output_ids``), a JSON list or ``{"lengths": [...]}``, or plain numbers one per line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"lengths file {str(p)!r} not found")
    text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        found = bench_lengths(data)
        if found is None:
            raise ValueError(f"{p}: JSON object without a 'lengths' list")
        return found
    if isinstance(data, list):
        return _lengths_from_rows(data, str(p))
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} line {line_no}: neither JSON nor a number: {line[:60]!r}") from exc
    if not rows:
        raise ValueError(f"{p}: no lengths")
    return _lengths_from_rows(rows, str(p))


def bench_lengths(bench: dict) -> list[float] | None:
    """Output lengths a bench (or lengths) JSON records, if any: a top-level list under
    ``lengths`` / ``response_lengths`` / ``out_lens``, or per-row ``response_lengths``."""
    for key in ("lengths", "response_lengths", "out_lens", "sample_out_lens"):
        if isinstance(bench.get(key), list) and bench[key]:
            return _lengths_from_rows(bench[key], f"bench JSON {key!r}")
    per_row = [x for r in bench.get("rows", []) for x in (r.get("response_lengths") or [])]
    return [float(x) for x in per_row] or None


def synthetic_lengths(num_train: int = 4096, seed: int = 0) -> list[float]:
    """Reference-solution lengths of the synthetic task's training prompts, + 1 for EOS."""
    from streamrl.tasks.synthetic import SyntheticTask

    return [len(p.meta["solution"]) + 1.0 for p in SyntheticTask(num_train=num_train, num_eval=16, seed=seed).train_prompts()]


def synthetic_prompt_len(num_train: int = 4096, seed: int = 0) -> float:
    """Mean prompt tokens of the synthetic task: characters + BOS (character-level tokenizer)."""
    from streamrl.tasks.synthetic import SyntheticTask

    return float(np.mean([len(p.text) + 1 for p in SyntheticTask(num_train=num_train, num_eval=16, seed=seed).train_prompts()[:512]]))


@dataclass
class TinyWorkload:
    """``Workload``'s interface for the tiny task: fixed prompt length, replayed output lengths."""

    pool: np.ndarray
    num_prompts: int
    prompt_len: float
    max_len: int

    def sample(self, rng: np.random.Generator, length_scale: float = 1.0) -> Batch:
        outs = np.clip(np.round(rng.choice(self.pool, self.num_prompts) * length_scale), 1, self.max_len)
        return Batch(np.full(self.num_prompts, float(self.prompt_len)), outs, outs.copy())


def tiny_shape(profile: dict) -> ModelShape:
    """The tiny policy's shape (weight bytes for the push and switch models)."""
    s = profile.get("shape") or {"layers": 4, "q_heads": 4, "kv_heads": 2, "hidden": 128, "intermediate": 384,
                                 "vocab": 100, "tied_embeddings": True}
    return ModelShape(str(profile.get("model", "tiny")), int(s["layers"]), int(s["q_heads"]), int(s["kv_heads"]),
                      int(s["hidden"]), int(s["intermediate"]), int(s["vocab"]), int(s["hidden"]) // int(s["q_heads"]),
                      bool(s.get("tied_embeddings", True)))


WEIGHT_INSTALL_S = 0.005
"""Colocated switch: ``engine.update_weights`` of the tiny policy inside the colocated worker.
Source: the ``weight_load`` events of ``streamrl bench modes``' colocated timelines: 3-9 ms per
iteration."""


def profiled_train(section: dict) -> tuple[C.ProfiledTrain, str]:
    """The trainer cost of a profile section (the profile itself, or its ``"colocated"`` part).

    Call form when the section's ``train`` has it (``simulate_tiny_modes``, "Training"), else
    the combined ``train_tokens_per_s`` per token."""
    tr = section.get("train") or {}
    if tr.get("train_step_tokens_per_s") and tr.get("prepare_s_per_pass") is not None:
        train = C.ProfiledTrain(float(tr["train_step_tokens_per_s"]), 1, 1, float(tr["prepare_s_per_pass"]),
                                float(tr["prepare_s_per_padded_token"]), int(tr["micro_batch_tokens"]))
        return train, (f"prepare calls of {train.prepare_pass_s * 1e3:.2f} ms per pass + "
                       f"{train.prepare_token_s * 1e6:.1f} us per padded token (passes of {train.micro_batch_tokens} "
                       f"padded tokens), then optimizer steps at {train.tokens_per_s:.0f} tokens/s")
    if tr.get("prepare_s_per_unit") is not None:
        raise ValueError("the profile's trainer section has the per-unit prepare form of an older `streamrl profile`; "
                         "the live trainer now prepares each call in batched passes: re-run `streamrl profile`")
    tps = float(section.get("train_tokens_per_s") or tr.get("train_tokens_per_s") or 0.0)
    if not tps > 0:
        raise ValueError("the profile has no train_tokens_per_s (write it with `streamrl profile`)")
    return C.ProfiledTrain(tps, 1, 1), f"{tps:.0f} tokens/s (combined rate, per token)"


def prefill_tokens_per_s(section: dict) -> float:
    """Prompt tokens per second of admission + prefill (``"prefill"`` of a profile section), inf if absent."""
    tps = (section.get("prefill") or {}).get("tokens_per_s")
    return float(tps) if tps and float(tps) > 0 else math.inf


def ptl_context(profile: dict) -> float:
    """Mean context of a request in the profile's PTL runs: ``profile_decode_latency`` times
    ``new_tokens`` decode steps (minus the 1-token run) from random prompts of the profile's mean
    prompt length (rounded), so the context runs from the prompt to the prompt + ``new_tokens``."""
    return round(float(profile.get("prompt_len_mean") or 0.0)) + float(profile.get("new_tokens") or 32) / 2


def _deployment(shape: ModelShape, latency: LatencyModel, train: C.ProfiledTrain, instances: int,
                max_batch: int, prefill_tps: float = math.inf, switch_s: float | None = None,
                profiled_context: float = 0.0) -> S.Deployment:
    g = get_gpu("H800")  # only its links are read (weight bytes of a tiny model: microseconds)
    decode = C.ProfiledDecode(latency, prefill_tokens_per_s=prefill_tps, max_batch=max_batch,
                              context_s_per_token=latency.kv_ms_per_token / 1000.0, profiled_context=profiled_context)
    return S.Deployment(shape, g, instances, 1, g, 1, decode_override=decode, train_override=train,
                        switch_override=switch_s)


def _iteration_tokens_per_s(train: C.ProfiledTrain, seq_len: float, n: int) -> float:
    """Trainer tokens/s on ``n`` sequences of ``seq_len`` prepared in one call (an iteration of disagg-batch)."""
    return n * seq_len / train.train_s([seq_len] * n)


def simulate_tiny_modes(profile: dict, *, prompts_per_iter: int, n_samples: int, max_new_tokens: int,
                        lengths: Sequence[float], prompt_len: float | None = None, step_tokens: int = 2000,
                        num_instances: int = 1, max_batch: int = 64, dispatch: str = "round-robin",
                        iterations: int = 6, seed: int = 0, modes: Sequence[str] = MODES,
                        colocated_threads: int = 2, thread_scaling: Sequence[dict] | None = None) -> dict[str, Any]:
    """Simulated rows (one per mode) and the assumptions used, each of them printed:

    - **Workload**: ``prompts_per_iter x n_samples`` requests per iteration, every prompt of the
      profile's mean prompt length, output lengths drawn with replacement from ``lengths``
      clipped to ``max_new_tokens`` (the caller passes the first found of the bench JSON's
      lengths, ``--lengths``, the profile's ``sample_out_lens``, the synthetic task's reference
      solutions: ``len(solution) + 1`` for EOS).
    - **Generation**: ``num_instances`` instances with the profile's PTL(BS) plus its context
      term ``kv_ms_per_token`` beyond the PTL runs' own (``cost.ProfiledDecode``), at most
      ``max_batch`` running, FIFO admission, the config's dispatch policy; each admitted request
      costs the profile's measured admission + prefill (``"prefill"``).
    - **Training**: one trainer CPU with the profile's costs (``cost.ProfiledTrain``), best form
      first: each trainer call prepares its samples together in length-sorted passes of
      ``micro_batch_tokens`` at the fitted per-pass and per-padded-token costs, plus
      ``1 / train_step_tokens_per_s`` per token of optimizer steps; else
      ``train_tokens_per_s`` per token. The calls are the live controller's: the whole iteration
      in one call in disagg-batch and colocated; in the stream modes
      ``systems.call_stream_train``'s outbox rule (a sample finishing while the trainer is free
      goes alone, those finishing while it is busy go together), a step whenever
      ``step_tokens`` are buffered. The stream unit is one sample (PPO's).
    - **Colocated**: one worker with ``colocated_threads`` threads for both stages, as the live
      ``ColocatedWorker``. Its costs are the profile's ``"colocated"`` numbers (measured in the
      worker's process layout: ``profiling.measure.measure_colocated``) when it has them, else
      the 1-thread numbers scaled by the bench JSON's ``thread_scaling`` rows, else the 1-thread
      numbers. The switch between the stages (``WEIGHT_INSTALL_S``) is charged once per
      iteration.
    - **Overlap**: in stream-sync and stream-async an instance decodes while the trainer trains.
      The profile's ``"overlap"`` slowdowns (each stage timed while the other runs in another
      process, ``profiling.overlap``) scale their decode and trainer costs for the whole
      iteration, an upper bound of the interference (an iteration's ends run alone). Without
      them the stages are assumed not to slow each other down. disagg-batch and colocated run
      one stage at a time.
    - **Weights**: disaggregated pushes are charged for the tiny model's bytes on the
      simulator's links; Ray object-store hops and actor RPCs are not modelled.
    - **Timing window**: like the bench, ``iterations`` iterations from an idle pipeline."""
    latency = latency_from_dict(profile)
    shape = tiny_shape(profile)
    wl = _tiny_workload(profile, lengths, prompt_len, prompts_per_iter * n_samples, max_new_tokens)
    pool, p_len = wl.pool, wl.prompt_len
    train, train_desc = profiled_train(profile)
    prefill = prefill_tokens_per_s(profile)
    colo_lat, colo_train, colo_prefill, colo_source = _colocated_costs(profile, latency, train, prefill,
                                                                       colocated_threads, thread_scaling)
    ctx = ptl_context(profile)
    ov = profile.get("overlap") or {}
    gen_x, train_x = float(ov.get("decode_slowdown", 1.0)), float(ov.get("train_slowdown", 1.0))
    busy_lat, busy_train = _overlapped_costs(latency, train, gen_x, train_x)
    deps = {"disagg": _deployment(shape, latency, train, num_instances, max_batch, prefill, profiled_context=ctx),
            "colocated": _deployment(shape, colo_lat, colo_train, 1, max_batch, colo_prefill, WEIGHT_INSTALL_S, ctx),
            "overlapped": _deployment(shape, busy_lat, busy_train, num_instances, max_batch, prefill / gen_x,
                                      profiled_context=ctx)}
    rows = _simulate_rows(modes, deps, wl, dispatch, iterations, seed, step_tokens)
    seq = p_len + float(pool.mean())
    assumptions = {
        "requests_per_iter": wl.num_prompts, "prompt_len": p_len, "max_new_tokens": max_new_tokens,
        "mean_out_len": float(pool.mean()), "instances": num_instances, "max_batch": max_batch,
        "order": "fifo", "dispatch": dispatch, "trainer": train_desc,
        "train_tokens_per_s": _iteration_tokens_per_s(train, seq, wl.num_prompts),
        "stream_min_batch_tokens": step_tokens if step_tokens > 0 else "whole iteration",
        "colocated_threads": colocated_threads,
        "colocated_source": colo_source,
        "colocated_train_tokens_per_s": _iteration_tokens_per_s(colo_train, seq, wl.num_prompts),
        "colocated_switch_s": WEIGHT_INSTALL_S,
        "iterations": iterations, "weight_push_s": S.push_s(deps["disagg"]),
        "kv_ms_per_token": latency.kv_ms_per_token, "colocated_kv_ms_per_token": colo_lat.kv_ms_per_token,
        "ptl_context": ctx,
        "overlap": ({"decode_slowdown": gen_x, "train_slowdown": train_x, "applied_to": "stream-sync, stream-async"}
                    if ov else "not in the profile: stages assumed not to slow each other down"),
        "prefill_s_per_request": p_len / prefill if math.isfinite(prefill) else 0.0,
        "colocated_prefill_s_per_request": p_len / colo_prefill if math.isfinite(colo_prefill) else 0.0,
    }
    return {"rows": rows, "assumptions": assumptions}


def _tiny_workload(profile: dict, lengths: Sequence[float], prompt_len: float | None, requests: int,
                   max_new_tokens: int) -> TinyWorkload:
    """``requests`` prompts of ``prompt_len`` (default: the profile's ``prompt_len_mean``) per
    iteration, output lengths drawn from the positive ``lengths`` clipped to ``max_new_tokens``."""
    pool = np.clip(np.asarray([x for x in lengths if x > 0], float), 1, max_new_tokens)
    if pool.size == 0:
        raise ValueError("no positive output lengths to simulate")
    p_len = float(prompt_len if prompt_len is not None else profile.get("prompt_len_mean") or 0.0)
    if not p_len > 0:
        raise ValueError("no prompt length: the profile has no prompt_len_mean and none was given")
    return TinyWorkload(pool, requests, p_len, max_new_tokens)


def _colocated_costs(profile: dict, latency: LatencyModel, train: C.ProfiledTrain, prefill: float,
                     colocated_threads: int, thread_scaling: Sequence[dict] | None
                     ) -> tuple[LatencyModel, C.ProfiledTrain, float, str]:
    """The colocated worker's decode latency, trainer and prefill rate, and where they come from:
    the profile's ``"colocated"`` numbers at ``colocated_threads``, else the profile's scaled by
    ``thread_scaling``, else the profile's own."""
    colo = profile.get("colocated") or {}
    colo_lat, colo_train, colo_prefill = latency, train, prefill
    base_threads = int(profile.get("threads", 1))
    speedup = scaling_ratio(thread_scaling, base_threads, colocated_threads)
    if colo.get("points") and int(colo.get("threads", colocated_threads)) == colocated_threads:
        colo_lat = latency_from_dict({"points": colo["points"], "kv_ms_per_token": colo.get("kv_ms_per_token", 0.0)})
        colo_train, colo_desc = profiled_train(colo)
        colo_prefill = prefill_tokens_per_s(colo)
        colo_source = f"profile 'colocated' numbers ({colo.get('threads')} threads): trainer {colo_desc}"
    elif speedup is not None:
        colo_lat = LatencyModel(tuple((b, ms / speedup["gen"]) for b, ms in latency.points), "scaled", latency.model, "cpu",
                                {"kv_ms_per_token": latency.kv_ms_per_token / speedup["gen"]})
        colo_train = replace(train, tokens_per_s=train.tokens_per_s * speedup["train"],
                             prepare_pass_s=train.prepare_pass_s / speedup["train"],
                             prepare_token_s=train.prepare_token_s / speedup["train"])
        colo_prefill = prefill * speedup["gen"]
        colo_source = (f"{base_threads}-thread profile scaled by the bench's thread_scaling {base_threads}->{colocated_threads} "
                       f"threads (generation x{speedup['gen']:.2f}, training x{speedup['train']:.2f})")
    else:
        colo_source = (f"no {colocated_threads}-thread numbers: assumed equal to the {base_threads}-thread numbers "
                       "(no speed-up from the extra CPUs)")
    return colo_lat, colo_train, colo_prefill, colo_source


def _overlapped_costs(latency: LatencyModel, train: C.ProfiledTrain, gen_x: float,
                      train_x: float) -> tuple[LatencyModel, C.ProfiledTrain]:
    """Decode latency and trainer costs while the other stage runs: decode ``gen_x`` and training
    ``train_x`` times as slow (the profile's overlap slowdowns)."""
    busy_lat = LatencyModel(tuple((b, ms * gen_x) for b, ms in latency.points), "overlapped", latency.model, "cpu",
                            {"kv_ms_per_token": latency.kv_ms_per_token * gen_x})
    busy_train = replace(train, tokens_per_s=train.tokens_per_s / train_x, prepare_pass_s=train.prepare_pass_s * train_x,
                         prepare_token_s=train.prepare_token_s * train_x)
    return busy_lat, busy_train


def _simulate_rows(modes: Sequence[str], deps: dict[str, S.Deployment], wl: TinyWorkload, dispatch: str,
                   iterations: int, seed: int, step_tokens: int) -> list[dict]:
    """One simulated row per mode, each mode on its deployment of ``deps``."""
    rows = []
    min_tokens = step_tokens if step_tokens > 0 else 1e15  # the live trainer steps every step_tokens (none: once)
    for mode in modes:
        spec = replace(S.get_system(mode), dispatch=dispatch, order="fifo")
        # The stream modes run both stages at once for most of an iteration: each at its overlapped
        # speed throughout (an upper bound of the interference: the ends of an iteration run alone).
        dep = deps["colocated" if spec.colocated else ("overlapped" if spec.pipeline != "batch" else "disagg")]
        res = S.run_system(spec, dep, wl, iterations=iterations, seed=seed, warmup=0, min_tokens_per_gpu=min_tokens)
        sps = res.samples_per_s
        rows.append({"mode": mode, "sim_samples_per_s": sps, "sim_step_s": wl.num_prompts / sps,
                     "sim_gen_s": res.mean("t_gen"), "sim_train_s": res.mean("t_train"),
                     "sim_mean_len": res.mean("mean_len")})
    return rows


def scaling_ratio(thread_scaling: Sequence[dict] | None, base: int, target: int) -> dict[str, float] | None:
    """Generation and training speed-ups from ``base`` to ``target`` threads in a bench JSON's
    ``thread_scaling`` rows (``{"threads", "gen_tokens_per_s", "train_tokens_per_s"}``), if both are there."""
    by = {int(r["threads"]): r for r in thread_scaling or [] if "threads" in r}
    if base == target or base not in by or target not in by:
        return None
    a, b = by[base], by[target]
    try:
        return {"gen": float(b["gen_tokens_per_s"]) / float(a["gen_tokens_per_s"]),
                "train": float(b["train_tokens_per_s"]) / float(a["train_tokens_per_s"])}
    except (KeyError, ZeroDivisionError, TypeError):
        return None


def compare_with_bench(rows: list[dict], bench: dict, within: float = WITHIN) -> list[dict]:
    """Add the bench's measured values and the sim/measured ratio of samples/s to each row."""
    measured = {r["mode"]: r for r in bench.get("rows", [])}
    out = []
    for r in rows:
        m = measured.get(r["mode"])
        r = dict(r)
        if m is None:
            r.update({"within_20pct": "not measured"})
        else:
            sps = float(m["samples_per_s"])
            ratio = r["sim_samples_per_s"] / sps if sps > 0 else math.inf
            r.update({"meas_samples_per_s": sps, "meas_step_s": float(m.get("step_s", math.nan)),
                      "meas_gen_s": float(m.get("gen_s", math.nan)), "meas_train_s": float(m.get("train_s", math.nan)),
                      "meas_mean_len": float(m["tokens_per_s"]) / sps if sps > 0 and "tokens_per_s" in m else math.nan,
                      "ratio": ratio, "within_20pct": "yes" if abs(ratio - 1.0) <= within else "no"})
        out.append(r)
    return out
