"""
UserError: a user's mistake (a flag, a path, a file's content, a directory another run holds),
raised with a message that names the flag or the file and what to do. The command line says it in
one line, `error: ...`, exit status 2 (launch.user_errors_in_one_line); any other exception is a
bug, and keeps its traceback.
"""


class UserError(ValueError):
    """A ValueError, so that a caller catching one (a checkpoint found incomplete, a save that
    failed) still catches it."""
