"""The memory pre-flight: a model that cannot fit the machine is refused before Ray starts."""

import pytest

from streamrl.config import PolicyConfig, load_config
from streamrl.controller import preflight
from streamrl.models.tiny import build_model


@pytest.fixture
def checkpoint(tmp_path):
    model = build_model(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
                        vocab_size=50)
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", sum(p.numel() for p in model.parameters())


def test_the_parameter_count_comes_from_the_safetensors_headers(checkpoint, tmp_path):
    path, params = checkpoint
    assert preflight.checkpoint_parameters(path) == params
    assert preflight.checkpoint_parameters(tmp_path) is None  # no safetensors: no estimate, no refusal


def test_the_estimate_grows_with_the_run_and_a_model_too_large_is_refused_in_one_line(checkpoint, monkeypatch):
    path, params = checkpoint
    base = preflight.estimate_gb(load_config(None, ["mode=stream-async", "generation.num_instances=1"]), 10**9)
    ppo = preflight.estimate_gb(load_config(None, ["trainer.algo=ppo", "trainer.kl_coef=0.1"]), 10**9)
    two = preflight.estimate_gb(load_config(None, ["mode=stream-async", "generation.num_instances=2"]), 10**9)
    assert base["trainer"] == pytest.approx(24 * 10**9 / 2**30 + 1)  # 16 B/param + two wire copies
    assert ppo["trainer"] > base["trainer"] and two["total"] == pytest.approx(base["total"] + base["instance"])
    cfg = load_config(None, [f"policy.path={path}"])
    monkeypatch.setattr(preflight, "available_gb", lambda: 1e-6)
    with pytest.raises(preflight.ModelTooLarge, match=r"has 0\.\dM parameters: the trainer needs about .* more than "
                                                      r"the 0\.0 GB this machine has available") as err:
        preflight.check_fits(cfg, path)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(preflight, "available_gb", lambda: 64.0)
    assert preflight.check_fits(cfg, path)["total"] < 64.0


def test_the_cli_refuses_before_ray_starts(checkpoint, monkeypatch, tmp_path, capsys):
    from streamrl.cli import main
    from streamrl.controller import run

    def no_ray(cfg):
        raise AssertionError("Ray was started")

    path, _ = checkpoint
    monkeypatch.setattr(run, "init_ray", no_ray)
    monkeypatch.setattr(preflight, "available_gb", lambda: 1e-6)
    code = main(["train", f"policy.path={path}", f"run.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "more than the 0.0 GB this machine has available" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
