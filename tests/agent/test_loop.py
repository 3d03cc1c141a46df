"""A trajectory between its turns, with a real tokenizer, ledger and tool worker (the engine's
turns are given as token ids): loss masks, versions, turn and tool accounting, the caps."""

from __future__ import annotations

import textwrap

import pytest

from streamrl.agent.chat import TurnRenderer
from streamrl.agent.env import EnvHost
from streamrl.agent.loop import AgentLoop
from streamrl.agent.runner import EnvRunner
from streamrl.agent.tools import schema
from streamrl.config import load_config
from streamrl.models.hf import PromptFormatter
from streamrl.sgs.ledger import Ledger, State
from streamrl.types import Completion, Prompt

TOOLS = textwrap.dedent('''
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: first
            b: second
        """
        return a + b
''')
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def setup(tmp_path_factory, chat_tokenizer):
    d = tmp_path_factory.mktemp("loop")
    tok = chat_tokenizer
    (d / "tools.py").write_text(TOOLS)
    spec = f"{d / 'tools.py'}:add"
    cfg = load_config(None, ["mode=stream-async", f"task.tools=['{spec}']", "task.max_turns=3",
                             "generation.max_new_tokens=200", "task.max_prompt_tokens=4000"])
    from streamrl.agent.env import load_tools

    renderer = TurnRenderer(PromptFormatter(tok, "auto", None), [schema(f) for f in load_tools([spec]).values()])
    runner = EnvRunner(EnvHost(None, [spec]), workers=2, timeout_s=10)
    yield cfg, tok, AgentLoop(cfg, renderer, runner, tok, has_env=False)
    runner.close()


def _turn(tok, req, text, version):
    ids = tuple(tok.encode(text, add_special_tokens=False)) + (tok.eos_token_id,)
    return Completion(req.request_id, req.prompt_id, req.sample_idx, req.prompt_ids, ids, (-0.5,) * len(ids), "stop",
                      version, version, 0.0, 1.0, instance="gen-0")


def _collect(loop):
    for _ in range(100):
        loop.wait(1.0)
        got = loop.collect()
        if got:
            return got
    raise AssertionError("the tool worker never answered")


def test_a_tool_turn_then_an_answer_is_one_trajectory_with_env_tokens_masked(setup):
    cfg, tok, loop = setup
    (req,) = loop.build([Prompt("p0", "what is 2+3?", "5")], 1, 0, "", 200, 4000)
    ledger = Ledger()
    ledger.add(req, 1.0)
    ledger.sent(req, "gen-0")
    out1 = _turn(tok, req, CALL, version=0)
    loop.on_turn(out1, ledger.turn_done(out1))
    assert ledger.record(req.request_id).state is State.ENV and loop.pending() == 1
    ((rid, env_ids, _),) = _collect(loop)
    nxt = ledger.next_turn(rid, env_ids)
    assert nxt.prompt_ids == req.prompt_ids + out1.output_ids + env_ids
    assert nxt.max_new_tokens == 200 - len(out1.output_ids)  # the budget counts sampled tokens only
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(env_ids)
    ledger.sent(nxt, "gen-0")
    assert ledger.take_from("gen-0") == [nxt]  # its instance lost mid-turn: it resumes from the last finished turn
    ledger.sent(nxt, "gen-1")
    out2 = _turn(tok, nxt, "answer 5", version=1)
    loop.on_turn(out2, ledger.turn_done(out2))
    ((rid, none, episode),) = _collect(loop)
    done = ledger.finish(rid, episode)
    n1, ne, n2 = len(out1.output_ids), len(env_ids), len(out2.output_ids)
    assert none is None and done.output_ids == out1.output_ids + env_ids + out2.output_ids
    assert done.loss_mask == (1,) * n1 + (0,) * ne + (1,) * n2 and done.generated == n1 + n2
    assert done.versions() == (0,) * (n1 + ne) + (1,) * n2 and done.version_start == 0
    assert done.logprobs[n1:n1 + ne] == (0.0,) * ne
    assert episode == {"turns": 2, "env_tokens": ne, "tool_calls": 1, "tool_errors": 0, "cut": None, "error": None,
                       "instances": ["gen-0", "gen-0"]}
    assert ledger.record(rid).state is State.DONE


def test_a_trajectory_that_keeps_calling_tools_is_cut_at_max_turns_and_counted(setup):
    cfg, tok, loop = setup
    (req,) = loop.build([Prompt("p1", "what is 2+3?", "5")], 1, 1, "", 200, 4000)
    ledger = Ledger()
    ledger.add(req, 1.0)
    current, before = req, dict(loop.counters)
    for turn in range(3):
        ledger.sent(current, "gen-0")
        c = _turn(tok, current, CALL, version=turn)
        loop.on_turn(c, ledger.turn_done(c))
        ((rid, ids, episode),) = _collect(loop)
        if ids is not None:
            current = ledger.next_turn(rid, ids)
    assert ids is None and episode["cut"] == "max_turns" and episode["turns"] == 3 and episode["tool_calls"] == 3
    assert loop.counters["cut_max_turns"] == before["cut_max_turns"] + 1
    assert ledger.finish(rid, episode).loss_mask.count(0) == episode["env_tokens"]
