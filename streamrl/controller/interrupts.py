"""Ctrl-C during a run: the first asks the run to stop after the current step with a checkpoint,
the second stops at once.

The first SIGINT only sets a flag and says so on the console at once: the loop checks the flag
after each iteration, waits for the trainer to finish what it was given and writes an exact
checkpoint. A second SIGINT raises ``KeyboardInterrupt`` where the run is: nothing more is saved
and the last checkpoint written is kept (checkpoint files are replaced atomically). Installed
only in the main thread, and only where SIGINT has Python's default handler: a run started with
SIGINT ignored (``nohup``) keeps it ignored.
"""

from __future__ import annotations

import signal
import threading

_active: "GracefulStop | None" = None


def stop_requested() -> bool:
    """True once the running loop's first Ctrl-C has arrived."""
    return _active is not None and _active.requested


class GracefulStop:
    """Context manager around a run's loop (``Run.loop``)."""

    def __init__(self, echo) -> None:
        self.echo = echo
        self.requested = False
        self._previous = None

    def __enter__(self) -> "GracefulStop":
        global _active
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            _active = self
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.echo("Ctrl-C: the run stops after the current step and saves a checkpoint "
                  "(Ctrl-C again stops at once, keeping the last checkpoint written)")

    def __exit__(self, *exc) -> None:
        global _active
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if _active is self:
            _active = None
