"""streamrl against TRL's GRPOTrainer on the same model, data, reward and hyper-parameters.

Each system runs in its own process, in rounds whose order alternates (A B C, C B A, A B C, ...),
so a drift of the machine falls on every system alike. Both sides get: the same checkpoint, the
same JSONL file of arithmetic prompts (``question``/``answer`` columns, chat template applied by
each), the same reward function from one Python file (the response's last integer equals the
answer), ``prompts`` x ``samples`` completions per step, ``max_new_tokens``, temperature 1, a
constant learning rate, no KL term, token-mean loss, one optimizer step per batch. The figure
compared is samples per second of RL (TRL: ``trainer.train()``; streamrl: ``rl_seconds`` of its
summary, the loop without the held-out evaluations); start-up (Ray, model load) is reported apart.

    make install-smollm2 && .venv/bin/pip install -e ".[trl]"
    .venv/bin/python scripts/compare_trl.py --rounds 3 --out docs/bench/compare_trl.json

Needs TRL (the ``[trl]`` extra); the SmolLM2 checkpoint is built from its recipe when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("trl", "stream-async", "colocated")

REWARD_FILE = '''"""The comparison's reward: 1 when the response's last integer equals the answer."""
import re


def correct(response, answer, prompt, metadata):
    numbers = re.findall(r"-?\\d+", response.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def trl_correct(completions, answer, **kwargs):
    """TRL's calling convention: conversational completions, dataset columns as keyword lists."""
    return [correct(c[0]["content"] if isinstance(c, list) else c, a, "", {}) for c, a in zip(completions, answer)]
'''


def write_inputs(work: Path, seed: int, num_train: int) -> dict:
    """The prompt files and the reward file both systems read."""
    from streamrl.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(num_train=num_train, num_eval=16, seed=seed)
    work.mkdir(parents=True, exist_ok=True)
    paths = {"train": work / "train.jsonl", "eval": work / "eval.jsonl", "reward": work / "reward.py"}
    for name, prompts in (("train", task.train_prompts()), ("eval", task.eval_prompts())):
        with open(paths[name], "w") as f:
            for p in prompts:
                f.write(json.dumps({"question": p.text, "answer": p.answer}) + "\n")
    paths["reward"].write_text(REWARD_FILE)
    return {k: str(v) for k, v in paths.items()}


def run_trl(spec: dict) -> dict:
    """In this process: TRL's GRPOTrainer for ``spec['steps']`` steps; its timing and reward curve."""
    import importlib.util

    import torch
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer

    from streamrl.memory import peak_rss_mb

    torch.set_num_threads(spec["threads"])
    mod_spec = importlib.util.spec_from_file_location("compare_reward", spec["paths"]["reward"])
    reward = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(reward)
    data = load_dataset("json", data_files=spec["paths"]["train"], split="train")
    data = data.map(lambda r: {"prompt": [{"role": "user", "content": r["question"]}]})
    batch = spec["prompts"] * spec["samples"]
    args = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"], temperature=1.0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, loss_type="dapo", epsilon=0.2,
        num_iterations=1, max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True)
    t0 = time.time()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward.trl_correct, args=args, train_dataset=data)
    setup_s = time.time() - t0
    t1 = time.time()
    trainer.train()
    rl_s = time.time() - t1
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"rl_seconds": rl_s, "setup_seconds": setup_s, "samples": spec["steps"] * batch, "rewards": rewards,
            "peak_gb": {"trainer+generation": round(peak_rss_mb() / 1024, 2)}}


def run_streamrl(spec: dict, mode: str) -> dict:
    """``streamrl train`` as a user runs it; its summary's RL seconds and per-iteration rewards."""
    out = Path(spec["out_dir"])
    p = spec["paths"]
    overrides = [
        f"mode={mode}", f"run.seed={spec['seed']}", f"run.iterations={spec['steps']}", f"run.out_dir={out}",
        "run.overwrite=true", "run.eval_samples=1", "cluster.num_cpus=2", f"policy.path={spec['model']}",
        "task.name=file", f"task.train_path={p['train']}", f"task.eval_path={p['eval']}", "task.prompt_key=question",
        "task.answer_key=answer", f"task.reward={p['reward']}:correct", "task.num_eval=16",
        "generation.temperature=1.0", f"generation.max_new_tokens={spec['max_new_tokens']}",
        f"generation.n_samples={spec['samples']}", f"generation.prompts_per_iter={spec['prompts']}",
        "trainer.algo=grpo", f"trainer.lr={spec['lr']}", "trainer.kl_coef=0", "trainer.loss_agg=token-mean",
        "trainer.activation_checkpointing=true", "trainer.micro_batch_tokens=1024"]
    t0 = time.time()
    proc = subprocess.run([str(Path(sys.executable).parent / "streamrl"), "train", *overrides], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"streamrl {mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"rl_seconds": s["rl_seconds"], "setup_seconds": wall - s["rl_seconds"],
            "samples": s["trained_samples"], "rewards": s["rewards"],
            "peak_gb": {k: round(v / 1024, 2) for k, v in s.get("peak_memory_mb", {}).items()}}


def one_run(system: str, spec: dict) -> dict:
    """A fresh interpreter per run: TRL in a child of this script, streamrl through its CLI."""
    if system != "trl":
        return run_streamrl(spec, system)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])})
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m-instruct"))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--rounds", type=int, default=3, help="runs per system; the order alternates each round")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (the machine's cores)")
    ap.add_argument("--work", default=str(ROOT / "runs/compare_trl"))
    ap.add_argument("--out", default=None, help="write every run and the ratios here as JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_trl(json.loads(a.child))))
        return 0
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"--systems: {bad or a.systems!r} not among {', '.join(SYSTEMS)}")
    if a.rounds < 1 or a.steps < 1:
        raise SystemExit(f"--rounds={a.rounds} and --steps={a.steps} must be >= 1")
    if "trl" in systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[trl]'") from None
    from streamrl.models.recipes import recipe_for
    from streamrl.models.recipes import build as build_recipe

    model = Path(a.model).resolve()
    if not (model / "config.json").exists():
        recipe = recipe_for(model)
        if recipe is None:
            raise SystemExit(f"--model {str(model)!r}: no checkpoint there and no recipe for that name")
        build_recipe(recipe, model)
    work = Path(a.work).resolve()
    paths = write_inputs(work, a.seed, num_train=max(64, 4 * a.steps * a.prompts))
    base = {"model": str(model), "paths": paths, "steps": a.steps, "prompts": a.prompts, "samples": a.samples,
            "max_new_tokens": a.max_new_tokens, "lr": a.lr, "seed": a.seed, "threads": a.trl_threads}
    runs = []
    for r in range(a.rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            spec = {**base, "out_dir": str(work / f"{system}-{r}")}
            res = one_run(system, spec)
            res.update(system=system, round=r, samples_per_s=res["samples"] / res["rl_seconds"])
            runs.append(res)
            print(f"round {r} {system:>12}: {res['rl_seconds']:6.1f} s RL, {res['samples_per_s']:.3f} samples/s, "
                  f"start {res['setup_seconds']:.1f} s, reward/step {[round(x, 3) for x in res['rewards']]}",
                  flush=True)
    table = summarize(runs, systems)
    print(f"\n{'system':>12} | runs | RL s (median) | samples/s (median, min-max) | vs TRL | mean reward by step")
    for row in table:
        ratio = f"{row['vs_trl']:.2f}" if row["vs_trl"] is not None else "-"
        print(f"{row['system']:>12} | {row['runs']:4d} | {row['rl_seconds_median']:13.1f} | "
              f"{row['samples_per_s_median']:.3f} ({row['samples_per_s_min']:.3f}-{row['samples_per_s_max']:.3f})"
              f"{'':9}| {ratio:>6} | {row['reward_by_step']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"settings": {k: v for k, v in base.items() if k != "paths"},
                                           "machine": os.uname().nodename, "cpus": os.cpu_count(),
                                           "date": time.strftime("%Y-%m-%d"), "runs": runs, "table": table},
                                          indent=1))
        print(f"wrote {a.out}")
    return 0


def summarize(runs: list[dict], systems: list[str]) -> list[dict]:
    """Per system: the median samples/s, its range, the ratio of medians to TRL's, the mean reward curve."""
    table = []
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        rates = [r["samples_per_s"] for r in mine]
        steps = min(len(r["rewards"]) for r in mine)
        table.append({"system": system, "runs": len(mine),
                      "rl_seconds_median": statistics.median(r["rl_seconds"] for r in mine),
                      "samples_per_s_median": statistics.median(rates), "samples_per_s_min": min(rates),
                      "samples_per_s_max": max(rates),
                      "reward_by_step": [round(statistics.mean(r["rewards"][i] for r in mine), 3) for i in range(steps)]})
    trl = next((t for t in table if t["system"] == "trl"), None)
    for t in table:
        t["vs_trl"] = t["samples_per_s_median"] / trl["samples_per_s_median"] if trl else None
    return table


if __name__ == "__main__":
    sys.exit(main())
