"""Errors a user can act on. The ground floor: every module may import it; it imports nothing.

A `JobError` is printed by the command line as one line (exit code 2) and never with a traceback:
its message names the file, key or value at fault and what was expected. Anything else that
escapes a command is a bug, and keeps its traceback.
"""


class JobError(Exception):
    """A mistake in user input (job file, CLI value, SQL, a lake path) or a state of the lake the
    user must act on. Printed as one line, exit code 2."""
