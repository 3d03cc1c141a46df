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
