"""Your reward function, named by path or handed over as a callable.

``task.reward: "package.module:function"`` or ``"/path/to/file.py:function"`` (verl's and slime's
convention); a list names several, summed with ``task.reward_weights`` (TRL's ``reward_funcs`` +
``reward_weights``). Each function is called as::

    fn(response: str, answer: str, prompt: str, metadata: dict) -> float | dict[str, float]

(the arguments: ``UserReward``). A dict is a set of named components: its ``"score"`` entry is
the reward when present, else the sum of its values; every component is logged
(``reward/component/<name>``). Invariant: ``UserReward`` runs in ``RewardRunner``'s workers, so
their timeout, error counting and worker-death handling apply to it unchanged.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from streamrl.config import is_reward_file
from streamrl.errors import UserError
from streamrl.types import Prompt

UserFn = Callable[[str, str, str, dict], "float | Mapping[str, float]"]


class RewardSpecError(UserError, ValueError):
    """A ``task.reward`` entry cannot be imported or has the wrong signature; names the entry."""


def _import_file(path: Path) -> Any:
    """Import ``path`` as a module under a name unique to its absolute path (two files called
    ``reward.py`` do not collide)."""
    name = f"streamrl_user_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardSpecError(f"task.reward: cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str, base_dir: str | Path | None = None, key: str = "task.reward") -> Any:
    """The object a ``'package.module:name'`` or ``'/path/file.py:name'`` spec names (``key``, the
    config field, goes into the error); ``RewardSpecError`` naming the spec if it cannot be had.
    A relative file path resolves against ``base_dir`` (the config file's directory), then the
    working directory."""
    target, sep, attr = spec.rpartition(":")
    what = {"task.reward": "function", "task.env": "ClassName"}.get(key, "name")
    if not sep or not target or not attr:
        raise RewardSpecError(f"{key}={spec!r} is not 'package.module:{what}' or '/path/file.py:{what}'")
    try:
        if is_reward_file(target):
            path = Path(target).expanduser()
            if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).is_file():
                path = Path(base_dir) / path
            if not path.is_file():
                raise RewardSpecError(f"{key}={spec!r}: file {str(path)!r} does not exist")
            module = _import_file(path.resolve())
        else:
            module = importlib.import_module(target)
    except RewardSpecError:
        raise
    except Exception as exc:
        raise RewardSpecError(f"{key}={spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise RewardSpecError(f"{key}={spec!r}: {target!r} has no {attr!r} (callables there: {names[:10]})")
    return obj


def load_reward_function(spec: str, base_dir: str | Path | None = None) -> UserFn:
    """The reward function a spec names, its signature checked (``load_object``)."""
    fn = load_object(spec, base_dir)
    check_signature(fn, spec)
    return fn


def check_signature(fn: Any, name: str) -> None:
    """The function must accept ``(response, answer, prompt, metadata)`` positionally."""
    if not callable(fn):
        raise RewardSpecError(f"task.reward={name!r} is not callable ({type(fn).__name__})")
    try:
        inspect.signature(fn).bind("response", "answer", "prompt", {})
    except TypeError as exc:
        raise RewardSpecError(f"task.reward={name!r} must accept (response, answer, prompt, metadata): {exc}") from None
    except ValueError:  # builtins without a signature: trust them
        pass


def _fn_name(fn: Any, spec: str | None) -> str:
    if spec is not None:
        return spec.rpartition(":")[2]
    return getattr(fn, "__name__", type(fn).__name__)


def combine(values: list[Any], names: list[str], weights: list[float]) -> tuple[float, dict[str, float]]:
    """The weighted reward and its named components from each function's return value."""
    from streamrl.tasks.rewards import normalize

    total, components = 0.0, {}
    for value, name, weight in zip(values, names, weights):
        try:
            score, parts = normalize(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"reward function {name!r}: {exc}") from None
        prefix = f"{name}/" if len(names) > 1 else ""
        components.update({f"{prefix}{k}": v for k, v in parts.items()})
        if len(names) > 1:
            components[name] = score
        if not math.isfinite(score):
            raise ValueError(f"reward function {name!r} returned a non-finite score {score!r}")
        total += weight * score
    return total, components


class UserReward:
    """Picklable ``(prompt, response) -> (reward, components)`` over user functions (see module doc).

    ``response`` is the decoded completion, ``answer`` the row's reference answer, ``prompt`` the
    prompt text the model saw (before the chat template), ``metadata`` the row's other columns
    (plus ``line`` and the raw ``problem``). It pickles as the spec strings (or, for callables, by
    cloudpickle, so a function defined in the user's own script or ``__main__`` travels) and
    imports lazily in the worker.
    """

    def __init__(self, specs: list[str] | None = None, weights: list[float] | None = None,
                 fns: list[UserFn] | None = None, base_dir: str | Path | None = None):
        self.specs = list(specs or [])
        self._given = list(fns or [])
        if not self.specs and not self._given:
            raise ValueError("UserReward needs at least one spec or function")
        for i, fn in enumerate(self._given):
            check_signature(fn, getattr(fn, "__name__", f"reward_fn[{i}]"))
        n = len(self.specs) + len(self._given)
        self.weights = [1.0] * n if weights is None else [float(w) for w in weights]
        if len(self.weights) != n:
            raise ValueError(f"{len(self.weights)} reward weights for {n} reward functions")
        self.base_dir = str(base_dir) if base_dir is not None else None
        self.names = [_fn_name(None, s) for s in self.specs] + [_fn_name(f, None) for f in self._given]
        self._fns: list[UserFn] | None = None

    def check(self) -> "UserReward":
        """Import every spec now (config time), so a typo fails before any work starts."""
        self._load()
        return self

    def prepare(self) -> None:
        """Import the functions (the reward worker calls this once at start, outside any timeout)."""
        self._load()

    def _load(self) -> list[UserFn]:
        if self._fns is None:
            self._fns = [load_reward_function(s, self.base_dir) for s in self.specs] + self._given
        return self._fns

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
        meta = dict(prompt.meta)
        values = [fn(response, prompt.answer, prompt.text, meta) for fn in self._load()]
        return combine(values, self.names, self.weights)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fns"] = None  # re-imported by path in the worker
        if self._given:
            import cloudpickle

            state["_given"] = cloudpickle.dumps(self._given)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        import pickle

        if isinstance(state.get("_given"), bytes):
            state["_given"] = pickle.loads(state["_given"])
        self.__dict__.update(state)
