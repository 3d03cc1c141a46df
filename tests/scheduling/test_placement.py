"""Placement plans and the GPU presets' dry run: pure config checks, no Ray, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.commands.train import dry_run
from streamrl.placement import plan_placement
from streamrl.tasks.base import default_data_dir

CONFIGS = Path(__file__).parents[2] / "configs"
GPU_PRESETS = sorted(CONFIGS.glob("gpu-*.yaml"))


def _gpu(*overrides):
    return load_config(CONFIGS / "gpu-qwen2.5-1.5b-gsm8k.yaml", list(overrides))


def test_there_are_gpu_presets_for_single_node_and_heterogeneous_clusters():
    names = {p.name for p in GPU_PRESETS}
    assert {"gpu-qwen2.5-0.5b-gsm8k.yaml", "gpu-qwen2.5-1.5b-gsm8k.yaml", "gpu-hetero-qwen2.5-1.5b-gsm8k.yaml"} <= names


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_every_gpu_preset_plans_disjoint_gpus_for_trainer_and_generation(path):
    cfg = load_config(path)
    plan = plan_placement(cfg)
    assert len(plan.trainer) == cfg.placement.trainer_gpus and len(plan.generation) == cfg.generation.num_instances
    slots = [(b.node, g) for b in plan.trainer + plan.generation for g in b.gpus]
    assert len(slots) == len(set(slots))  # no GPU given twice: generation is disaggregated from training
    for b in plan.trainer:
        assert b.resources["GPU"] == 1 and b.resources[cfg.placement.trainer_gpu_type] == 1
    for b in plan.generation:
        assert len({b.node}) == 1 and len(b.gpus) == cfg.placement.gen_gpus_per_instance
        assert b.node.startswith(cfg.placement.gen_gpu_type)
    report = dry_run(cfg)
    assert report["engine"] == "vllm" and cfg.placement.trainer_dtype == "bfloat16"
    # The GSM8K file ships beside the repository (../shared/data); a clone without it is told which file is missing.
    assert report["task_file_present"] == (default_data_dir() / "gsm8k_test.jsonl").is_file()
    assert "gsm8k" in report["task_file"]


def test_heterogeneous_preset_trains_on_h800_and_generates_on_h20():
    plan = plan_placement(load_config(CONFIGS / "gpu-hetero-qwen2.5-1.5b-gsm8k.yaml"))
    assert {b.node for b in plan.trainer} == {"H800-0"} and plan.trainer_strategy == "STRICT_PACK"
    assert {b.node for b in plan.generation} == {"H20-0", "H20-1"}
    assert plan.gpus_used() == {"H800": 8, "H20": 16}


def test_trainer_spreads_over_nodes_only_when_no_single_node_holds_it():
    plan = plan_placement(_gpu("placement.trainer_gpus=12", "generation.num_instances=4",
                               "placement.nodes=[{gpu_type: H800, nodes: 2, gpus_per_node: 8, cpus_per_node: 96}]"))
    assert plan.trainer_strategy == "PACK" and {b.node for b in plan.trainer} == {"H800-0", "H800-1"}


@pytest.mark.parametrize("overrides, message", [
    (["placement.trainer_gpus=9"], r"trainer_gpus=9 .*has 8"),
    (["generation.num_instances=5"], r"num_instances=5 .*only 4 instances fit"),
    (["placement.gen_gpus_per_instance=16"], r"gen_gpus_per_instance=16"),
    (["placement.gen_gpu_type=H20"], r"gen_gpu_type='H20': no node of that type"),
    (["placement.nodes=[]"], r"placement.nodes is empty"),
    (["generation.engine=transformers"], r"generation.engine=vllm"),
    (["generation.vllm={device: cpu}"], r"generation.vllm.device='cpu'"),
    (["placement.cpus_per_gpu=20"], r"cpus_per_gpu=20"),
])
def test_impossible_plans_fail_naming_the_key_and_numbers(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_placement(_gpu(*overrides))


def test_placement_keys_are_validated_on_load():
    with pytest.raises(ConfigError, match="placement.trainer_gpus"):
        _gpu("placement.trainer_gpus=0")
    with pytest.raises(ConfigError, match="placement.device"):
        _gpu("placement.device=tpu")


def test_train_dry_run_prints_the_plan_without_starting_anything(tmp_path, capsys):
    from streamrl.cli import main

    out = tmp_path / "plan.json"
    # the checkpoint lives on the GPU cluster, not here: the plan prints, and the exit says what is missing
    assert main(["train", str(CONFIGS / "gpu-hetero-qwen2.5-1.5b-gsm8k.yaml"), "--dry-run", "--out", str(out)]) == 2
    text = capsys.readouterr().out
    assert "missing input(s): policy.path" in text
    assert "trainer-rank-7" in text and "gen-15" in text and "H20-1" in text
    report = json.loads(out.read_text())
    assert report["trainer_ranks"] == 8 and report["generation_instances"] == 16
    assert report["policy_present"] is False


def test_a_live_gpu_run_checks_its_plan_before_starting_anything(capsys, tmp_path):
    from streamrl.cli import main

    # 2 GPUs: a 2-rank trainer leaves none for the instance; fails before Ray, the policy or out_dir
    out_dir = tmp_path / "run"
    assert main(["train", str(CONFIGS / "gpu-qwen2.5-0.5b-gsm8k.yaml"), "placement.trainer_gpus=2",
                 f"run.out_dir={out_dir}"]) == 2
    assert "only 0 instances fit" in capsys.readouterr().err and not out_dir.exists()
    assert main(["train", str(CONFIGS / "gpu-qwen2.5-0.5b-gsm8k.yaml"), "trainer.backend=single"]) == 2
    assert "set trainer.backend=fsdp (got trainer.backend='single')" in capsys.readouterr().err
