"""The one error type of the data-splitting library.

A PrepareError carries one line that names what is wrong and where, e.g.
``--input /x/y: no such file or directory``.  ``prepare.py`` prints it as
``prepare.py: <message>`` and exits with status 2, without a traceback.

When the orchestrator's ``UserError`` exists, PrepareError is a subclass of
it, so ``fab split-data`` reports it like any other user error.
"""

try:  # pragma: no cover - depends on what the rest of the repo provides
    from fabtrain.errors import UserError as _Base
except Exception:  # ImportError, or a half-written package while it is built
    _Base = Exception


class PrepareError(_Base):
    """Bad input, bad flags, or an output directory we must not touch."""

    exit_code = 2

    def __init__(self, message: str):
        # Keep the message on one line whatever the cause looked like.
        message = " ".join(str(message).split())
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
