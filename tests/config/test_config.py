"""Config: presets load, overrides apply, bad keys and values fail naming them."""

import re
from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


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


# ----------------------------------------------------------------------------- did you mean


def test_unknown_key_suggests_the_closest_key_of_its_section():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lrr=1"])
    assert str(err.value) == "unknown config key 'trainer.lrr' (value 1); did you mean 'trainer.lr'?"
    with pytest.raises(ConfigError, match=r"^unknown config key 'genration' \(value \{'n_samples': 2\}\); "
                                          r"did you mean 'generation'\?$"):
        load_config(None, ["genration.n_samples=2"])
    with pytest.raises(ConfigError, match=r"unknown config key 'placement.nodes.0.gpu_per_node' \(value 2\); "
                                          r"did you mean 'placement.nodes.0.gpus_per_node'\?"):
        load_config(None, ["placement.nodes=[{gpu_type: A100, gpu_per_node: 2}]"])


def test_unknown_key_without_a_close_one_has_no_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.qqqqqqq=1"])
    assert str(err.value) == "unknown config key 'trainer.qqqqqqq' (value 1)"


# ----------------------------------------------------------------------------- strict numbers


@pytest.mark.parametrize("override", ["generation.n_samples=true", "trainer.lr=false", "run.iterations=yes",
                                      "generation.resources={H20: true}", "task.num_eval=on"])
def test_a_boolean_is_not_a_number(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^config key '{re.escape(key)}': a boolean is not a number \(got "):
        load_config(None, [override])


def test_a_boolean_is_not_a_number_message_and_bool_fields_still_take_bools():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["generation.n_samples=true"])
    assert str(err.value) == "config key 'generation.n_samples': a boolean is not a number (got True)"
    with pytest.raises(ConfigError, match=r"task.reward_weights': a boolean is not a number"):
        load_config(None, ["task.reward=[a.b:f]", "task.reward_weights=[true]"])
    cfg = load_config(None, ["run.resume=true", "generation.rebalance=false"])
    assert cfg.run.resume is True and cfg.generation.rebalance is False


def test_a_fractional_float_is_not_an_int():
    with pytest.raises(ConfigError, match=r"generation.n_samples.*fractional part \(got 2.5\)"):
        load_config(None, ["generation.n_samples=2.5"])


@pytest.mark.parametrize("value", ["1e400", "1.0e+400", ".inf", "-.inf", "nan", ".nan", "inf"])
def test_infinite_or_nan_floats_are_rejected(value):
    with pytest.raises(ConfigError, match=r"config key 'trainer.lr': Input should be a finite number"):
        load_config(None, [f"trainer.lr={value}"])


def test_numeric_strings_and_ints_still_fill_float_fields(tmp_path):
    # PyYAML reads 3e-4 (no dot) as the string '3e-4': it must still be a learning rate.
    cfg = load_config(None, ["trainer.lr=3e-4", "trainer.clip_eps=1", "generation.temperature=2"])
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.clip_eps == 1.0 and cfg.generation.temperature == 2.0
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 3e-4\n  grad_clip: 2\n")
    cfg = load_config(path)
    assert cfg.trainer.lr == pytest.approx(3e-4) and cfg.trainer.grad_clip == 2.0
    # a string field keeps an override's text verbatim
    assert load_config(None, ["task.system_prompt=true"]).task.system_prompt == "true"


# ----------------------------------------------------------------------------- YAML syntax errors


def test_yaml_syntax_error_in_a_file_is_one_line_naming_file_line_and_column(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("run:\n  seed: 0\n  out: a: b\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config file {str(path)!r} line 3, column 9: mapping values are not allowed here"
    path.write_text("trainer:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(repr(str(path)))} line \d+, column \d+: ") as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_yaml_syntax_error_in_an_override_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["generation.resources={H20: [1}"])
    msg = str(err.value)
    assert msg.startswith("override generation.resources: value '{H20: [1}' is not valid YAML (line 1, column ")
    assert "\n" not in msg


def test_non_utf8_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"run:\n  seed: \xff\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path)


# ----------------------------------------------------------------------------- registries


def test_dispatch_policy_is_checked_against_the_registry_at_load_time():
    from streamrl.scheduling.dispatch import DISPATCH_POLICIES

    with pytest.raises(ConfigError) as err:
        load_config(None, ["generation.dispatch=skew-search"])
    assert str(err.value) == (f"config key 'generation.dispatch': unknown policy 'skew-search'; choose one of "
                              f"{list(DISPATCH_POLICIES)}; did you mean 'skewness-search'?")
    for name in DISPATCH_POLICIES:
        assert load_config(None, [f"generation.dispatch={name}"]).generation.dispatch == name


def test_ranker_name_is_checked_against_the_registry_at_load_time():
    from streamrl.ranker.base import RANKERS

    with pytest.raises(ConfigError, match=r"config key 'ranker.name': unknown ranker 'blnd'; choose one of "
                                          r"\[.*'none'\]; did you mean 'blend'\?$"):
        load_config(None, ["ranker.name=blnd"])
    for name in [*RANKERS, "none"]:
        assert load_config(None, [f"ranker.name={name}"]).ranker.name == name


@pytest.mark.parametrize("spec", ["foo", "foo:", ":fn", "a b:fn", "pkg.mod:not-a-name", "pkg..mod:fn"])
def test_reward_spec_syntax_is_checked_at_load_time(spec):
    with pytest.raises(ConfigError, match=r"config key 'task.reward': .* is not 'package.module:function' or "
                                          r"'path/to/file.py:function'"):
        load_config(None, [f"task.reward=[{spec!r}]"])


def test_reward_specs_of_both_kinds_pass_without_being_imported():
    cfg = load_config(None, ["task.reward=[no_such_pkg.mod:fn, /abs/r.py:score, rel/r.py:f, r.py:g]"])
    assert cfg.task.reward[0] == "no_such_pkg.mod:fn"


def test_registry_checks_import_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys; from streamrl.config import load_config; "
            "load_config(None, ['generation.dispatch=random', 'ranker.name=history', 'task.reward=a.b:c']); "
            "print([m for m in ('torch', 'ray', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- relative paths

REPO = Path(__file__).resolve().parents[2]


def test_shipped_config_paths_resolve_against_the_repository_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "tiny.yaml")  # `make demo`: streamrl train configs/tiny.yaml
    assert cfg.policy.path == str(REPO / ".cache" / "tiny-policy")
    assert cfg.run.out_dir == str(REPO / "runs" / "tiny")
    bench = load_config(REPO / "configs" / "bench.yaml")
    assert bench.generation.latency_profile == str(REPO / "profiles" / "cpu-tiny.json")
    assert Path(bench.generation.latency_profile).is_file()
    gpu = load_config(REPO / "configs" / "gpu-qwen2.5-0.5b-gsm8k.yaml")
    assert gpu.run.out_dir == str(REPO / "runs" / "gpu-qwen2.5-0.5b-gsm8k")
    assert gpu.policy.path == "/models/Qwen2.5-0.5B-Instruct"


def test_relative_config_path_from_the_repository_gives_the_same_paths(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("configs/tiny.yaml")
    assert (cfg.policy.path, cfg.run.out_dir) == (str(REPO / ".cache/tiny-policy"), str(REPO / "runs/tiny"))


def test_paths_in_a_file_resolve_against_its_directory(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (conf / "Org" / "local-model").mkdir(parents=True)
    path = conf / "c.yaml"
    path.write_text(
        "run: {out_dir: out}\n"
        "policy: {path: ../models/tiny-policy-x}\n"
        "task:\n  name: file\n  train_path: data/train.jsonl\n  eval_path: gsm8k_test.jsonl\n"
        "  chat_template: tmpl.jinja\n  reward: [rewards/r.py:score, my_pkg.rewards:fn, r2.py:g]\n"
        "ranker: {fit_file: fit.jsonl}\n"
        "generation: {latency_profile: ~/p.json}\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.run.out_dir == str(conf / "out")
    assert cfg.policy.path == str(tmp_path / "models" / "tiny-policy-x")  # built there: resolved though missing
    assert cfg.task.train_path == str(conf / "data" / "train.jsonl")
    assert cfg.task.eval_path == "gsm8k_test.jsonl"  # not beside the config: a name in the data directory
    assert cfg.task.chat_template == str(conf / "tmpl.jinja")
    assert cfg.task.reward == [f"{conf / 'rewards' / 'r.py'}:score", "my_pkg.rewards:fn", f"{conf / 'r2.py'}:g"]
    assert cfg.ranker.fit_file == str(conf / "fit.jsonl")
    assert cfg.generation.latency_profile == str(Path("~/p.json").expanduser())

    path.write_text("policy: {path: Qwen/Qwen2.5-0.5B}\ntask: {chat_template: none}\n")
    cfg = load_config(path)
    assert cfg.policy.path == "Qwen/Qwen2.5-0.5B"  # a hub id stays one
    assert cfg.task.chat_template == "none"
    path.write_text("policy: {path: Org/local-model}\n")
    assert load_config(path).policy.path == str(conf / "Org" / "local-model")  # ... unless it is a directory there


def test_override_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "c.yaml").write_text("run: {out_dir: from-file}\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(conf / "c.yaml", ["run.out_dir=runs/x", "task.name=file", "task.train_path=train.jsonl",
                                        "policy.path=Qwen/Qwen2.5-0.5B", "task.reward=r.py:f"])
    assert cfg.run.out_dir == str(tmp_path / "runs" / "x")
    assert cfg.task.train_path == str(tmp_path / "train.jsonl")
    assert cfg.policy.path == "Qwen/Qwen2.5-0.5B"
    assert cfg.task.reward == f"{tmp_path / 'r.py'}:f"
    defaults = load_config()
    assert defaults.run.out_dir == str(tmp_path / "runs" / "latest")
    assert defaults.policy.path == str(tmp_path / ".cache" / "tiny-policy")
    assert defaults.task.chat_template == "auto"


def test_a_runs_written_config_reloads_unchanged_from_its_out_dir(tmp_path, monkeypatch):
    from streamrl.config import dump_config

    monkeypatch.chdir(REPO)
    cfg = load_config("configs/bench.yaml", ["task.reward=r.py:f"])
    written = tmp_path / "out" / "config.yaml"  # what the driver writes into run.out_dir
    written.parent.mkdir()
    written.write_text(dump_config(cfg))
    monkeypatch.chdir(tmp_path)
    assert load_config(written) == cfg


# ----------------------------------------------------------------------------- user errors in the CLI


def test_user_errors_share_a_base_and_keep_their_old_ones():
    from streamrl.errors import UserError
    from streamrl.models.hf import PolicyNotFound
    from streamrl.tasks.math import DataError
    from streamrl.tasks.user_reward import RewardSpecError

    for cls, old in ((ConfigError, ValueError), (DataError, ValueError), (PolicyNotFound, FileNotFoundError),
                     (RewardSpecError, ValueError)):
        assert issubclass(cls, UserError) and issubclass(cls, old)


def test_cli_config_error_is_one_line_and_debug_raises(capsys):
    from streamrl.cli import main

    assert main(["config", "show", "trainer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err == "streamrl: config error: unknown config key 'trainer.lrr' (value 1); did you mean 'trainer.lr'?\n"
    with pytest.raises(ConfigError, match="trainer.lrr"):
        main(["--debug", "config", "show", "trainer.lrr=1"])


def _fake_policy(tmp_path):
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")  # enough for `ensure_policy`; the task fails first
    return policy


def test_cli_data_error_is_one_line_and_debug_raises(tmp_path, capsys):
    from streamrl.cli import main
    from streamrl.tasks.math import DataError

    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "no prompt column"}\n')
    argv = ["task", "stats", "task.name=file", f"task.train_path={data}", f"policy.path={_fake_policy(tmp_path)}",
            "policy.make_if_missing=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"streamrl: error: {data}: no usable rows")
    with pytest.raises(DataError, match="no usable rows"):
        main(["--debug", *argv])


def test_cli_missing_policy_is_one_line(tmp_path, capsys):
    from streamrl.cli import main

    assert main(["task", "stats", f"policy.path={tmp_path / 'nope'}", "policy.make_if_missing=false"]) == 2
    assert capsys.readouterr().err == f"streamrl: error: policy.path={str(tmp_path / 'nope')!r} does not exist\n"


def test_cli_missing_or_wrong_kind_of_path_is_one_line_naming_it(tmp_path, capsys):
    from streamrl.cli import main

    assert main(["compare", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("streamrl: error: ") and str(tmp_path / "nope") in err
    assert main(["plan", "--lengths-file", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"streamrl: error: Is a directory: {str(tmp_path)!r}\n"
    with pytest.raises(IsADirectoryError):
        main(["--debug", "plan", "--lengths-file", str(tmp_path)])


def test_did_you_mean_needs_a_close_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run.out_dri=x"])
    assert str(err.value).endswith("did you mean 'run.out_dir'?")


def test_staleness_beyond_one_step_is_stream_async_only():
    cfg = load_config(None, ["mode=stream-async", "trainer.max_staleness=4", "generation.partial_rollout=true"])
    assert cfg.staleness_bound() == 4 and load_config(None, ["mode=stream-async"]).staleness_bound() == 1
    assert load_config(None, ["mode=stream-sync"]).staleness_bound() == 0
    with pytest.raises(ConfigError, match=r"trainer.max_staleness=2.*stream-sync.*synchronous"):
        load_config(None, ["mode=stream-sync", "trainer.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"partial_rollout=true needs mode=stream-async"):
        load_config(None, ["mode=disagg-batch", "generation.partial_rollout=true"])
    with pytest.raises(ConfigError, match=r"max_staleness=0 in mode='stream-async'"):
        load_config(None, ["mode=stream-async", "trainer.max_staleness=0"])
    with pytest.raises(ConfigError, match=r"trainer.correction"):
        load_config(None, ["trainer.correction=vtrace"])


def test_elastic_bounds_are_checked_at_load_time():
    with pytest.raises(ConfigError, match=r"generation.min_instances=3 is more than the most instances, 2"):
        load_config(None, ["generation.elastic=true", "generation.min_instances=3"])
    with pytest.raises(ConfigError, match=r"min_instances=3 .* 2 \(generation.max_instances"):
        load_config(None, ["generation.elastic=true", "generation.min_instances=3", "generation.max_instances=2"])
    assert load_config(None, ["generation.min_instances=3"]).generation.min_instances == 3  # not elastic: unused
    assert load_config(None, ["generation.elastic=true", "generation.min_instances=2"]).generation.elastic


def test_gpu_generation_is_checked_at_load_time_not_only_by_the_plan():
    gpu = Path(__file__).parents[2] / "configs" / "gpu-qwen2.5-1.5b-gsm8k.yaml"
    with pytest.raises(ConfigError, match=r"placement.device=cuda needs generation.engine=vllm \(got 'transformers'\)"):
        load_config(gpu, ["generation.engine=transformers"])
    with pytest.raises(ConfigError, match=r"generation.vllm.device='cpu'; set generation.vllm.device=cuda"):
        load_config(gpu, ["generation.vllm={device: cpu}"])


def test_every_field_description_is_its_attribute_docstring():
    """``use_attribute_docstrings``: a field's text is the docstring under it, never ``Field(description=)``."""
    import ast

    import streamrl.config as package
    from streamrl.config import GenerationConfig

    for path in Path(package.__file__).parent.glob("*.py"):
        keywords = [k.arg for k in ast.walk(ast.parse(path.read_text())) if isinstance(k, ast.keyword)]
        assert "description" not in keywords, path.name
    assert GenerationConfig.model_fields["temperature"].description == "sampling temperature"
    assert len(GenerationConfig.model_fields) == 37


def test_the_wire_dtype_follows_the_engines_unless_set():
    assert load_config(None, []).wire_dtype() == "float32"
    cuda = ["placement.device=cuda", "trainer.backend=fsdp", "generation.engine=vllm", "generation.vllm.device=cuda",
            "mode=stream-async"]
    assert load_config(None, cuda).wire_dtype() == "bfloat16"
    assert load_config(None, [*cuda, "generation.vllm.dtype=float32"]).wire_dtype() == "float32"
    assert load_config(None, [*cuda, "weights.wire_dtype=float32"]).wire_dtype() == "float32"
    assert load_config(None, ["weights.wire_dtype=bfloat16"]).wire_dtype() == "bfloat16"


def test_corrections_that_would_be_silently_wrong_are_refused():
    with pytest.raises(ConfigError, match="trainer.epochs=2 is not supported on trainer.backend='fsdp'"):
        load_config(None, ["mode=stream-async", "trainer.backend=fsdp", "trainer.correction=decoupled",
                           "trainer.epochs=2"])
    with pytest.raises(ConfigError, match="generation.top_p=0.9 with trainer.correction='tis'"):
        load_config(None, ["mode=stream-async", "generation.top_p=0.9", "trainer.correction=tis"])
    load_config(None, ["mode=stream-async", "generation.top_p=0.9"])  # no correction: allowed
    load_config(None, ["mode=stream-async", "trainer.correction=decoupled", "trainer.epochs=2"])  # single trainer
