"""Errors a user can act on: the CLI prints them as one line, never a traceback."""


class UserError(Exception):
    """A problem with the user's input or setup; its message says what to fix."""
