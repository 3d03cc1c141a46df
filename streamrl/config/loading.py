"""Reading a config: YAML files, dotted overrides, path resolution, validation; and writing one.

``load_config(path, overrides)`` reads the file, applies each ``key.sub=value`` override (parsed
as YAML, except for plain-string fields, which take the text verbatim), resolves the relative
paths of ``PATH_FIELDS`` and validates the tree into a ``Config``; every error is a
``ConfigError`` naming the dotted key and the value (and the closest key for a typo).
``dump_config_annotated`` writes a config back as YAML with each section's docstring and each
field's description as comments (``streamrl config show``); it loads back to the same config.
"""

from __future__ import annotations

import difflib
import inspect
import os
import textwrap
from pathlib import Path
from typing import Any, Iterable, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from streamrl.config.base import ConfigError, _model_in, _union_arms
from streamrl.config.root import Config
from streamrl.config.task import is_reward_file


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _string_field(key: str) -> bool | None:
    """True if the dotted key names a plain-string field (``str`` or ``str | None``), whose value
    an override takes verbatim: ``task.prompt_template=Q: {prompt}`` is text, not YAML."""
    model: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        if i < len(parts) - 1:
            model = ann
            continue
        return set(_union_arms(ann)) in ({str}, {str, type(None)})
    return None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A PyYAML error as one line: ``line 3, column 5: mapping values are not allowed here``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    if context:
        ctx_mark = getattr(exc, "context_mark", None)
        where = f" at line {ctx_mark.line + 1}, column {ctx_mark.column + 1}" if ctx_mark is not None else ""
        problem = f"{problem} ({context}{where})"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    if _string_field(key) and raw.strip() not in ("null", "~", "None"):
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({_yaml_problem(exc)})") from None
    return key, value


def _keys_beside(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section holding the key at ``loc`` (list indices skipped)."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields) if model is not None else []


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:  # a check across sections: its message names every key and value involved
            lines.append(msg)
        elif err["type"] == "extra_forbidden":
            line = f"unknown config key {loc!r} (value {value!r})"
            close = difflib.get_close_matches(str(err["loc"][-1]), _keys_beside(err["loc"]), n=1)
            if close:
                line += f"; did you mean {'.'.join([*map(str, err['loc'][:-1]), close[0]])!r}?"
            lines.append(line)
        elif err["type"] == "streamrl_value":  # the message names the value already
            lines.append(f"config key {loc!r}: {msg}")
        else:
            lines.append(f"config key {loc!r}: {msg} (got {value!r})")
    return "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Validate a config tree as is (no path resolution: ``load_config`` does that)."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


# Fields naming files, and how a relative value resolves (``_resolve_path``): against the config
# file's directory for a value written in the file, against the working directory for an override
# or a default. Resolved values are absolute, so a run's out_dir/config.yaml reloads unchanged.
#   path: always; data: only if it exists there (else a name the task looks up in the data
#   directory); policy: unless it looks like a hub id and does not exist there; template: unless
#   auto/none; reward: the file part of 'file.py:fn' / 'dir/file:fn' entries.
PATH_FIELDS: dict[str, str] = {
    "run.out_dir": "path",
    "policy.path": "policy",
    "task.train_path": "data",
    "task.eval_path": "data",
    "task.chat_template": "template",
    "task.reward": "reward",
    "task.env": "reward",
    "task.tools": "reward",
    "ranker.fit_file": "path",
    "generation.latency_profile": "path",
}

def _looks_like_hub_id(value: str) -> bool:
    """``Qwen/Qwen2.5-0.5B``: org/name, neither part hidden (``.cache/x``), not the tiny policy's cache."""
    from streamrl.models.hf import HUB_ID, is_tiny_policy_path  # light: no transformers at import

    return bool(HUB_ID.match(value)) and not any(part.startswith(".") for part in value.split("/")) \
        and not is_tiny_policy_path(value)


def _resolve_path(kind: str, value: Any, base: Path) -> Any:
    """``value`` of a ``PATH_FIELDS`` field of that ``kind``, a relative path made absolute
    against ``base``; anything that is not a path (or not a string) is returned as is."""
    if kind == "reward":
        if isinstance(value, list):
            return [_resolve_path("reward", v, base) for v in value]
        if not isinstance(value, str):
            return value
        target, sep, attr = value.rpartition(":")
        return f"{_resolve_path('path', target, base)}:{attr}" if sep and is_reward_file(target) else value
    if not isinstance(value, str) or not value.strip() or (kind == "template" and value in ("auto", "none")):
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    joined = os.path.normpath(base / path)
    if kind == "data" and not os.path.exists(joined):
        return value
    if kind == "policy" and not os.path.exists(joined) and _looks_like_hub_id(value):
        return value
    return joined


def _resolve_paths(tree: dict[str, Any], base: Path, defaults: bool = False) -> None:
    """Resolve the ``PATH_FIELDS`` of a raw config tree in place against ``base``; with
    ``defaults``, also the defaults of those the tree does not set."""
    for key, kind in PATH_FIELDS.items():
        section, name = key.split(".")
        if section not in tree and defaults:
            tree[section] = {}
        node = tree.get(section)
        if not isinstance(node, dict):
            continue  # validation names the bad section
        if name in node:
            node[name] = _resolve_path(kind, node[name], base)
        elif defaults:
            default = _model_in(Config.model_fields[section].annotation).model_fields[name].get_default(
                call_default_factory=True)
            resolved = _resolve_path(kind, default, base)
            if resolved != default:
                node[name] = resolved


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist" if not path.exists()
                          else f"config file {str(path)!r} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config of a YAML file (None: the defaults) with dotted overrides applied.

    Relative paths written in the file resolve against the file's directory; those given as
    overrides, and the defaults, against the working directory (see ``PATH_FIELDS``)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        tree = _read_config_file(p)
        _resolve_paths(tree, p.absolute().parent)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    _resolve_paths(tree, Path.cwd(), defaults=True)
    return config_from_dict(tree)


def plan_overrides(path: str | Path) -> list[str]:
    """A plan file (``streamrl plan --placement-out``: YAML config sections) as dotted overrides,
    applied before the command line's own."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--plan {str(path)!r}: no such file")
    tree = _read_config_file(p)
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}=" + yaml.dump(value, default_flow_style=True, width=float("inf")).strip()
                           .removesuffix("\n...").removesuffix("...").strip())
    walk(tree, "")
    return out


def split_cli_config(config: str | None, overrides: list[str] | tuple[str, ...],
                     default: str | None = None) -> tuple[str | None, list[str]]:
    """A command's ``[CONFIG] [overrides...]`` positionals: a first positional that looks like an
    override (``key=value``) is one, and ``default`` is the config file then."""
    overrides = list(overrides)
    if config is not None and "=" in config:
        config, overrides = default, [config] + overrides
    return (config if config is not None else default), overrides


def load_cli_config(config: str | None, overrides: list[str] | tuple[str, ...], default: str | None = None) -> Config:
    """``load_config`` on ``split_cli_config``'s result."""
    return load_config(*split_cli_config(config, overrides, default))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


class _OneLineDumper(yaml.SafeDumper):
    """Flow-style YAML on one line: multi-line or unprintable strings double-quoted (escaped)."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = '"' if ("\n" in text or not text.isprintable()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_OneLineDumper.add_representer(str, _represent_str)


def _yaml_entry(name: str, value: Any) -> str:
    """``name: value`` as one line of YAML (a list or mapping in flow style)."""
    text = yaml.dump({name: value}, Dumper=_OneLineDumper, default_flow_style=True, width=float("inf"),
                     sort_keys=False, allow_unicode=True).strip()
    return text[1:-1]  # drop the braces of the one-entry mapping


def _comment(text: str | None, indent: str = "", width: int = 100) -> list[str]:
    if not text:
        return []
    lines = []
    for para in inspect.cleandoc(text).split("\n\n"):
        if lines:
            lines.append(f"{indent}#")
        lines += textwrap.wrap(" ".join(para.split()), width - len(indent) - 2, initial_indent=f"{indent}# ",
                               subsequent_indent=f"{indent}# ", break_on_hyphens=False)
    return lines


def _annotated_fields(section, data: dict, indent: str) -> list[str]:
    """Each field of ``section`` as ``key: value`` under its description; a nested section (such as
    ``trainer.lora``) as a block of its own fields, one level deeper."""
    lines = []
    for key, sub in section.model_fields.items():
        lines += _comment(sub.description, indent)
        nested = _model_in(sub.annotation)
        if nested is not None and get_origin(sub.annotation) is None:
            lines.append(f"{indent}{key}:")
            lines += _annotated_fields(nested, data[key], indent + "  ")
        else:
            lines.append(indent + _yaml_entry(key, data[key]))
    return lines


def dump_config_annotated(cfg: Config, header: Iterable[str] = ()) -> str:
    """``cfg`` as YAML with each section's docstring and each key's description as ``#``
    comments (``streamrl config show``); ``load_config`` reads it back to ``cfg``."""
    data = cfg.model_dump()
    lines = [f"# {h}" for h in header] + ([""] if header else [])
    for name, field in Config.model_fields.items():
        section = _model_in(field.annotation)
        if section is None or get_origin(field.annotation) is not None:
            lines += _comment(field.description)
            lines.append(_yaml_entry(name, data[name]))
            continue
        lines.append("")
        lines += _comment(section.__doc__)
        lines.append(f"{name}:")
        lines += _annotated_fields(section, data[name], "  ")
    return "\n".join(lines).replace("\n\n\n", "\n\n").lstrip("\n") + "\n"
