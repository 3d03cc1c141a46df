"""Runs across sites: placement pinned by the plan and checked before any work, the policy and
checkpoints shipped instead of shared storage, and a stream-async run with its trainer in one
site and its instances behind a shaped link in another (a real multi-node Ray cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config, plan_overrides
from streamrl.models.shipping import materialize_policy, pack_dir, package_policy, unpack_dir
from streamrl.placement import check_cluster, plan_file_for_sites, plan_placement


def test_a_plan_pins_the_trainer_and_each_instance_by_label():
    cfg = load_config(None, ["mode=stream-async", "placement.trainer_node=A0", "placement.gen_nodes=[B0,B1]",
                             "generation.num_instances=3", "cluster.num_cpus=4"])
    plan = plan_placement(cfg)
    assert plan.trainer[0].resources["node_A0"] > 0 and plan.trainer[0].node == "A0"
    assert [b.node for b in plan.generation] == ["B0", "B1", "B0"]  # round robin
    by_site = plan_placement(load_config(None, ["mode=stream-async", "placement.trainer_site=A",
                                                "placement.gen_sites=[B]"]))
    assert "site_A" in by_site.trainer[0].resources and "site_B" in by_site.generation[0].resources


def test_a_plan_the_cluster_cannot_hold_fails_naming_the_missing_labels():
    cfg = load_config(None, ["mode=stream-async", "placement.trainer_node=Z9", "placement.gen_nodes=[B0]"])
    have = {"CPU": 3.0, "node_A0": 1.0, "node_B0": 1.0, "site_A": 1.0, "site_B": 2.0}
    with pytest.raises(ConfigError, match="node_Z9 \\(for trainer-rank-0\\).*node_A0, node_B0"):
        check_cluster(plan_placement(cfg), have)
    check_cluster(plan_placement(load_config(None, ["mode=stream-async", "placement.trainer_node=A0"])), have)
    with pytest.raises(ConfigError, match="colocated"):
        plan_placement(load_config(None, ["mode=colocated", "placement.trainer_node=A0"]))


def test_a_plan_file_for_sites_round_trips_into_the_config(tmp_path):
    import yaml

    sections = plan_file_for_sites([("A0", "A"), ("B0", "B"), ("B1", "B")])
    assert sections == {"placement": {"trainer_node": "A0", "gen_nodes": ["B0", "B1"]},
                        "generation": {"num_instances": 2}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(sections))
    cfg = load_config(None, plan_overrides(path) + ["generation.num_instances=4"])  # the command line wins
    assert cfg.placement.gen_nodes == ["B0", "B1"] and cfg.generation.num_instances == 4
    with pytest.raises(ConfigError, match="'C'"):
        plan_file_for_sites([("A0", "A")], train_site="C")


def test_overrides_after_an_option_are_overrides_and_an_unknown_option_still_fails(tmp_path, capsys):
    from streamrl.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text("placement:\n  trainer_node: A0\n")
    assert main(["train", "--plan", str(plan), "mode=stream-async", "--dry-run"]) == 0
    assert "A0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--bogus"])


def test_a_shipped_policy_is_written_once_per_node_and_directories_replace_atomically(tmp_path, monkeypatch):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(1000))
    pkg = package_policy(src)
    assert package_policy(src).digest == pkg.digest
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node"))
    (tmp_path / "node").mkdir()
    local = materialize_policy(pkg)
    assert local != str(src) and pack_dir(local) == pack_dir(src)
    assert materialize_policy(pkg) == local and materialize_policy(str(src)) == str(src)
    dest = tmp_path / "out"
    unpack_dir({"a": b"1"}, dest)
    unpack_dir({"b": b"2"}, dest)  # replaces, leaves no temporary behind
    assert pack_dir(dest) == {"b": b"2"} and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "node", "out"]
    with pytest.raises(ValueError, match="outside"):
        unpack_dir({"../evil": b"x"}, tmp_path / "x")


@pytest.fixture
def sites(two_sites):
    """The shared two-site cluster (tests/lab/conftest.py)."""
    return two_sites


def _train(cl, tmp: Path, *overrides: str, plan: dict | None = None) -> subprocess.CompletedProcess:
    import yaml

    argv = [str(Path(sys.executable).with_name("streamrl")), "train"]
    if plan is not None:
        (tmp / "plan.yaml").write_text(yaml.safe_dump(plan))
        argv += ["--plan", str(tmp / "plan.yaml")]
    argv += ["cluster.address=auto", "mode=stream-async", *overrides]
    return subprocess.run(cl.exec_argv(argv), capture_output=True, text=True, timeout=600, cwd=tmp)


@pytest.mark.slow
def test_a_stream_async_run_across_sites_trains_each_sample_once_with_weights_crossing_once(sites, tiny_policy_dir,
                                                                                          tmp_path):
    plan = plan_file_for_sites([(n.name, n.site) for n in sites.nodes])
    before = sites.link_bytes("A", "B")["A->B"]
    r = _train(sites, tmp_path, f"policy.path={tiny_policy_dir}", "run.iterations=3", "generation.prompts_per_iter=4",
               "generation.n_samples=2", "generation.max_new_tokens=24", "task.num_eval=4", "run.out_dir=run",
               "run.checkpoint_every=2", plan=plan)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    where = json.loads((out / "placement.json").read_text())
    assert where["trainer"]["node"] == "A0" and {where["gen-0"]["node"], where["gen-1"]["node"]} == {"B0", "B1"}
    lineage = json.loads((out / "lineage.json").read_text())
    assert len(lineage) == 3 * 4 * 2 == len(set(lineage))  # every sample trained exactly once
    events = json.loads((out / "timeline.json").read_text())["events"]
    fetches = [e for e in events if e["what"] == "weight_fetch"]
    for v in {e["version"] for e in fetches}:
        links = sorted(e["meta"]["link"] for e in fetches if e["version"] == v)
        assert links == ["A->B", "B"]  # one copy crosses to the relay, the other instance reads the relay's
    weights = sum(e["meta"]["bytes"] for e in fetches if e["meta"]["link"] == "A->B")
    assert sites.link_bytes("A", "B")["A->B"] - before >= weights  # the counters saw at least those bytes
    assert (out / "checkpoint" / "trainer.pt").is_file()


@pytest.mark.slow
def test_a_trainer_on_another_node_than_the_driver_ships_its_checkpoint_back_and_resumes(sites, tiny_policy_dir,
                                                                                         tmp_path):
    plan = {"placement": {"trainer_node": "B0", "gen_nodes": ["B1"]}, "generation": {"num_instances": 1}}
    common = [f"policy.path={tiny_policy_dir}", "generation.prompts_per_iter=2", "generation.n_samples=2",
              "generation.max_new_tokens=16", "task.num_eval=4", "run.out_dir=run", "run.checkpoint_every=1"]
    r = _train(sites, tmp_path, *common, "run.iterations=2", plan=plan)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "placement.json").read_text())["trainer"]["node"] == "B0"
    assert (tmp_path / "run" / "checkpoint" / "trainer.pt").is_file()  # written by the driver on A0
    r = _train(sites, tmp_path, *common, "run.iterations=3", "run.resume=true", plan=plan)
    assert r.returncode == 0, r.stderr[-3000:]
    lineage = json.loads((tmp_path / "run" / "lineage.json").read_text())
    assert len(lineage) == 3 * 2 * 2 == len(set(lineage))


@pytest.mark.slow
def test_an_unsatisfiable_plan_fails_before_any_actor_naming_the_label(sites, tiny_policy_dir, tmp_path):
    r = _train(sites, tmp_path, f"policy.path={tiny_policy_dir}", "run.out_dir=run",
               plan={"placement": {"trainer_node": "Z9", "gen_nodes": ["B0"]}})
    assert r.returncode == 2 and "node_Z9" in r.stderr and "node_A0" in r.stderr
    assert "GenerationInstance" not in r.stderr + r.stdout and "IterationTrainer" not in r.stderr + r.stdout
