"""The README's Python example runs as written: its code block, verbatim, in a fresh interpreter
beside a checkpoint and a data file of the kind it names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_qwen2_bpe_checkpoint

pytestmark = pytest.mark.slow  # a whole training run (its own local Ray cluster)

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Your own model, data and reward"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_trains_a_local_checkpoint_with_a_reward_from_the_script(tmp_path):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 15
    rows = [{"question": f"what is {a} plus {b}?", "gold": str(a + b)} for a in range(6) for b in range(4)]
    make_qwen2_bpe_checkpoint(tmp_path / "my-checkpoint", [f"{r['question']} {r['gold']}" for r in rows])
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = re.search(r"trained policy: (\S+)", proc.stdout).group(1)
    assert (tmp_path / final / "config.json").is_file() and (tmp_path / final / "tokenizer.json").is_file()
    metrics = [json.loads(x) for x in (tmp_path / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert sum(1 for r in metrics if "reward/mean" in r) == 2
