"""User-facing error types: each carries a message meant to be shown without a traceback."""


class JaxinferError(Exception):
    """Base class for errors whose message is complete and meant for the user."""


class CheckpointError(JaxinferError):
    """A checkpoint is missing, unreadable, of an unknown architecture, or has bad tensors."""


class ConfigError(JaxinferError):
    """An engine, model or serving setting is out of range or inconsistent."""


class RequestError(JaxinferError):
    """A request field is invalid; the message names the field and the limit."""


class CompileAfterWarmupError(JaxinferError):
    """The step met a shape that warm-up did not compile while the compile guard is strict."""
