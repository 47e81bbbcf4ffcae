"""User-facing errors.

Every mistake a user can make (bad spec, impossible budget, unsupported model, padded
batch) raises `KvevictError` with a message that names the fix. The CLI prints the
message on one line and exits with code 2, so nobody has to read a torch traceback to
learn that their budget was smaller than their sink count.
"""


class KvevictError(ValueError):
    """A problem with the user's input; the message says how to fix it."""
