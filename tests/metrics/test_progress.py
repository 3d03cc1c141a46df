"""Progress bars: shown on a terminal with an ETA, nested bars share one display, nothing at
all when output is not a terminal."""

import io

from streamrl.metrics import progress


def test_bar_renders_counts_and_eta_and_library_code_moves_the_innermost(monkeypatch):
    monkeypatch.setenv("STREAMRL_PROGRESS", "1")
    buf = io.StringIO()
    with progress.bar("outer", total=3, file=buf) as outer:
        for _ in range(3):
            with progress.bar("inner", total=2) as inner:
                progress.advance()
                progress.advance()
                assert inner.completed == 2
            outer.advance()
    text = buf.getvalue()
    assert "outer" in text and "3/3" in text and "ETA" in text
    assert outer.completed == 3


def test_no_bar_off_a_terminal_and_advance_without_a_bar_is_a_no_op(monkeypatch, capsys):
    monkeypatch.delenv("STREAMRL_PROGRESS", raising=False)
    progress.advance()  # nothing open: nothing happens
    with progress.bar("quiet", total=2) as b:  # pytest's stderr is not a terminal
        progress.advance(2)
        print("a line")
    assert b.completed == 2
    out = capsys.readouterr()
    assert out.out == "a line\n" and "quiet" not in out.err
