"""Config: presets load, overrides apply, bad keys and values fail naming them."""

from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.mode in ("colocated", "disagg-batch", "stream-sync", "stream-async")


def test_dotted_override_changes_value_and_parses_yaml_types():
    cfg = load_config(None, ["trainer.lr=3e-4", "mode=stream-sync", "logging.backends=[console,jsonl]"])
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.mode == "stream-sync"
    assert cfg.logging.backends == ["console", "jsonl"]


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="trainer.lrr"):
        load_config(None, ["trainer.lrr=1"])


def test_bad_value_is_named_with_the_value():
    with pytest.raises(ConfigError, match=r"trainer.lr.*-1"):
        load_config(None, ["trainer.lr=-1"])
    with pytest.raises(ConfigError, match=r"mode.*bogus"):
        load_config(None, ["mode=bogus"])


def test_override_without_equals_sign_fails():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["trainer.lr"])


def test_missing_config_file_fails(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_inconsistent_heads_fail_with_both_values():
    with pytest.raises(ConfigError, match="hidden_size=100.*num_heads=3"):
        load_config(None, ["policy.hidden_size=100", "policy.num_heads=3"])


def test_cli_help_imports_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys; from streamrl.cli import build_parser; build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_rejects_bad_override_before_work():
    from streamrl.cli import main

    assert main(["train", "trainer.nosuch=1"]) == 2
