"""`streamrl config show`: the resolved config as commented YAML that loads back, or JSON."""

import json
import re
from typing import get_origin
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.config import Config, _model_in, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def show(capsys, *argv: str) -> str:
    assert main(["config", "show", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_show_loads_back_to_the_same_config_from_anywhere(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    overrides = ["mode=stream-sync", "trainer.lr=3e-4"] if "gpu" not in path.name else ["trainer.lr=3e-4"]
    text = show(capsys, str(path.relative_to(REPO)), *overrides)
    expected = load_config(path, overrides)
    out = tmp_path / "elsewhere" / "shown.yaml"
    out.parent.mkdir()
    out.write_text(text)
    monkeypatch.chdir(tmp_path)
    assert load_config(out) == expected


def test_show_round_trips_awkward_strings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overrides = ["task.prompt_template=Q: {prompt}\n# not a comment: 'quoted' \"too\"\tend",
                 "task.system_prompt=yes", "logging.project=line one\nline: two",
                 "task.reward=[pkg.mod:fn, r.py:g]", "logging.run_name=null",
                 "generation.vllm={dtype: bfloat16, gpu_memory_utilization: 0.85, engine_args: {seed: 1}}",
                 "generation.resources={H20: 1}", "ranker.kwargs={prior: lm}", "trainer.lr=1e-7",
                 "placement.nodes=[{gpu_type: A100, nodes: 1, gpus_per_node: 2}]"]
    text = show(capsys, *overrides)
    for line in text.splitlines():  # one line per key: a multi-line string is escaped, not wrapped
        assert not line or re.match(r"^(  ){0,2}(#|\w+:( |$))", line), line  # a nested section: one level deeper
    out = tmp_path / "sub" / "c.yaml"
    out.parent.mkdir()
    out.write_text(text)
    expected = load_config(None, overrides)
    assert expected.task.system_prompt == "yes"
    assert load_config(out) == expected


def test_show_without_a_config_file_takes_overrides_first(capsys):
    text = show(capsys, "mode=stream-sync", "generation.n_samples=2")
    assert re.search(r"^mode: stream-sync$", text, re.M)
    assert re.search(r"^  n_samples: 2$", text, re.M)
    assert text.startswith("# streamrl config show: built-in defaults + overrides 'mode=stream-sync'")


def _comment_above(lines: list[str], index: int, indent: str) -> str:
    """The text of the ``#`` comment block directly above ``lines[index]``."""
    block = []
    i = index - 1
    while i >= 0 and lines[i].startswith(f"{indent}#"):
        block.insert(0, lines[i][len(indent) + 1:].strip())
        i -= 1
    return " ".join(b for b in block if b)


def test_every_description_and_section_docstring_is_a_comment_above_its_key(capsys):
    lines = show(capsys, str(REPO / "configs" / "tiny.yaml")).splitlines()
    described = 0
    for name, field in Config.model_fields.items():
        section = _model_in(field.annotation)
        if section is None:
            index = lines.index(next(x for x in lines if x.startswith(f"{name}: ")))
            assert _comment_above(lines, index, "") == " ".join(field.description.split())
            described += 1
            continue
        index = lines.index(f"{name}:")
        if section.__doc__:
            first = " ".join(section.__doc__.split("\n\n")[0].split())
            assert _comment_above(lines, index, "").startswith(first)
        for key, sub in section.model_fields.items():
            at = next(i for i in range(index + 1, len(lines)) if lines[i].startswith(f"  {key}: ")
                      or lines[i] == f"  {key}:")
            if sub.description:
                assert _comment_above(lines, at, "  ") == " ".join(sub.description.split()), (name, key)
                described += 1
            nested = _model_in(sub.annotation) if lines[at] == f"  {key}:" else None
            for deeper, leaf in (nested.model_fields.items() if nested else ()):  # trainer.lora's own keys
                below = next(i for i in range(at + 1, len(lines)) if lines[i].startswith(f"    {deeper}: "))
                assert _comment_above(lines, below, "    ") == " ".join(leaf.description.split()), (key, deeper)
                described += 1
    sections = [_model_in(f.annotation) for f in Config.model_fields.values() if _model_in(f.annotation)]
    nested = [_model_in(s.annotation) for sec in sections for s in sec.model_fields.values()
              if _model_in(s.annotation) and get_origin(s.annotation) is None]
    assert described == sum(1 for f in Config.model_fields.values() if f.description) + sum(
        1 for sec in sections + nested for s in sec.model_fields.values() if s.description) > 80


def test_show_json_is_the_model_dump(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    text = show(capsys, "configs/tiny.yaml", "trainer.lr=3e-4", "--json")
    assert json.loads(text) == load_config("configs/tiny.yaml", ["trainer.lr=3e-4"]).model_dump()


def test_show_and_dry_run_import_no_heavy_module():
    code = ("import contextlib, io, sys\n"
            "from streamrl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['config', 'show', 'configs/tiny.yaml', 'ranker.name=history']) == 0\n"
            "    main(['train', 'configs/tiny.yaml', 'generation.dispatch=random', '--dry-run'])\n"
            "print([m for m in ('torch', 'ray', 'transformers') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
