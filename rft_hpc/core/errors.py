"""The one exception type for mistakes a user can fix (bad config, bad input file, bad path).

The CLI prints a `UserError` as a single clear message and exits non-zero, never with a
traceback. Library code raises it (or a subclass) whenever the cause lies outside rft-hpc.
"""


class UserError(Exception):
    """A problem with the user's input: the message says what is wrong and where."""
