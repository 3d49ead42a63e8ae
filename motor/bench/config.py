"""``BenchConfig``: everything one ``motor bench`` run needs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


#: dataset names (see :mod:`motor.bench.datasets`)
DATASETS = ("random", "shared-prefix", "multi-turn")
#: how the next request picks among the ready conversations (names as in vLLM's
#: benchmarks/multi_turn/benchmark_serving_multi_turn.py ``--conversation-sampling``)
CONVERSATION_SAMPLING = ("round_robin", "random")
#: closed-loop concurrency used when neither a concurrency nor a request rate is given
DEFAULT_CONCURRENCY = 8
#: number of requests of the single-turn datasets when none is given
DEFAULT_NUM_REQUESTS = 100


class BenchError(Exception):
    """A run that cannot start (bad config, unreachable server, no model)."""


@dataclass
class BenchConfig:
    """One benchmark run.  Lengths are in tokens (= bytes for the simulator).

    ``url`` is the server's base URL, with or without the OpenAI SDK's ``/v1``
    (:attr:`base_url`).  ``num_requests=None`` means 100 for ``random``/``shared-prefix`` and every
    turn of every conversation (``num_conversations * turns``) for
    ``multi-turn``.  ``concurrency=None`` means 8 in closed loop and no cap
    when ``request_rate`` is set.  ``model=None`` asks the server
    (first model of ``GET /v1/models``).
    """
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/chat/completions"
    model: str | None = None
    api_key: str | None = None
    # workload
    dataset: str = "random"
    num_requests: int | None = None
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 1024
    num_groups: int = 4
    num_conversations: int = 16
    turns: int = 4
    seed: int = 0
    conversation_sampling: str = "round_robin"
    # load
    concurrency: int | None = None
    request_rate: float | None = None
    stream: bool = True
    ignore_eos: bool = False
    duration: float | None = None
    timeout: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    # output
    progress: bool = False

    @property
    def chat(self) -> bool:
        """True when the endpoint takes chat messages (``.../chat/completions``)."""
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def base_url(self) -> str:
        """``url`` without a trailing ``/`` or ``/v1``: the OpenAI SDK's ``base_url`` form
        (``http://host:8000/v1``) names the same server as ``http://host:8000``, and the API
        paths (``endpoint``, ``/v1/models``) carry the ``/v1``."""
        url = self.url.rstrip("/")
        return url.removesuffix("/v1").rstrip("/") if url.endswith("/v1") else url

    @property
    def models_url(self) -> str:
        """Where the model list is asked for when ``model`` is None."""
        return self.base_url + "/v1/models"

    @property
    def target_url(self) -> str:
        """Where the requests go: ``base_url`` + ``endpoint`` (``url`` as given + ``endpoint``
        for an endpoint without the ``/v1``, such as ``--url http://h/v1 --endpoint
        /completions``)."""
        path = "/" + self.endpoint.lstrip("/")
        if path.startswith("/v1/"):
            return self.base_url + path
        return self.url.rstrip("/") + path

    def validate(self) -> None:
        """Raise :class:`BenchError` naming the first bad field."""
        def bad(name: str, expected: str) -> BenchError:
            return BenchError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        if not self.url.startswith(("http://", "https://")):
            raise bad("url", "an http:// or https:// base URL")
        if not self.endpoint.startswith("/"):
            raise bad("endpoint", "a path starting with / (e.g. /v1/chat/completions)")
        if self.dataset not in DATASETS:
            raise bad("dataset", "one of " + ", ".join(DATASETS))
        for name in ("input_len", "output_len", "num_groups", "num_conversations", "turns"):
            if int(getattr(self, name)) < 1:
                raise bad(name, "an integer >= 1")
        if self.conversation_sampling not in CONVERSATION_SAMPLING:
            raise bad("conversation_sampling", "one of " + ", ".join(CONVERSATION_SAMPLING))
        if self.seed < 0:
            raise bad("seed", "an integer >= 0")
        if self.prefix_len < 0:
            raise bad("prefix_len", "an integer >= 0")
        if self.num_requests is not None and self.num_requests < 1:
            raise bad("num_requests", "an integer >= 1 or None")
        if not 0 <= self.range_ratio < 1:
            raise bad("range_ratio", "a number in [0, 1)")
        if self.concurrency is not None and self.concurrency < 1:
            raise bad("concurrency", "an integer >= 1 or None")
        if self.request_rate is not None and not self.request_rate > 0:
            raise bad("request_rate", "a number > 0 (requests/s) or None")
        if self.duration is not None and not self.duration > 0:
            raise bad("duration", "a number of seconds > 0 or None")
        if not self.timeout > 0:
            raise bad("timeout", "a number of seconds > 0")
        if not isinstance(self.extra_body, dict):
            raise bad("extra_body", "a JSON object (dict)")

    def effective_concurrency(self) -> int | None:
        """The in-flight cap actually used (None: no cap)."""
        if self.concurrency is not None:
            return self.concurrency
        return None if self.request_rate is not None else DEFAULT_CONCURRENCY

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d
