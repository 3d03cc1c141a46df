"""The Python API surface: lazy names, datasets handed over in memory become a real file."""

import json
import sys

import pytest


def test_top_level_names_are_lazy_and_light():
    import subprocess

    code = ("import sys, streamrl; streamrl.load_config; streamrl.Config; "
            "print(any(m in sys.modules for m in ('torch', 'ray', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    import streamrl

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        streamrl.nope  # noqa: B018


def test_rows_in_memory_are_written_to_the_run_directory(tmp_path):
    from streamrl.api import _dataset_path
    from streamrl.config import ConfigError

    rows = [{"question": "1+1?", "gold": "2"}, {"question": "2+2?", "gold": "4"}]
    path = _dataset_path(rows, tmp_path / "run")
    assert [json.loads(x) for x in open(path)] == rows
    assert _dataset_path("data.jsonl", tmp_path) == "data.jsonl"
    datasets = pytest.importorskip("datasets")
    path = _dataset_path(datasets.Dataset.from_list(rows), tmp_path / "run2")
    assert [json.loads(x) for x in open(path)] == rows
    with pytest.raises(ConfigError, match="non-empty list of row dicts"):
        _dataset_path([], tmp_path)
