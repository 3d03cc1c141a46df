"""scripts/gpu_check.py on a CPU with tiny shapes: every section runs, the profile loads.

The GPU run itself needs a lent GPU; this keeps the script's code (FSDP2 step at world size 1
over gloo, generation, the decode profile and its file format) working between such runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_gpu_check_shell_wrapper_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


@pytest.mark.slow
def test_gpu_check_tiny_cpu_run_writes_a_profile_the_simulator_loads(tmp_path):
    from streamrl.scheduling.latency import latency_from_dict

    out, summary = tmp_path / "profile.json", tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu",
                           "--batch-sizes", "1,2,4", "--new-tokens", "4", "--prompt-len", "8",
                           "--out", str(out), "--summary", str(summary)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary" in proc.stdout and "FAILED" not in proc.stdout
    results = json.loads(summary.read_text())
    assert results["trainer"]["ok"] and results["trainer"]["max_weight_change"] > 0
    assert results["generation"]["ok"] and results["generation"]["tokens_per_s"] > 0
    path = results["streamrl"]  # FSDPRank step -> FlatWeights -> CB instance, weights equal
    assert path["ok"] and path["max_weight_change"] > 0 and path["max_abs_diff_vs_trainer"] == 0
    assert path["versions"] == [1] and path["gen_tokens"] == 8 * 8
    profile = json.loads(out.read_text())
    model = latency_from_dict(profile)  # the format `streamrl profile` writes and the simulator reads
    assert [b for b, _ in model.points] == [1, 2, 4] and all(ms > 0 for _, ms in model.points)
    assert profile["device"] == "cpu" and profile["model"] == "tiny-shape-random"


def test_gpu_check_compares_with_the_simulators_roofline_for_catalogued_gpus():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    roof = gpu_check.roofline_points("NVIDIA H200", "qwen2.5-7b", gpu_check.BATCH_SIZES, context=80.0)
    assert roof["gpu"] == "H200" and len(roof["graphs"]) == len(gpu_check.BATCH_SIZES)
    assert all(e > g > 0 for g, e in zip(roof["graphs"], roof["eager"]))  # eager pays launch overhead
    assert roof["graphs"][-1] > roof["graphs"][0]  # batch 512 costs more per step than batch 1
    assert gpu_check.roofline_points("Tesla T4", "qwen2.5-7b", gpu_check.BATCH_SIZES, 80.0) is None
