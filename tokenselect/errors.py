"""Errors a user can cause and fix. The CLI and the server print their message, never a traceback."""


class TokenSelectError(Exception):
    """Base class: the message names the problem and, where possible, the fix."""


class CheckpointError(TokenSelectError):
    """The model folder is missing, incomplete, or holds an architecture we do not run."""


class ContextTooLong(TokenSelectError):
    """A prompt (plus the tokens to generate) does not fit the configured context or the KV pool."""


class KVPoolFull(TokenSelectError):
    """The KV pool has no free slots left for this request."""
