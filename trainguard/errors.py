"""The one base class of mistakes a user can mend (bad flag, missing Java, unreachable broker).

The command line prints such an error as one line on stderr and exits non-zero, with no
traceback; anything else escaping is a bug in trainguard.
"""


class UserError(Exception):
    """An error whose message alone tells the user what is wrong and how to mend it."""
