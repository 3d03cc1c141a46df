"""A new user's first run: their own Qwen2.5-style checkpoint (byte-level BPE, no BOS, chat
template, EOS list in generation_config.json), their own jsonl with its own column names, and
their own reward function named by path; stream-async, two iterations, and the final policy
reloads with the stock transformers classes and generates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import make_qwen2_bpe_checkpoint

pytestmark = pytest.mark.slow  # Ray, engines and the trainer: a whole training run

SYSTEM = "You add numbers."


def count_reward(response, answer, prompt, metadata):
    """The user's reward (imported by path into the reward workers): logs each call to a file."""
    with open(os.environ["STREAMRL_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"prompt": prompt, "answer": answer, "topic": metadata.get("topic")}) + "\n")
    return {"exact": 1.0 if answer in response else 0.0, "short": 0.1 if len(response) < 40 else 0.0}


def corpus_and_rows(n: int = 40) -> tuple[list[str], list[dict]]:
    rows = [{"q": f"what is {a} plus {b}?", "gold": str(a + b), "topic": "add"} for a in range(8) for b in range(5)][:n]
    corpus = [f"{r['q']} {r['gold']}" for r in rows] + ["<|im_start|>user\nhi<|im_end|>"] * 4
    return corpus, rows


def test_own_checkpoint_own_columns_own_reward_by_path_in_stream_async(ray_session, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.config import load_config
    from streamrl.controller.driver import train

    corpus, rows = corpus_and_rows()
    ckpt = tmp_path / "my-qwen"
    im_end, eot = make_qwen2_bpe_checkpoint(ckpt, corpus)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("STREAMRL_TEST_REWARD_LOG", str(log))
    out = tmp_path / "run"
    cfg = load_config(None, [
        "mode=stream-async", f"policy.path={ckpt}", "task.name=file", f"task.train_path={data}",
        "task.prompt_key=q", "task.answer_key=gold", "task.prompt_template=Q: {prompt}",
        f"task.system_prompt={SYSTEM}", f"task.reward={Path(__file__)}:count_reward", "task.num_eval=3",
        "run.eval_samples=1", "run.iterations=2", f"run.out_dir={out}", "generation.prompts_per_iter=3",
        "generation.n_samples=2", "generation.max_new_tokens=16", "logging.samples=true",
        "logging.backends=[console,jsonl]", "ranker.name=none"])
    lines: list[str] = []
    seen: list[int] = []
    summary = train(cfg, echo=lines.append, callbacks=[lambda it, metrics: seen.append(it)])
    assert seen == [0, 1]  # one callback per iteration, in order

    tok = AutoTokenizer.from_pretrained(ckpt)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 3 * 2
    for s in samples:  # the chat template with the system prompt, around the user's template; no BOS
        text = tok.decode(s["prompt_ids"])
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nQ: what is "), text
        assert text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
        assert s["prompt_ids"][0] is not None and tok.bos_token_id is None
        # generation stops on either EOS of generation_config.json, which then ends the response
        if s["finish_reason"] == "stop":
            assert s["output_ids"][-1] in (im_end, eot)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    # every scored sample called the reward once: training samples plus held-out before and after
    assert len(calls) == len(samples) + 2 * 3
    assert all(c["prompt"].startswith("Q: what is ") and c["topic"] == "add" for c in calls)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_iter = [r for r in records if "reward/mean" in r]
    assert len(per_iter) == 2 and all("reward/component/exact" in r and "reward/component/short" in r
                                      for r in per_iter)
    assert all(r["reward/errors"] == 0 for r in per_iter)
    assert any(k.startswith("train/entropy") for r in records for k in r) and any("train/lr" in r for r in records)

    peaks = summary["peak_memory_mb"]  # every process's peak, by role
    assert {"trainer", "driver"} <= set(peaks) and any(k.startswith("gen-") for k in peaks), peaks
    assert all(mb > 50 for mb in peaks.values()) and any(line.startswith("peak memory: trainer") for line in lines)
    private = summary["peak_private_mb"]  # sampled in every process: at most its resident peak
    assert set(private) == set(peaks) and all(0 < private[k] <= peaks[k] for k in private), private
    final = Path(summary["final_policy"])
    assert final == out / "policy" and any(str(final) in line for line in lines)
    model = AutoModelForCausalLM.from_pretrained(final)
    tok2 = AutoTokenizer.from_pretrained(final)
    assert tok2.chat_template and json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [im_end, eot]
    ids = tok2.apply_chat_template([{"role": "user", "content": "what is 1 plus 2?"}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
