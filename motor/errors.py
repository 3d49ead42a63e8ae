"""motor's own error tree (one module, four families).

* :class:`ConfigError` (also a ``ValueError``): bad input from a user: config file,
  command line.
* :class:`EngineError`: an engine answered with an error status; carries it.
* :class:`WireError` (also a ``ValueError``): malformed data from the wire (engine,
  controller, client).
* :class:`InternalError`: a bug in motor itself.
"""
from __future__ import annotations


class MotorError(Exception):
    """Base of every exception motor raises on purpose."""


class ConfigError(MotorError, ValueError):
    """Invalid configuration: message names the field, the expected and the received value."""


class EngineError(MotorError):
    """An engine refused a request.

    Parameters
    ----------
    status : int
        HTTP status the engine answered with.
    body : bytes
        The engine's body, passed to the client unchanged when possible.
    """

    def __init__(self, status: int, body: bytes = b"") -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


class WireError(MotorError, ValueError):
    """Malformed data received from a peer."""


class InternalError(MotorError):
    """motor's own bug: an invariant did not hold."""
