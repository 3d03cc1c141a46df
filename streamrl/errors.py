"""The base of every error that is the user's mistake rather than a bug.

``streamrl`` (the CLI) prints such an error as one line, ``streamrl: error: <message>``, and
exits with status 2; ``streamrl --debug ...`` shows the traceback instead. Raise a subclass
with a message that names what the user wrote (the key, the value, the file and line).
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the CLI prints its message, not a traceback."""

    #: the CLI prints ``streamrl: <label>: <message>``
    label = "error"


class RunFailure(Exception):
    """A run stopped by a fault outside the user's input (every generation instance lost beyond
    the restart budget, the trainer died). The CLI prints ``streamrl: run failed: <message>``
    and exits with status 1; the last checkpoint is left as it was."""

    label = "run failed"


class GenerationFailed(RunFailure):
    """No generation instance is left and none could be started."""


class TrainerFailed(RunFailure):
    """The trainer actor (or the weights it published) is gone."""


class RunInterrupted(RunFailure):
    """SIGINT: the run stopped, after a checkpoint where one could be exact (the message says)."""

    label = "interrupted"
