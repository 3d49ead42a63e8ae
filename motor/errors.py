"""motor's own error tree (one module, three families).

* :class:`ConfigError` (also a ``ValueError``): bad input from a user: config file,
  command line.
* :class:`WireError` (also a ``ValueError``): malformed data from the wire (engine,
  controller, client).
* :class:`InternalError`: a bug in motor itself.

An engine's refusal is not an exception here: the request paths carry its status and body
to the client as they are (:mod:`motor.coordinator.routing`: ``union.Whole``, or
``pd_common.LegFailed`` with the engine's body, between the legs of a PD request).
"""
from __future__ import annotations


class MotorError(Exception):
    """Base of every exception motor raises on purpose."""


class ConfigError(MotorError, ValueError):
    """Invalid configuration: message names the field, the expected and the received value."""


class WireError(MotorError, ValueError):
    """Malformed data received from a peer."""


class InternalError(MotorError):
    """motor's own bug: an invariant did not hold."""
