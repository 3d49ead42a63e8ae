"""The policy interface: ``pick(candidates, request, exclude) -> endpoint``.

Every policy answers the same question from the same inputs: the candidate
endpoints (already filtered: routable, right role, right model, see
:meth:`motor.coordinator.endpoints.EndpointTable.candidates`), what is known of the
request (:class:`RequestInfo`) and the endpoints already tried for it (``exclude``).
A request path calls :meth:`Policy.prepare` once per request (policies that need the
body), :meth:`Policy.pick` per attempt and :meth:`Policy.routed` for the attempt it
sends. The registry maps the config name (also the metric label) to the
class; there are no aliases.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState


class RequestInfo:
    """What policies may look at: model, prompt size estimate (tokens), and, for
    ``kv_affinity``, block hashes of the routing key (:meth:`Policy.prepare`).

    After :meth:`Policy.pick`, ``prefill_tokens`` is the prompt tokens the chosen
    endpoint must still compute (the prompt minus its credited cached prefix) and
    ``cached_tokens`` the cached prefix found there (0 for policies that do not know);
    ``cost``, set only by policies that score candidates (``kv_affinity``, ``least_load``),
    the chosen one's cost in the policy's unit (read with ``getattr(info, "cost", None)``;
    ``kv_affinity`` with ``kv.cost: time``: predicted TTFT in seconds). ``ttft_obs``: what
    :meth:`Policy.watch` needs to learn from this request's observed TTFT (None: nothing).
    ``session``: the value of the request's session header (bytes, set by the request
    path; ``coordinator.kv.session.header``) or, after :meth:`Policy.prepare` of
    ``kv_affinity``, the body's ``user`` (str); None: no session.
    """

    __slots__ = ("model", "prompt_tokens", "max_tokens", "block_hashes", "prefill_tokens",
                 "cached_tokens", "cost", "ttft_obs", "session")
    cost: float      # no default: set by scoring policies only

    def __init__(self, model: str | None, prompt_tokens: int, max_tokens: int) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.block_hashes: Any = None
        self.prefill_tokens = prompt_tokens
        self.cached_tokens = 0
        self.ttft_obs: Any = None
        self.session: bytes | str | None = None


class Policy:
    """Base class; subclasses set ``name`` and implement :meth:`pick`."""

    name: ClassVar[str] = ""
    #: whether :meth:`prepare` needs the request body (tokenization for a routing key)
    uses_prefix: ClassVar[bool] = False
    #: whether :meth:`watch` may return a callback (request paths skip it otherwise)
    learns_ttft: bool = False

    def prepare(self, info: RequestInfo, route: str, body: dict[str, Any],
                off_loop: bool = False) -> Awaitable[None] | None:
        """Fill what the policy needs from the body (``route``: ``chat`` / ``completions``).
        ``off_loop``: the caller can await; long work may then go to a thread, and what is
        returned must be awaited before :meth:`pick` (``None``: done)."""
        return None

    def routed(self, ep: EndpointState, info: RequestInfo) -> None:
        """``info``'s request was sent to ``ep`` (called once per accepted attempt)."""

    def watch(self, ep: EndpointState, info: RequestInfo) -> Callable[[float], None] | None:
        """A callback for the observed TTFT (seconds) of ``info``'s attempt on ``ep``
        (called once, at the first token or the whole answer, by the attempt's
        :class:`~motor.coordinator.endpoints.Lease`), or None when the policy learns
        nothing from it (the default)."""
        return None

    def pick(self, candidates: list[EndpointState], request: RequestInfo,
             exclude: set[EndpointState] | None = None) -> EndpointState | None:
        """Choose one of ``candidates`` (never one in ``exclude`` unless nothing else is left);
        ``None`` only when ``candidates`` is empty."""
        raise NotImplementedError
