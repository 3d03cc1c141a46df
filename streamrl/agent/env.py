"""The environment side of a trajectory, run inside an isolated worker process (``EnvHost``).

``task.env: "file.py:ClassName"`` names a class built once per trajectory as ``ClassName(row)``
with ``reset() -> str | list[dict]`` and ``step(assistant_text) -> (message | None, reward, done)``.
``task.tools`` adds function tools: an assistant turn with tool calls is answered by the tools
(the env is not stepped); a turn without is the env's (or, with no env, ends the episode).
Invariants: the host keeps each trajectory's env between calls, and rebuilds a lost one (its
worker was killed for another trajectory's hang) by replaying ``reset`` and the env's earlier
steps, so the parent never depends on which worker answers; tools hold no state.
"""

from __future__ import annotations

from typing import Any

from streamrl.agent import tools as tooling


def as_messages(value: Any, role: str = "user") -> list[dict]:
    """An env's message (a string, or chat messages) as chat messages; raises TypeError otherwise."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [dict(m) for m in value]
    raise TypeError(f"an environment message must be a str or a list of {{'role', 'content'}} dicts, "
                    f"got {type(value).__name__} {value!r:.80}")


def load_env_class(spec: str, base_dir: str | None = None):
    """The class ``task.env`` names, checked for ``reset`` and ``step``; ``RewardSpecError`` naming it."""
    from streamrl.tasks.user_reward import RewardSpecError, load_object

    cls = load_object(spec, base_dir, key="task.env")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing or not callable(cls):
        raise RewardSpecError(f"task.env={spec!r} must be a class with reset() and step(assistant_text); "
                              f"it lacks {missing or ['a constructor']}")
    return cls


def load_tools(specs: list[str], base_dir: str | None = None) -> dict:
    """``task.tools`` as ``{name: function}``, each schema-checked; ``RewardSpecError`` naming a bad one."""
    from streamrl.tasks.user_reward import RewardSpecError, load_object

    out = {}
    for spec in specs:
        fn = load_object(spec, base_dir, key="task.tools")
        try:
            tooling.check_tool(fn, spec)
        except ValueError as exc:
            raise RewardSpecError(str(exc)) from None
        out[fn.__name__] = fn
    return out


class EnvHost:
    """Runs in a worker: ``host("reset", tid, row, [])`` and ``host("step", tid, row, texts)``
    (``texts``: the assistant texts the env has stepped on so far, then the new one)."""

    raw_results = True  # the worker sends these dicts back as they are (no reward normalisation)

    def __init__(self, env_spec: str | None, tool_specs: list[str], base_dir: str | None = None) -> None:
        self.env_spec, self.tool_specs, self.base_dir = env_spec, list(tool_specs), base_dir
        self._cls = None
        self._tools: dict | None = None
        self._envs: dict[str, tuple[Any, int]] = {}  # trajectory -> (env, steps it has taken)

    def prepare(self) -> None:
        """Import the env and tools once, outside any timed call."""
        if self._tools is None:
            self._cls = load_env_class(self.env_spec, self.base_dir) if self.env_spec else None
            self._tools = load_tools(self.tool_specs, self.base_dir)

    def __getstate__(self) -> dict:
        return {"env_spec": self.env_spec, "tool_specs": self.tool_specs, "base_dir": self.base_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["env_spec"], state["tool_specs"], state["base_dir"])

    def __call__(self, op: str, tid: str, row: dict, texts: list[str]) -> dict:
        self.prepare()
        if op == "close":
            self._envs.pop(tid, None)
            return {}
        if op == "reset":
            env = self._cls(dict(row))
            first = env.reset()
            self._envs[tid] = (env, 0)
            return {"messages": as_messages(first)}
        text = texts[-1]
        calls, errors = tooling.parse_calls(text) if self._tools else ([], [])
        if calls or errors:
            messages, failed = tooling.run_calls(calls, errors, self._tools)
            return {"messages": messages, "reward": 0.0, "done": False, "tool_calls": len(calls) + len(errors),
                    "tool_errors": failed, "env_step": False}
        if self._cls is None:  # tools and no env: the first turn without a call ends the episode
            return {"messages": [], "reward": 0.0, "done": True, "env_step": False}
        env = self._env_at(tid, row, texts[:-1])
        message, reward, done = env.step(text)
        self._envs[tid] = (env, len(texts))
        reward = float(reward)
        if message is None or done:
            self._envs.pop(tid, None)
            return {"messages": [], "reward": reward, "done": True, "env_step": True}
        return {"messages": as_messages(message), "reward": reward, "done": False, "env_step": True}

    def _env_at(self, tid: str, row: dict, before: list[str]):
        """The trajectory's env after its steps on ``before``: kept, or rebuilt by replay."""
        env, steps = self._envs.get(tid, (None, -1))
        if env is not None and steps == len(before):
            return env
        env = self._cls(dict(row))
        env.reset()
        for text in before:
            env.step(text)
        return env
