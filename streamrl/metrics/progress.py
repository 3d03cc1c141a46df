"""Progress bars with an ETA for the long commands (rich), shown only on a terminal.

A command opens one with ``with progress.bar("train stream-async", total=40):``; code deep in
the library moves the innermost open bar with ``progress.advance()`` / ``progress.total(n)``
without a bar being threaded through every call (no bar open: both do nothing). Lines printed
while a bar is open appear above it. Output that is not a terminal (CI logs, pipes, tests) gets
no bar, so tables and logs stay clean; ``STREAMRL_PROGRESS=0`` turns bars off, ``=1`` forces
them on.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import IO, Iterator

_lock = threading.Lock()
_stack: list["Bar"] = []
_live = None  # the one rich Progress display while any bar is open


class Bar:
    """One rich task; ``None`` progress = a bar that is not shown."""

    def __init__(self, progress, task_id) -> None:
        self._progress, self._task = progress, task_id
        self.completed = 0.0

    def advance(self, n: float = 1.0) -> None:
        self.completed += n
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total, description=description)


def enabled(stream: IO | None = None) -> bool:
    """Bars on a terminal, unless ``STREAMRL_PROGRESS`` says otherwise."""
    flag = os.environ.get("STREAMRL_PROGRESS", "")
    if flag in ("0", "1"):
        return flag == "1"
    import sys

    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


@contextmanager
def bar(description: str, total: float | None = None, file: IO | None = None) -> Iterator[Bar]:
    """An open bar (to stderr or ``file``), innermost for ``advance``/``total`` until closed. A bar
    opened while another is open is a second line of the same display (rich allows one)."""
    global _live
    if _live is None and not enabled(file):
        handle = Bar(None, None)
        owner = False
    else:
        owner = _live is None
        if owner:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            console = Console(file=file, stderr=file is None, force_terminal=True if file is not None else None)
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
            _live = Progress(*columns, console=console, redirect_stdout=True, redirect_stderr=False)
            _live.start()
        handle = Bar(_live, _live.add_task(description, total=total))
    with _lock:
        _stack.append(handle)
    try:
        yield handle
    finally:
        with _lock:
            _stack.remove(handle)
        if owner:
            _live.stop()
            _live = None
        elif handle._progress is not None:
            handle._progress.remove_task(handle._task)  # a finished inner bar leaves the display


def advance(n: float = 1.0) -> None:
    """Move the innermost open bar (if any) by ``n``."""
    with _lock:
        top = _stack[-1] if _stack else None
    if top is not None:
        top.advance(n)


def total(n: float, description: str | None = None) -> None:
    """Set the innermost open bar's total (when the work is only known once started)."""
    with _lock:
        top = _stack[-1] if _stack else None
    if top is not None:
        top.update(total=n, description=description)


def update(completed: float, total_: float | None = None) -> None:
    """Set the innermost open bar's position (and total)."""
    with _lock:
        top = _stack[-1] if _stack else None
    if top is not None:
        top.update(completed=completed, total=total_)
