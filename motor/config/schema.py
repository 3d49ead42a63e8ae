"""The cluster configuration schema (pydantic v2).

One file describes a whole cluster: the controller's address, the coordinator
(listen address, deployment mode, routing policy, timeouts, retries) and the
nodes with their engines. Unknown keys are errors (``extra="forbid"``) so a
typo never silently falls back to a default; engine-specific options go in
``engine_config`` and are passed through to the engine as ``--kebab-case`` flags.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from enum import Enum
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag,
                      field_validator, model_validator)

from motor.hosts import is_host
from motor.config.engine_flags import MANAGED_FLAGS, flag_key, managed_flags


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def valid_host(value: str) -> str:
    """A host field's value checked (:func:`motor.hosts.is_host`): an IPv4 / IPv6 address
    (``0.0.0.0`` and ``::`` = every interface) or a DNS host name of RFC 1123 labels
    (``localhost``, ``node-1.example.com``, a trailing dot allowed); at most 253 characters.

    Raises
    ------
    ValueError
        ``expected an IP address or a DNS host name ..., got 'not a host!!'``.
    """
    if is_host(value):
        return value
    hint = " (without brackets)" if value.startswith("[") else ""
    raise ValueError(f"expected an IPv4 / IPv6 address{hint} or a DNS host name (RFC 1123: "
                     f"labels of letters, digits and inner hyphens, joined by dots), "
                     f"got {value!r}")


#: a host field: an IP address or an RFC 1123 host name (:func:`valid_host`)
Host = Annotated[str, AfterValidator(valid_host)]


class Role(str, Enum):
    """What an instance does in the request path."""
    UNION = "union"      #: prefill and decode on the same instance
    PREFILL = "prefill"
    DECODE = "decode"


class EngineKind(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"


class Platform(str, Enum):
    """The accelerators of a node: which ``*_VISIBLE_DEVICES`` variable an engine's devices go
    in, and (vLLM) which PD connector is the default (docs/pd.md, "Ascend defaults")."""
    ASCEND = "ascend"   #: Ascend NPUs: ``ASCEND_RT_VISIBLE_DEVICES``; vLLM = vLLM-Ascend
    CUDA = "cuda"       #: NVIDIA GPUs: ``CUDA_VISIBLE_DEVICES``
    CPU = "cpu"         #: no accelerator: no device variable, no device allocation


#: the environment variable that names an engine's devices, per platform
DEVICE_ENV: dict[Platform, str] = {Platform.ASCEND: "ASCEND_RT_VISIBLE_DEVICES",
                                   Platform.CUDA: "CUDA_VISIBLE_DEVICES"}


class DeploymentMode(str, Enum):
    """How the coordinator drives a request through instances."""
    UNION = "union"
    PD_PREFILL_FIRST = "pd_prefill_first"
    PD_DECODE_FIRST = "pd_decode_first"
    PD_BOOTSTRAP = "pd_bootstrap"


class PolicyName(str, Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    KV_AFFINITY = "kv_affinity"


class RestartPolicy(str, Enum):
    ALWAYS = "always"
    ON_FAILURE = "on-failure"
    NEVER = "never"


class ControlPlaneTlsConfig(_Strict):
    """mTLS on every control-plane connection (controller, node managers, coordinators;
    docs/security.md): one CA and one certificate every component presents."""
    ca_file: str = Field(..., min_length=1,
                         description="PEM CA bundle that signs every control-plane certificate: "
                                     "the controller and the node managers' management APIs "
                                     "accept only clients with a certificate it signed; node "
                                     "managers and coordinators check the controller's "
                                     "certificate against it (and its host name)")
    cert_file: str = Field(..., min_length=1,
                           description="PEM certificate chain, leaf first, that this component "
                                       "presents (as a server and as a client); it must name "
                                       "the host / IP address the others connect to "
                                       "(`controller.host`, `nodes[].host`)")
    key_file: str | None = Field(None, description="PEM private key; null = in `cert_file`")
    key_password_file: str | None = Field(
        None, description="file holding the key's password (an encrypted key)")


def _etcd_endpoint(value: str) -> str:
    """``HOST:PORT``, ``http://HOST:PORT`` or ``https://HOST:PORT`` of an etcd member's client
    URL -> ``HOST:PORT`` (``https://`` kept: it needs ``controller.etcd.tls``)."""
    from urllib.parse import urlsplit
    raw = value.strip()
    u = urlsplit(raw if "//" in raw else "http://" + raw)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None \
            or u.path not in ("", "/"):
        raise ValueError(f"expected an etcd client address HOST:PORT, http://HOST:PORT or "
                         f"https://HOST:PORT, got {value!r}")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{'https://' if u.scheme == 'https' else ''}{host}:{port}"


class EtcdTlsConfig(_Strict):
    """TLS to the etcd members (etcd's ``--cert-file`` / ``--trusted-ca-file`` /
    ``--client-cert-auth``)."""
    ca_file: str = Field(..., min_length=1,
                         description="PEM CA bundle that signs the etcd members' server "
                                     "certificates (checked, with the host name)")
    cert_file: str | None = Field(
        None, description="PEM client certificate presented to etcd (needed when etcd runs "
                          "with --client-cert-auth); null = none")
    key_file: str | None = Field(None, description="PEM private key of `cert_file`; null = in "
                                                   "`cert_file`")


class EtcdConfig(_Strict):
    """The etcd cluster that holds the controllers' state and elects their leader
    (docs/control-plane.md, "Controller HA on etcd")."""
    endpoints: list[Annotated[str, AfterValidator(_etcd_endpoint)]] = Field(
        ..., min_length=1, description="client addresses of the etcd members, `HOST:PORT` or "
                                       "`http://HOST:PORT`; tried in turn")
    prefix: str = Field("/motor", min_length=1, pattern=r"^/[A-Za-z0-9_./-]*$",
                        description="key prefix of this cluster in etcd (several clusters can "
                                    "share one etcd with different prefixes)")
    lease_ttl_s: int = Field(2, ge=2, le=60,
                             description="TTL of the leader's lease in seconds (etcd's minimum "
                                         "is 2): a leader that dies or loses etcd is replaced "
                                         "within about this long; it renews every TTL / 3")
    timeout_s: float = Field(1.0, gt=0, le=30, description="timeout of one etcd request")
    tls: EtcdTlsConfig | None = Field(
        None, description="TLS to etcd (every endpoint); null = plain gRPC")

    @model_validator(mode="after")
    def _schemes_fit_tls(self) -> EtcdConfig:
        for i, e in enumerate(self.endpoints):
            if e.startswith("https://") and self.tls is None:
                raise ValueError(f"endpoints[{i}]: an https:// etcd endpoint needs "
                                 f"controller.etcd.tls (the CA to check it), got {e!r} with "
                                 f"tls null")
        return self

    @property
    def addresses(self) -> list[str]:
        """``HOST:PORT`` of every endpoint (scheme dropped)."""
        return [e.removeprefix("https://") for e in self.endpoints]


class ControllerConfig(_Strict):
    """Where the controller listens and how it judges heartbeats."""
    host: Host = Field("127.0.0.1", description="listen address: an IP address or a DNS host name")
    port: int = Field(18500, ge=1, le=65535)
    heartbeat_interval_s: float = Field(1.0, gt=0, description="how often node managers heartbeat")
    heartbeat_timeout_s: float = Field(
        5.0, gt=0, description="no heartbeat for this long -> the node's instances become "
                               "unhealthy; at least 2 x `heartbeat_interval_s` (one late or "
                               "lost heartbeat must not make them unhealthy)")
    remove_after_s: float = Field(
        60.0, gt=0, description="unhealthy for this long without a heartbeat -> instance removed")
    watch_timeout_s: float = Field(30.0, gt=0, description="longest long-poll hold of GET /v1/instances")
    tls: ControlPlaneTlsConfig | None = Field(
        None, description="mTLS on the control plane (the controller's port, the node managers' "
                          "management APIs, every client of them); null = plain HTTP")
    etcd: EtcdConfig | None = Field(
        None, description="controller HA: several controllers share their state in etcd and "
                          "elect one leader by lease; null = one controller, state in memory")
    advertise_host: Host | None = Field(
        None, description="the address other components reach this controller at (published "
                          "as the leader's address); null = `host` (required when `host` is "
                          "0.0.0.0 or ::); `motor controller --advertise-host` overrides")
    peers: list[str] = Field(
        default_factory=list,
        description="URLs of every controller (`http://HOST:PORT`, or one Service name that "
                    "reaches any of them): node managers, coordinators and `motor ctl` try them "
                    "in turn and follow the leader; empty = the one at `host`:`port`")

    @property
    def urls(self) -> list[str]:
        """The controllers' URLs a client tries: ``peers``, else ``[url]``."""
        return list(self.peers) if self.peers else [self.url]

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, ``https://`` with ``tls`` set."""
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


class TimeoutConfig(_Strict):
    """Upstream timeouts of the coordinator, in seconds. There is no total-duration limit."""
    connect_s: float = Field(5.0, gt=0, description="TCP connect to an engine")
    pool_wait_s: float = Field(
        10.0, gt=0, description="longest wait for a free connection when all "
                                "`max_connections_per_endpoint` of an engine are busy; then "
                                "the request is retried elsewhere (not counted against the "
                                "engine's breaker) or answered 503")
    first_token_s: float = Field(600.0, gt=0, description="request sent -> first byte of the answer")
    idle_s: float = Field(600.0, gt=0, description="longest silence between two chunks of an answer")
    keepalive_s: float = Field(
        15.0, ge=0, description="an SSE comment `: keep-alive` goes to a streaming client after this "
                                "much upstream silence, so idle-timeout hops in front of motor do not "
                                "cut a healthy stream; 0 = off")


class RetryConfig(_Strict):
    """Retries before the first byte reached the client."""
    max_attempts: int = Field(3, ge=1, le=16, description="attempts in all, the first one included")
    backoff_s: float = Field(0.02, ge=0, description="sleep before the 2nd attempt; doubles each "
                                                     "time; at most `backoff_max_s`")
    backoff_max_s: float = Field(1.0, ge=0, description="cap of the sleep between two attempts")
    retry_statuses: list[int] = Field(
        [429, 502, 503, 504], description="engine answers (before any byte reached the client) that "
                                          "are re-sent to another endpoint; any 5xx that carries "
                                          "`Retry-After` is retried too. A client's 4xx never is")

    @field_validator("retry_statuses")
    @classmethod
    def _retryable_status(cls, v: list[int]) -> list[int]:
        for code in v:
            if not (code == 429 or 500 <= code <= 599):
                raise ValueError(f"expected 429 or a 5xx status in every entry, got {code}")
        return v


class BreakerConfig(_Strict):
    """Per-endpoint circuit breaker (see docs/faults.md)."""
    failure_threshold: int = Field(
        3, ge=1, description="consecutive failures (transport errors, 5xx other than 503) that open "
                             "it; a refused connection opens it at once. 4xx, 429 and 503 never count")
    open_s: float = Field(1.0, gt=0, description="first open period, at most `open_max_s`; then "
                                                 "one half-open probe request")
    open_max_s: float = Field(30.0, gt=0, description="cap of the open period, which doubles after each "
                                                      "failed probe")


class FailoverConfig(_Strict):
    """Mid-stream failover of streaming requests (see docs/faults.md)."""
    enabled: bool = Field(True, description="continue a stream whose engine failed on another instance")
    max_continuations: int = Field(3, ge=0, le=16, description="continuation legs per request at most")
    request_token_ids: str = Field(
        "auto", pattern="^(auto|always|never)$",
        description="ask the engine for `return_token_ids` (needed to continue exactly): `auto` = for "
                    "every engine kind but sglang, `always`, `never` (= no mid-stream failover)")


class KvTierCreditConfig(_Strict):
    """Share of a cached block's prefill that ``kv_affinity`` counts as saved, per tier."""
    device: float = Field(1.0, ge=0, le=1, description="accelerator memory (HBM; vLLM medium `GPU`)")
    host: float = Field(0.75, ge=0, le=1, description="host DRAM (`CPU`, `cpu`, `CPU_PINNED`)")
    disk: float = Field(0.25, ge=0, le=1, description="disk / remote store (`STORAGE`, `DISK`, `EXTERNAL`)")


class KvCost(str, Enum):
    """What ``kv_affinity`` minimises (docs/kv-routing.md, "Cost")."""
    TIME = "time"       #: predicted TTFT in seconds, rates learned per instance
    TOKENS = "tokens"   #: prompt-token equivalents with weights and the load guard (default)


class KvTtftConfig(_Strict):
    """The TTFT model of `kv.cost: time`: prior rates (until learned) and the learning."""
    step_ms: float = Field(6.0, gt=0, description="prior fixed time of one engine step, ms "
                                                  "(weights read once per step)")
    prefill_us_per_token: float = Field(37.0, gt=0, description="prior prefill time per "
                                                                "uncached prompt token, us")
    decode_us_per_seq: float = Field(100.0, ge=0, description="prior time one sequence of the "
                                                              "running batch adds to a step, us")
    chunk_tokens: int = Field(8192, ge=1, description="prefill tokens an engine step computes at "
                                                      "most (vLLM `max_num_batched_tokens`)")
    learn: bool = Field(True, description="fit each instance's rates to its observed TTFT")
    stall_weight: float = Field(
        1.0, ge=0, description="instances are compared on the request's predicted TTFT plus "
                               "this x the time its uncached prefill holds up the sequences "
                               "already running there (running x prefill s/token x tokens); "
                               "0 = the TTFT alone")
    halflife_requests: float = Field(64.0, gt=0, description="an observation's weight in the fit "
                                                             "halves after this many newer ones "
                                                             "of the same instance")
    prior_weight: float = Field(1.0, gt=0, description="weight of the prior rates in the fit, in "
                                                       "observations")
    pool_weight: float = Field(
        16.0, ge=0, description="each instance's fit is shrunk toward the pooled fit of all the "
                                "instances the policy fits, weighing this many average "
                                "observations (less as its own accumulate); keeps identical "
                                "instances from learning apart from the cold-start burst; "
                                "0 = each fit alone")
    engine_figures_max_age_s: float = Field(
        5.0, gt=0, description="engine-reported waiting / running requests (multi-worker "
                               "scrape) older than this are ignored")


class ApproximateMode(str, Enum):
    """When the coordinator inserts what it routed into an approximate prefix index."""
    AUTO = "auto"   #: for endpoints without a KV-event publisher
    ON = "on"       #: for every endpoint (alongside events)
    OFF = "off"


class KvApproximateConfig(_Strict):
    """Approximate mode: without KV events, remember which blocks were routed where."""
    mode: ApproximateMode = ApproximateMode.AUTO
    ttl_s: float = Field(300.0, gt=0, description="a routed block is forgotten this long after it "
                                                  "was last routed")
    max_blocks: int = Field(1_000_000, ge=1, description="cap of distinct blocks remembered per "
                                                         "instance group (least recently routed go "
                                                         "first)")


class KvGroupConfig(_Strict):
    """Settings of one instance group (the instances serving one model)."""
    approximate: KvApproximateConfig = Field(default_factory=KvApproximateConfig)


class KvEventsConfig(_Strict):
    """Subscription to the engines' KV-event publishers (ZMQ SUB)."""
    enabled: bool = Field(True, description="subscribe to every instance that has a `kv_events` address")
    replay_timeout_s: float = Field(
        1.0, gt=0, description="after a sequence gap, wait this long for the replay socket's answer; "
                               "without replay (or on timeout) the instance's blocks are purged")
    backends: dict[str, str] = Field(
        default_factory=dict,
        description="standalone mode (`--backend`): backend URL http://HOST:PORT -> its KV-event "
                    "address `[bind:]tcp://HOST:PORT[;replay=ENDPOINT]` (also `--kv-events URL=ADDRESS`)")


class KvSessionConfig(_Strict):
    """Session affinity of `kv_affinity`: a soft preference for the endpoint that served
    the session's last request (motor/coordinator/policy/sessions.py)."""
    enabled: bool = Field(True, description="lean a session's requests to its last endpoint")
    header: str = Field("x-session-id", min_length=1, pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
                        description="request header naming the session (case-insensitive); "
                                    "without it, the body's `user` field (`user_field`)")
    user_field: bool = Field(True, description="without the header, the request body's `user` "
                                               "(OpenAI's end-user id) names the session")
    credit_tokens: float = Field(
        1024.0, ge=0, description="how much cheaper the session's last endpoint is, in prompt "
                                  "tokens: `cost: tokens` takes this many prompt-token "
                                  "equivalents off its cost, `cost: time` this many tokens at "
                                  "that instance's prefill time per token (seconds); never more, "
                                  "so a larger load difference wins; 0 = off")
    max_sessions: int = Field(65536, ge=1, description="sessions remembered per coordinator worker "
                                                       "(the least recently routed forgotten "
                                                       "first)")


class KvRoutingConfig(_Strict):
    """KV-cache-aware routing (policy `kv_affinity`), see docs/kv-routing.md."""
    block_size: int = Field(16, ge=1, le=4096, description="tokens per block of motor's prefix index; "
                                                            "engine block sizes must be multiples of it")
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="model name (`*` = any other) -> `builtin` or a model directory with "
                    "tokenizer.json + tokenizer_config.json (motor sim writes "
                    "~/.cache/motor/sim-tokenizer); unlisted models use `builtin`")
    tier_credit: KvTierCreditConfig = Field(default_factory=KvTierCreditConfig)
    cost: KvCost = Field(KvCost.TOKENS, description="`time`: the candidate with the lowest "
                                                     "predicted TTFT (`ttft`; experimental, "
                                                     "docs/kv-routing.md); `tokens`: prompt-token "
                                                     "equivalents (`prefill_weight`, "
                                                     "`decode_weight`, `queue_penalty_tokens`, "
                                                     "`load_guard`)")
    ttft: KvTtftConfig = Field(default_factory=KvTtftConfig)
    session: KvSessionConfig = Field(default_factory=KvSessionConfig)
    prefill_weight: float = Field(0.25, ge=0, description="cost per uncached prompt token in flight on "
                                                           "an instance (in flight until the answer ends, "
                                                           "so it counts prefills already done: < 1)")
    decode_weight: float = Field(0.0, ge=0, description="cost per token of max_tokens in flight on an "
                                                         "instance")
    queue_penalty_tokens: float = Field(64.0, ge=0, description="cost per request in flight on an "
                                                                  "instance, in prompt-token equivalents")
    load_guard: float = Field(2.0, ge=0, description="an instance whose load is above this factor x "
                                                     "the other candidates' mean load gets no cache "
                                                     "credit; 0 = off")
    load_guard_min_tokens: float = Field(
        4096.0, ge=0, description="the load guard acts only once some candidate's load exceeds this")
    events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    approximate: KvApproximateConfig = Field(default_factory=KvApproximateConfig)
    groups: dict[str, KvGroupConfig] = Field(
        default_factory=dict, description="per model name: overrides of `approximate`")


class PdTransferConfig(_Strict):
    """KV transfer time per prompt token between a prefill and a decode instance, by how
    close they are (`pd.joint.topology`), microseconds."""
    same_node: float = Field(0.7, ge=0, description="both on one node (NVLink / shared "
                                                    "memory), us per token")
    same_rack: float = Field(2.6, ge=0, description="same rack, other node (RDMA), us per "
                                                    "token")
    other: float = Field(5.0, ge=0, description="anywhere else, or closeness unknown, us per "
                                                "token")


class PdJointConfig(_Strict):
    """Joint (prefill, decode) choice and conditional disaggregation (docs/pd.md, "Joint
    choice")."""
    enabled: bool = Field(False, description="choose the prefill and decode instances as a "
                                             "pair, by one predicted cost in seconds (prefill "
                                             "with P's cache, KV transfer, D's load); false = "
                                             "`prefill_policy` then `decode_policy`")
    local_prefill: bool = Field(
        True, description="with `enabled`: a request whose prefill on a decode instance is "
                          "predicted cheaper than prefill elsewhere + transfer (short or mostly "
                          "cached there) goes to that decode instance alone, without "
                          "`kv_transfer_params` (vLLM decode instances with a `kv_both` "
                          "connector prefill it locally). Not in `pd_bootstrap` (SGLang "
                          "decode instances need a prefill peer)")
    stall_weight: float = Field(
        1.0, ge=0, description="weight, in the joint cost, of the delay a request imposes on "
                               "each sequence decoding on its decode instance: the stall of "
                               "its local prefill, and its own decode steps (1 = each "
                               "running sequence's delay counts as much as this request's "
                               "time; 0 = ignore the decode batch's TPOT; below 1 more "
                               "requests go local: lower TTFT, higher TPOT, "
                               "docs/benchmarks.md)")
    transfer_us_per_token: PdTransferConfig = Field(default_factory=PdTransferConfig)
    topology: dict[str, str] = Field(
        default_factory=dict,
        description="where instances are: instance id, `host:port` or host -> `RACK/NODE` "
                    "(e.g. `r1/n3`); unlisted endpoints on one host count as one node, "
                    "others as `other`")

    @field_validator("topology")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, label in v.items():
            if not k or not re.fullmatch(r"[^/\s]+/[^/\s]+", label):
                raise ValueError(f"topology: {k!r} -> {label!r}: expected a non-empty key and "
                                 f"a label RACK/NODE (two non-empty parts without spaces)")
        return v


class PdConfig(_Strict):
    """Prefill/decode disaggregation (the `pd_*` modes; see docs/pd.md)."""
    prefill_policy: PolicyName | None = Field(
        None, description="policy that picks the prefill instance; null = `coordinator.policy` "
                          "(with `coordinator.policy: kv_affinity` the prefill choice uses the "
                          "KV events; a `kv_affinity` here under another coordinator policy "
                          "uses the approximate index only)")
    decode_policy: PolicyName = Field(
        PolicyName.LEAST_LOAD, description="policy that picks the decode instance")
    prefill_timeout_s: float | None = Field(
        None, gt=0, description="prefill leg: longest wait for its first byte and longest silence "
                                "after it (decode-first: per metaserver callback; bootstrap: the "
                                "prefill answer); null = `timeouts.first_token_s`")
    fallback_to_union: bool = Field(
        True, description="with no ready prefill or decode instance, send the request to a "
                          "`union` instance through the ordinary path; false (or no union "
                          "instance) = 503")
    metaserver_url: str | None = Field(
        None, pattern=r"^https?://",
        description="`pd_decode_first`: the URL decode instances POST their callback to; null = "
                    "`http://<coordinator.host>:<coordinator.port>/v1/metaserver` (the host's "
                    "address when listening on 0.0.0.0). Set it when the engines reach the "
                    "coordinator through another address (NAT, a load balancer)")
    joint: PdJointConfig = Field(default_factory=PdJointConfig)


class FeedConfig(_Strict):
    """The feed process of a multi-worker coordinator (`workers` > 1), docs/coordinator.md."""
    scrape_interval_s: float = Field(
        1.0, ge=0, description="period of the engines' /metrics scrape (waiting, running, KV "
                               "usage into the shared load table); 0 = no scrape")
    ring_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024,
                            description="capacity of each feed -> worker shared-memory ring")
    max_backlog_records: int = Field(
        10000, ge=16, description="records waiting for a worker's ring beyond this: the worker "
                                  "fell behind, its backlog is replaced by a fresh snapshot")


class GcConfig(_Strict):
    """Python's cyclic garbage collector in each coordinator worker process (docs/coordinator.md,
    "Garbage collection")."""
    freeze: bool = Field(
        True, description="just before the worker listens, collect once and move every object "
                          "made at startup (the modules, the config, the routing tables) out "
                          "of the collector's reach (`gc.freeze()`): a full collection then "
                          "walks only what requests made")
    young_threshold: int = Field(
        10000, ge=0, le=1_000_000,
        description="allocations of container objects, net of frees, that start a "
                    "young-generation collection (`gc.set_threshold`'s first value; "
                    "CPython 3.11-3.13's default is 700); 0 = the interpreter's thresholds "
                    "kept. Higher values collect reference cycles later (more memory held "
                    "between two collections)")


class TlsServerConfig(_Strict):
    """TLS on the API port (docs/security.md)."""
    cert_file: str = Field(..., min_length=1, description="PEM certificate chain, leaf first")
    key_file: str | None = Field(None, description="PEM private key; null = in `cert_file`")
    key_password_file: str | None = Field(
        None, description="file holding the key's password (an encrypted key)")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle: clients must present a certificate it signed (mTLS); "
                          "null = no client certificate asked")
    reload_interval_s: float = Field(
        5.0, gt=0, description="how often the files are checked for a change (a rotated "
                               "certificate is used by new connections; SIGHUP checks at once)")


class TlsClientConfig(_Strict):
    """HTTPS to engines: backends given as `https://`, and engines registered as `https`
    (`engines[].tls`) (docs/security.md)."""
    ca_file: str | None = Field(None, description="PEM CA bundle; null = the system's CAs")
    verify: bool = Field(True, description="check the engine's certificate and host name")
    cert_file: str | None = Field(None, description="client certificate (engines that ask "
                                                    "for mTLS)")
    key_file: str | None = None
    key_password_file: str | None = None


class ApiKeyConfig(_Strict):
    """One API key with its name (the name, never the key, shows in metrics, limits, logs)."""
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.:@-]+$")
    key: str = Field(..., min_length=1, repr=False,
                     description="the key, or its hash: `pbkdf2_sha256$<iterations>$<salt>$"
                                 "<hash>`, `scrypt$<n>$<r>$<p>$<salt>$<hash>` or "
                                 "`<salt hex>:<iterations>:<hash hex>` (docs/security.md)")


def _key_item_kind(v: Any) -> str:
    return "key" if isinstance(v, dict | ApiKeyConfig) else "text"


#: an entry of ``coordinator.api_keys``: a key (text) or ``{name, key}``
ApiKeyItem = Annotated[Annotated[str, Tag("text")] | Annotated[ApiKeyConfig, Tag("key")],
                       Discriminator(_key_item_kind)]


class KeyLimitConfig(_Strict):
    """Limits and scheduling of one key (or of every key not listed)."""
    rpm: float | None = Field(None, gt=0, description="requests per minute; null = unlimited")
    tpm: float | None = Field(None, gt=0, description="tokens per minute (prompt estimate + "
                                                      "max_tokens at admission, corrected by "
                                                      "the answer's usage); null = unlimited")
    priority: str | None = Field(None, description="admission class of its requests when the "
                                                   "request names none; null = the last class")
    weight: int = Field(1, ge=1, le=1000, description="requests per turn inside its class")


class LimitsConfig(_Strict):
    """Per-key rate limits (token buckets, docs/security.md)."""
    default: KeyLimitConfig = Field(default_factory=KeyLimitConfig,
                                    description="keys not listed in `keys` (and `anonymous` "
                                                "when no key is checked)")
    keys: dict[str, KeyLimitConfig] = Field(default_factory=dict,
                                            description="key name -> its limits")
    burst_s: float = Field(1.0, gt=0, le=60, description="bucket capacity in seconds of the "
                                                         "limit (a burst above the rate)")


class AdmissionConfig(_Strict):
    """Admission control: a cap on requests in flight and a bounded priority queue."""
    max_in_flight: int = Field(0, ge=0, description="requests in flight per coordinator worker at "
                                                    "most; 0 = no cap (and no queue)")
    max_queue: int = Field(1024, ge=0, description="requests waiting at most (all classes); "
                                                   "one more gets 503 at once")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in the queue, then 503 "
                                                           "with Retry-After")
    classes: list[str] = Field(["interactive", "batch"], min_length=1,
                               description="priority classes, highest first")
    max_wait_s: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="class name -> its longest wait in the queue, seconds (classes not named: "
                    "`queue_timeout_s`); an interactive class whose TTFT must stay near the "
                    "unloaded one waits about one unloaded TTFT at most")
    predict: bool = Field(
        True, description="refuse at arrival (503 `predicted wait`, Retry-After = the "
                          "prediction) a request the queue is predicted not to serve within "
                          "its class's longest wait, from the rate requests end and the higher "
                          "classes' demand, and keep free slots for the higher classes' "
                          "expected demand (docs/security.md). false = strict order only: "
                          "every queued request waits until served or its longest wait passed")
    priority_header: str = Field("x-motor-priority", pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$",
                                 description="request header naming a class (an HTTP field "
                                             "name, RFC 9110 token); it may lower a key's "
                                             "class, not raise it above the key's `priority`")
    max_inflight_per_instance: int = Field(
        0, ge=0, description="requests in flight per endpoint at most for endpoints whose "
                             "engine states no limit (standalone `--backend`s, instances "
                             "registered without `max_inflight`); 0 = no cap. An endpoint at "
                             "its cap takes no request; when every candidate is at its cap a "
                             "request waits up to `queue_timeout_s`, then 503")
    shed_waiting: int = Field(
        0, ge=0, description="an endpoint whose engine reports at least this many waiting "
                             "requests (the multi-worker scrape of its /metrics) is skipped "
                             "while another candidate reports fewer; 0 = off")


class TracingConfig(_Strict):
    """OpenTelemetry traces of the coordinator's requests (docs/observability.md): one span per
    request with child spans for tokenization, the routing decision and each upstream leg,
    exported over OTLP/HTTP by a batch span processor. Needs the ``tracing`` extra
    (``pip install motor[tracing]``: ``opentelemetry-sdk``,
    ``opentelemetry-exporter-otlp-proto-http``)."""
    enabled: bool = Field(False, description="make and export spans; off = no per-request work")
    endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces",
        description="OTLP/HTTP traces URL of the collector (protobuf POSTs)")
    sample_ratio: float = Field(
        1.0, ge=0, le=1,
        description="share of the requests without a valid client `traceparent` that are "
                    "traced; a client's `traceparent` decides by its sampled flag (parent-based)")
    service_name: str = Field("motor-coordinator", min_length=1,
                              description="`service.name` of the spans' resource")
    headers: dict[str, str] = Field(
        default_factory=dict, repr=False,
        description="HTTP headers sent with every export (a collector's auth token)")


class CoordinatorConfig(_Strict):
    """The gateway."""
    host: Host = Field("127.0.0.1", description="listen address: an IP address or a DNS host name")
    port: int = Field(8000, ge=1, le=65535)
    mode: DeploymentMode = Field(
        DeploymentMode.UNION,
        description="`union`: engines of role `union` only; a `pd_*` mode: at least one "
                    "`prefill` and one `decode` engine, and for every model one has, the other "
                    "(`union` engines alongside serve the routes that are not disaggregated and "
                    "`pd.fallback_to_union`); `pd_decode_first` with `workers: 1`")
    policy: PolicyName = PolicyName.ROUND_ROBIN
    workers: int = Field(1, ge=1, le=64, description="ingress worker processes (1 with mode "
                                                     "`pd_decode_first`)")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024,
                                description="largest accepted request body (bytes)")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="largest accepted request head: the target and every "
                                        "header name and value together (bytes); above it 431 "
                                        "and the connection is closed")
    request_read_timeout_s: float = Field(
        30.0, gt=0, description="a client must send a request's headers and body within this "
                                "long, else 408 and the connection is closed (slow clients)")
    keepalive_timeout_s: float = Field(
        75.0, gt=0, description="an idle client keep-alive connection is closed after this long")
    max_connections_per_endpoint: int = Field(
        1024, ge=1, description="cap of pooled upstream connections per engine endpoint")
    max_idle_connections_per_endpoint: int = Field(
        64, ge=0, description="idle keep-alive connections kept per engine endpoint; more are "
                              "closed when released (after a burst)")
    send_timeout_s: float = Field(
        60.0, ge=0, description="a client that reads nothing of its answer for this long (its "
                                "socket buffer stays full) is disconnected and its engine "
                                "request ended; 0 = never")
    health_check_interval_s: float = Field(
        1.0, gt=0, description="period of the coordinator's reads of its endpoints' /v1/models (both "
                               "modes) and, standalone, of its own /health probes")
    health_check_timeout_s: float = Field(2.0, gt=0)
    health_failures: int = Field(3, ge=1, description="standalone: consecutive failed probes -> endpoint out")
    kv: KvRoutingConfig = Field(default_factory=KvRoutingConfig)
    pd: PdConfig = Field(default_factory=PdConfig)
    feed: FeedConfig = Field(default_factory=FeedConfig)
    management_port: int | None = Field(
        None, ge=1, le=65535,
        description="`workers` > 1: port of the management API served by the feed process "
                    "(/liveness, /readiness, /instances with the load summed over workers, "
                    "/metrics aggregated); null = none (each worker still answers them on `port`)")
    drain_timeout_s: float = Field(
        10.0, gt=0, description="on SIGTERM: how long in-flight requests may take to finish")
    api_keys: list[ApiKeyItem] = Field(
        default_factory=list, repr=False,
        description="keys clients must send as `Authorization: Bearer <key>` on the inference "
                    "routes and `/v1/models` (others get 401 with an OpenAI error body and "
                    "reach no engine): a key (plain or hashed) or `{name, key}`; the "
                    "comma-separated env var `MOTOR_API_KEYS` and `api_keys_file` add to it; "
                    "none = no check. A client's key is never forwarded to the engines "
                    "when keys are set (see `worker_api_key`)")
    api_keys_file: str | None = Field(
        None, description="file of keys (`name key` or `key` per line, `#` comments) or a "
                          "directory with one key per file named by the key's name (a mounted "
                          "Secret); re-read when it changes")
    tls: TlsServerConfig | None = Field(None, description="TLS on `port`; null = plain HTTP")
    upstream_tls: TlsClientConfig = Field(default_factory=TlsClientConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    worker_api_key: str | None = Field(
        None, repr=False,
        description="key motor sends to the engines as `Authorization: Bearer <key>` (env var "
                    "`MOTOR_WORKER_API_KEY` when null), replacing the client's header; null "
                    "with no `api_keys` = the client's `Authorization` is forwarded as sent")
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    gc: GcConfig = Field(default_factory=GcConfig)
    access_log: bool = Field(
        False, description="one structured log line per inference request at INFO (logger "
                           "`motor.access`: request id, key name, route, model, endpoint, "
                           "status, TTFT, E2E, tokens)")


class RestartConfig(_Strict):
    policy: RestartPolicy = RestartPolicy.ALWAYS
    backoff_initial_s: float = Field(0.5, gt=0, description="first restart delay, doubling after "
                                                            "each; at most `backoff_max_s`")
    backoff_max_s: float = Field(30.0, gt=0)
    max_restarts: int = Field(10, ge=0, description="give up after this many restarts in window_s")
    window_s: float = Field(300.0, gt=0)


class VirtualInferenceConfig(_Strict):
    """Virtual inference: a tiny periodic ``/v1/completions`` on DP rank 0 that catches an engine
    whose ``/health`` answers but which can no longer generate. A round fails only when the
    request failed AND the AI-core use of the engine's NPUs stayed below ``npu_busy_pct`` (a busy
    engine is not a dead one); ``failures`` failed rounds in a row -> the instance is reported
    unhealthy (nothing is killed; the controller decides)."""
    enabled: bool | None = Field(
        None, description="null = on for `vllm`, off for `sim` and `sglang` (SGLang's own /health "
                          "generates a token)")
    warmup_s: float = Field(180.0, ge=0, description="wait after the first healthy /health before the first round")
    interval_s: float = Field(5.0, gt=0, description="time between two rounds")
    timeout_s: float = Field(5.0, gt=0, description="timeout of the completion request")
    failures: int = Field(6, ge=1, description="failed rounds in a row -> instance unhealthy")
    npu_busy_pct: float = Field(
        3.0, ge=0, le=100, description="AI-core use (%) at or above which a failed round is not "
                                       "counted (the engine is busy, not dead)")
    npu_sample_interval_s: float = Field(0.5, gt=0, description="AI-core sampling period during a round")
    npu_min_window_s: float = Field(
        3.0, ge=0, description="a failed round samples the AI-core use for at least this long")
    prompt: str = Field("1", min_length=1, description="prompt of the 1-token completion")


#: the engines' TLS flags: motor sets them from ``engines[].tls``, refused in ``engine_config``
#: (an engine serving HTTPS that motor does not know of would be probed and routed as plain
#: HTTP). vLLM: ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs``
#: (vllm-project/vllm ``vllm/entrypoints/openai/cli_args.py``; in vLLM 0.32.0
#: ``vllm/entrypoints/launchers/cli_args.py``, ``FrontendArgs``); SGLang: ``--ssl-keyfile``,
#: ``--ssl-certfile``, ``--ssl-ca-certs`` (sgl-project/sglang
#: ``python/sglang/srt/server_args.py``, section "SSL/TLS"); motor sim: the vLLM names.
TLS_FLAGS = ("ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "ssl-cert-reqs")


class EngineTlsConfig(_Strict):
    """HTTPS on the API ports of an engine group (docs/security.md, "HTTPS to engines"): the
    node manager starts the engines with these files, probes them over HTTPS and registers
    their endpoints as ``https``; the coordinator reaches them with `coordinator.upstream_tls`."""
    cert_file: str = Field(..., min_length=1,
                           description="PEM certificate chain, leaf first, the engines serve "
                                       "(vLLM / SGLang / sim `--ssl-certfile`); it must name "
                                       "the engines' `host` (what the coordinator and the node "
                                       "manager connect to and check)")
    key_file: str = Field(..., min_length=1,
                          description="its PEM private key (`--ssl-keyfile`), not encrypted "
                                      "(vLLM has no password flag)")
    ca_file: str | None = Field(
        None, description="PEM CA bundle the node manager's probes (health, virtual inference, "
                          "/metrics) check the engines' certificate against, with the host "
                          "name; null = the system's CAs. The coordinator checks against "
                          "`coordinator.upstream_tls.ca_file`")
    client_ca_file: str | None = Field(
        None, description="mTLS: the engines refuse a client without a certificate this CA "
                          "signed (vLLM / sim `--ssl-ca-certs` with `--ssl-cert-reqs 2`; not "
                          "SGLang, which has no flag to require one); the coordinator then "
                          "presents `coordinator.upstream_tls.cert_file`, the node manager "
                          "`client_cert_file`. null = no client certificate asked")
    client_cert_file: str | None = Field(
        None, description="with `client_ca_file`: the PEM certificate chain the node "
                          "manager's probes present")
    client_key_file: str | None = Field(
        None, description="its PEM private key; null = in `client_cert_file`")

    @model_validator(mode="after")
    def _client_certificate(self) -> EngineTlsConfig:
        if self.client_ca_file and not self.client_cert_file:
            raise ValueError("client_cert_file: expected the certificate the node manager's "
                             "probes present to engines that ask for one (client_ca_file is "
                             "set), got none")
        if self.client_key_file and not self.client_cert_file:
            raise ValueError("client_key_file: expected client_cert_file with it, got none")
        return self


#: engine flags motor sets on an instance that spans nodes (``span``), refused in its
#: ``engine_config``: vLLM's multi-node data parallel and SGLang's multi-node launch flags
SPAN_FLAGS = ("data-parallel-size-local", "data-parallel-start-rank", "data-parallel-address",
              "data-parallel-rpc-port", "headless", "nnodes", "node-rank", "dist-init-addr",
              "dp-size-local", "dp-master", "dp-start-rank")


class SpanConfig(_Strict):
    """An instance whose data-parallel ranks run on several nodes: one DP master (its node
    runs the API server) and headless nodes (docs/control-plane.md, "Instances across nodes").
    Every node it lists declares the engine group (same name, kind, role, model,
    served_model_name, dp_size, tp_size, engine_config and span); each declaration may set
    its own devices, env and launcher."""
    nodes: list[Annotated[str, Field(min_length=1)]] = Field(
        ..., min_length=2,
        description="the nodes of the instance by `nodes[].name`, the DP master first: node k "
                    "runs DP ranks k x dp_size_local .. (k+1) x dp_size_local - 1")
    dp_size_local: int | None = Field(
        None, ge=1, le=256, description="DP ranks on each node; null = dp_size / len(nodes) "
                                        "(dp_size must be len(nodes) x dp_size_local)")
    master_address: Host | None = Field(
        None, description="the address the other nodes reach the DP master at (vLLM "
                          "--data-parallel-address, SGLang --dist-init-addr); null = the "
                          "master node's `host`")
    master_port: int | None = Field(
        None, ge=1, le=65535,
        description="the DP master's port the other nodes connect to (vLLM "
                    "--data-parallel-rpc-port, the port of SGLang's --dist-init-addr, motor "
                    "sim's --dp-master); null = 29550 + the instance's position among the "
                    "master node's instances")

    @field_validator("nodes")
    @classmethod
    def _distinct_nodes(cls, v: list[str]) -> list[str]:
        dup = sorted({n for n in v if v.count(n) > 1})
        if dup:
            raise ValueError(f"expected distinct node names, got {', '.join(dup)} more than once")
        return v


class EngineConfig(_Strict):
    """One engine group on a node: ``count`` instances of the same kind and role."""
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    kind: EngineKind = EngineKind.SIM
    role: Role = Role.UNION
    model: str = Field(..., min_length=1, description="model path or name given to the engine")
    served_model_name: str | None = Field(None, description="name clients use; defaults to model")
    count: int = Field(1, ge=1, le=256, description="instances of this engine")
    dp_size: int = Field(1, ge=1, le=256, description="data-parallel ranks per instance (one endpoint each)")
    tp_size: int = Field(1, ge=1, le=256)
    host: Host = Field("127.0.0.1", description="the instances' listen address: an IP address "
                                                "or a DNS host name")
    base_port: int = Field(18100, ge=1, le=65535,
                           description="first HTTP port; instance i, DP rank r gets base_port + i*dp_size + r")
    max_inflight: int | None = Field(
        None, ge=1, description="requests the coordinators send one endpoint (DP rank) at "
                                "once at most; null = the engine's own limit from "
                                "engine_config (`max_num_seqs`: vllm, sim; "
                                "`max_running_requests`: sglang), none when it sets none")
    engine_config: dict[str, Any] = Field(
        default_factory=dict,
        description="passed through to the engine as --kebab-case flags (`max_model_len` and "
                    "`max-model-len` are one flag: give it once); not the flags motor sets from "
                    "the fields here (" + "; ".join(
                        f"{kind}: {', '.join(flags)}" for kind, flags in MANAGED_FLAGS.items())
                    + ")")
    env: dict[str, str] = Field(default_factory=dict)
    devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="device ids of the whole group (`vllm` / `sglang` on an `ascend` or "
                          "`cuda` node): `count` x `dp_size` x `tp_size` distinct ids; instance "
                          "i, DP rank r gets the `tp_size` ids from position (i*dp_size + r)*"
                          "tp_size (SGLang: the instance's `dp_size*tp_size` ids). null = the "
                          "lowest devices of the node that no group before it (and no explicit "
                          "`devices` of any group) takes, in config order. Two groups of a node "
                          "may not share a device")
    launcher: list[str] | None = Field(
        None, description="command that starts the engine (default per kind)")
    health_path: str = "/health"
    health_interval_s: float = Field(0.5, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    startup_timeout_s: float = Field(600.0, gt=0)
    stop_timeout_s: float = Field(10.0, gt=0, description="SIGTERM -> this long -> SIGKILL of the group")
    restart: RestartConfig = Field(default_factory=RestartConfig)
    virtual_inference: VirtualInferenceConfig = Field(default_factory=VirtualInferenceConfig)
    tls: EngineTlsConfig | None = Field(
        None, description="HTTPS on the engines' API ports (`vllm`, `sglang`, `sim`); null = "
                          "plain HTTP")
    span: SpanConfig | None = Field(
        None, description="the instance spans nodes (DP master + headless nodes); `count` 1, "
                          "`dp_size` = len(span.nodes) x span.dp_size_local, `devices` and "
                          "allocation per node for its dp_size_local x tp_size devices; null = "
                          "every instance on this node")

    @model_validator(mode="after")
    def _span_fits_group(self) -> EngineConfig:
        s = self.span
        if s is None:
            return self
        if self.count != 1:
            raise ValueError(f"count: expected 1 with span (one instance spans the nodes), "
                             f"got {self.count}")
        local = s.dp_size_local
        if local is None and self.dp_size % len(s.nodes):
            raise ValueError(f"span.dp_size_local: expected dp_size = {self.dp_size} to divide "
                             f"by len(span.nodes) = {len(s.nodes)} when it is null, got null")
        if local is not None and local * len(s.nodes) != self.dp_size:
            raise ValueError(f"dp_size: expected len(span.nodes) x span.dp_size_local = "
                             f"{len(s.nodes)} x {local} = {len(s.nodes) * local}, got "
                             f"{self.dp_size}")
        if s.master_address in ("0.0.0.0", "::"):
            raise ValueError(f"span.master_address: expected an address the other nodes can "
                             f"reach, got the wildcard {s.master_address!r}")
        for raw in self.engine_config:
            if flag_key(raw) in SPAN_FLAGS:
                raise ValueError(f"engine_config.{raw}: expected a flag motor does not set "
                                 f"itself (it sets --{flag_key(raw)} of an instance spanning "
                                 f"nodes from span), got it set")
        return self

    @model_validator(mode="after")
    def _tls_fits_engine(self) -> EngineConfig:
        for raw in self.engine_config:
            if flag_key(raw) in TLS_FLAGS:
                raise ValueError(f"engine_config.{raw}: expected a flag motor does not set "
                                 f"itself (it sets --{flag_key(raw)} from tls, so that the "
                                 f"engines are probed and routed over HTTPS), got it set")
        t = self.tls
        if t is None:
            return self
        if self.kind is EngineKind.SGLANG and t.client_ca_file:
            raise ValueError("tls.client_ca_file: expected none for an sglang engine (SGLang "
                             "loads --ssl-ca-certs but has no flag to require a client "
                             f"certificate), got {t.client_ca_file!r}")
        if self.host in ("0.0.0.0", "::"):
            raise ValueError(f"host: expected the address the engines' certificate names with "
                             f"tls (the coordinator connects to it and checks the name), got "
                             f"the wildcard {self.host!r}")
        return self

    @property
    def dp_size_local(self) -> int:
        """DP ranks of one instance on one node: ``span.dp_size_local`` (or ``dp_size /
        len(span.nodes)``) with ``span``, else ``dp_size``."""
        s = self.span
        if s is None:
            return self.dp_size
        return s.dp_size_local or self.dp_size // len(s.nodes)

    @field_validator("devices")
    @classmethod
    def _distinct_devices(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            dup = sorted({d for d in v if v.count(d) > 1})
            if dup:
                raise ValueError(f"expected distinct device ids, got {_ids(dup)} more than once")
        return v

    @model_validator(mode="after")
    def _devices_fit_group(self) -> EngineConfig:
        if self.devices is None:
            return self
        if self.kind is EngineKind.SIM:
            raise ValueError(f"devices: expected none for a sim engine (it uses no device), "
                             f"got {self.devices}")
        need = self.devices_per_instance * self.count
        if len(self.devices) != need:
            dp = "span.dp_size_local" if self.span is not None else "dp_size"
            raise ValueError(
                f"devices: expected count x {dp} x tp_size = {self.count} x "
                f"{self.dp_size_local} x {self.tp_size} = {need} device ids, got "
                f"{len(self.devices)} ({self.devices})")
        return self

    @property
    def devices_per_instance(self) -> int:
        """Devices one instance takes on one node: ``dp_size * tp_size`` (each DP rank
        ``tp_size``); with ``span``, ``dp_size_local * tp_size``."""
        return self.dp_size_local * self.tp_size

    def flag_value(self, key: str) -> Any:
        """The ``engine_config`` value of flag ``key`` in any spelling (None if absent)."""
        k = flag_key(key)
        for raw, v in self.engine_config.items():
            if flag_key(raw) == k:
                return v
        return None

    @property
    def virtual_inference_on(self) -> bool:
        """Whether DP rank 0 of this engine gets the virtual-inference probe."""
        vi = self.virtual_inference.enabled
        return self.kind is EngineKind.VLLM if vi is None else vi

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class NpuConfig(_Strict):
    """NPU sampling with Ascend's ``npu-smi`` (health, temperature, power, HBM, AI-core use per
    chip) for the node manager's metrics, heartbeats and the virtual-inference busy check."""
    enabled: bool | None = Field(
        None, description="null = on when `smi_path` is found; false = off; true = on (a missing "
                          "npu-smi is then logged as an error once)")
    smi_path: str = Field("npu-smi", min_length=1, description="the npu-smi command (looked up on PATH)")
    interval_s: float = Field(5.0, gt=0, description="period of `npu-smi info` sampling")
    timeout_s: float = Field(5.0, gt=0, description="timeout of one npu-smi call")


class NodeConfig(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    host: Host = Field("127.0.0.1", description="the node manager's address (registration, "
                                                "management API): an IP address or a DNS host name")
    log_dir: str | None = Field(None, description="engine logs (default: a temp dir per run)")
    mgmt_port: int | None = Field(
        None, ge=0, le=65535, description="node manager's management API port (/health, /metrics, "
                                          "/v1/instances); 0 = any; null = off; `--port` overrides")
    npu: NpuConfig = Field(default_factory=NpuConfig)
    platform: Platform = Field(
        Platform.ASCEND,
        description="the node's accelerators: `ascend` (NPUs: `ASCEND_RT_VISIBLE_DEVICES`; "
                    "`vllm` engines are vLLM-Ascend, with its PD connector defaults), `cuda` "
                    "(GPUs: `CUDA_VISIBLE_DEVICES`; vLLM's NixlConnector default), `cpu` (no "
                    "device variable, no device allocation)")
    devices: int | None = Field(
        None, ge=1, le=4096,
        description="how many devices the node has (ids 0..devices-1); an engine group's "
                    "`devices` id or an allocation beyond it is refused at load time; null = "
                    "not checked")
    engines: list[EngineConfig] = Field(default_factory=list)

    @field_validator("engines")
    @classmethod
    def _unique_engine_names(cls, v: list[EngineConfig]) -> list[EngineConfig]:
        seen: set[str] = set()
        for e in v:
            if e.name in seen:
                raise ValueError(f"engine names must be unique within a node, got {e.name!r} twice")
            seen.add(e.name)
        return v


#: the fields every declaration of an engine group spanning nodes has alike
SPAN_ALIKE = ("kind", "role", "model", "served_model_name", "dp_size", "tp_size",
              "engine_config", "span")

#: the checks across fields of :class:`ClusterConfig` (and of standalone ``motor coordinator
#: --backend``), as docs/configuration.md lists them: (fields, rule)
CROSS_FIELD_RULES: list[tuple[str, str]] = [
    ("`coordinator.mode: union`, `nodes[].engines[].role`",
     "every engine is `union` (a prefill or decode engine would be sent whole requests)"),
    ("`coordinator.mode: pd_*`, `nodes[].engines[].role`",
     "at least one `prefill` and one `decode` engine; `union` engines beside them are allowed "
     "(routes that are not disaggregated, `coordinator.pd.fallback_to_union`)"),
    ("`coordinator.mode: pd_*`, `nodes[].engines[].model` / `served_model_name`",
     "every model a prefill engine serves has a decode engine, and the other way round"),
    ("`motor coordinator --backend`, `--mode` / `coordinator.mode`",
     "the same two role rules for the backends' roles (`prefill=URL`, `decode=URL`)"),
    ("`coordinator.mode: pd_decode_first`, `coordinator.workers`", "`workers` is 1"),
    ("`controller.heartbeat_timeout_s`, `controller.heartbeat_interval_s`",
     "timeout >= 2 x interval (one late or lost heartbeat does not make instances unhealthy)"),
    ("`coordinator.retries.backoff_s`, `coordinator.retries.backoff_max_s`", "backoff <= max"),
    ("`coordinator.breaker.open_s`, `coordinator.breaker.open_max_s`", "open <= max"),
    ("`nodes[].engines[].restart.backoff_initial_s`, `nodes[].engines[].restart.backoff_max_s`",
     "initial <= max"),
    ("`nodes[].engines[].engine_config`, `nodes[].engines[].kind`",
     "no flag motor sets itself for that kind (see `engine_config`), no flag in two spellings"),
    ("`nodes[].engines[].devices`, `nodes[].devices`, `count`, `dp_size`, `tp_size`",
     "no device of a node in two engine groups (explicit `devices`, or allocated in config "
     "order from the lowest free id); every id below `nodes[].devices` when it is set"),
    ("`nodes[].platform: ascend`, `kind: vllm`, `role: prefill` / `decode`, "
     "`coordinator.mode`",
     "the vLLM prefill (decode) engines of a model share one `dp_size` / `tp_size` when motor "
     "fills in a vLLM decode (prefill) engine's `kv_connector_extra_config`, unless that engine's "
     "`engine_config.kv_transfer_config.kv_connector_extra_config` names the other side"),
    ("`nodes[].engines[].span`", "every node it lists exists and declares the engine group "
     "with the same kind, role, model, served_model_name, dp_size, tp_size, engine_config and "
     "span; `count` 1; `dp_size` = len(nodes) x dp_size_local; no vLLM / SGLang multi-node flag "
     "in `engine_config`; the master reachable (not a wildcard address)"),
    ("every `host`", "an IPv4 / IPv6 address or a DNS host name of RFC 1123 labels"),
    ("`nodes[].name`; `nodes[].engines[].name` within a node", "unique"),
    ("every port (`controller.port`, `coordinator.port`, `coordinator.management_port`, "
     "`nodes[].mgmt_port`, each instance's and DP rank's port from `base_port`)",
     "no two listeners on the same host and port (`0.0.0.0` clashes with every host)"),
]


def role_problem(mode: DeploymentMode, roles: Collection[Role], what: str = "engine",
                 mode_field: str = "coordinator.mode") -> str | None:
    """What the roles of a set of engines lack for ``mode``, or None when they fit.

    ``union`` takes union engines only (a prefill or decode engine would be sent whole
    requests); a ``pd_*`` mode needs at least one prefill and one decode engine (union engines
    beside them are allowed: they serve the routes that are not disaggregated, and the PD ones
    with ``coordinator.pd.fallback_to_union``). Used for the config's engines (with the per-model
    check of :class:`ClusterConfig`) and for standalone mode's ``--backend`` roles.

    Parameters
    ----------
    mode : the deployment mode
    roles : the roles present (a set: how many of each does not matter)
    what, mode_field : the words for the engines and the mode in the message
        (``backend``, ``--mode``).

    Returns
    -------
    str or None
        ``expected ..., got roles ...`` (without the field it is about), or None.
    """
    got = ", ".join(sorted({r.value for r in roles})) or "none"
    if mode is DeploymentMode.UNION:
        if any(r is not Role.UNION for r in roles):
            return (f"expected only union {what}s with {mode_field} union (a prefill or decode "
                    f"{what} would be sent whole requests; a pd_* mode disaggregates), "
                    f"got roles {got}")
        return None
    if Role.PREFILL not in roles or Role.DECODE not in roles:
        return (f"expected at least one prefill and one decode {what} with {mode_field} "
                f"{mode.value}, got roles {got}")
    return None


class ClusterConfig(_Strict):
    """The whole cluster. Besides each field's own checks, the checks across fields (the table
    in docs/configuration.md, "Rules across fields") run when a config is loaded; each refusal
    names the field(s), what was expected and what was received."""
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    nodes: list[NodeConfig] = Field(default_factory=list)

    def engine_groups(self) -> Iterator[tuple[str, EngineConfig]]:
        """Every engine group with its field path (``nodes[0].engines[1]``), in config order."""
        for i, n in enumerate(self.nodes):
            for j, e in enumerate(n.engines):
                yield f"nodes[{i}].engines[{j}]", e

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        self._check_timing()
        self._check_roles()
        self._check_engine_flags()
        self._check_names_and_ports()
        self._check_priorities()
        self._check_devices()
        self._check_pd_peers()
        self._check_spans()
        self._check_engine_tls()
        return self

    def _check_engine_tls(self) -> None:
        """An engine group asking for client certificates (``tls.client_ca_file``) needs one
        the coordinator presents."""
        if self.coordinator.upstream_tls.cert_file:
            return
        for at, e in self.engine_groups():
            if e.tls is not None and e.tls.client_ca_file:
                raise ValueError(f"coordinator.upstream_tls.cert_file: expected the client "
                                 f"certificate the coordinator presents to the engines of "
                                 f"{at} (their tls.client_ca_file asks for one), got none")

    def _check_spans(self) -> None:
        """Every node an instance spans declares its engine group, alike (see
        :class:`SpanConfig`)."""
        names = [n.name for n in self.nodes]
        for i, n in enumerate(self.nodes):
            for j, e in enumerate(n.engines):
                s = e.span
                if s is None:
                    continue
                at = f"nodes[{i}].engines[{j}]"
                for k, name in enumerate(s.nodes):
                    if name not in names:
                        raise ValueError(f"{at}.span.nodes[{k}]: expected a node name of the "
                                         f"config ({', '.join(names)}), got {name!r}")
                if n.name not in s.nodes:
                    raise ValueError(f"{at}.span.nodes: expected the node that declares the "
                                     f"group ({n.name!r}) among them, got {s.nodes}")
                for name in s.nodes:
                    i2 = names.index(name)
                    other = next((e2 for e2 in self.nodes[i2].engines if e2.name == e.name), None)
                    if other is None:
                        raise ValueError(
                            f"nodes[{i2}].engines: expected an engine group {e.name!r} (its "
                            f"instance spans node {name!r}: {at}.span.nodes), got none")
                    for field in SPAN_ALIKE:
                        a, b = getattr(e, field), getattr(other, field)
                        if a != b:
                            j2 = self.nodes[i2].engines.index(other)
                            raise ValueError(
                                f"nodes[{i2}].engines[{j2}].{field}: expected the same value as "
                                f"{at}.{field} (one instance spanning nodes), got {_short(b)} "
                                f"and {_short(a)}")
                if e.kind is EngineKind.SIM or s.master_address is not None:
                    continue
                master = self.nodes[names.index(s.nodes[0])]
                if master.host in ("0.0.0.0", "::"):
                    raise ValueError(
                        f"{at}.span.master_address: expected an address when the master node's "
                        f"host is the wildcard {master.host!r} (the other nodes connect to it), "
                        f"got null")

    def _check_devices(self) -> None:
        """No device of a node in two engine groups, none beyond ``nodes[].devices``."""
        for i, n in enumerate(self.nodes):
            allocate_devices(n, where=f"nodes[{i}]")

    def pd_peer_parallel(self, engine: EngineConfig, where: str = "") -> dict[str, int] | None:
        """The ``{dp_size, tp_size}`` of the PD peers of a prefill (decode) ``engine``: the decode
        (prefill) groups of its kind serving its model, when they all have one size; None when
        there is none.

        Raises
        ------
        ValueError
            the peer groups have different sizes (``where`` names the engine).
        """
        want = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(engine.role)
        if want is None:
            return None
        peers = [(at, e) for at, e in self.engine_groups()
                 if e.role is want and e.model_name == engine.model_name
                 and e.kind is engine.kind]   # KV goes between engines of one kind only
        sizes = {(e.dp_size, e.tp_size) for _, e in peers}
        if not sizes:
            return None
        if len(sizes) > 1:
            listed = ", ".join(f"{at} dp_size {e.dp_size} tp_size {e.tp_size}" for at, e in peers)
            raise ValueError(
                f"{where}.engine_config.kv_transfer_config: expected one dp_size / tp_size "
                f"across the {want.value} engines of model {engine.model_name!r} (vLLM-Ascend's "
                f"kv_connector_extra_config.{want.value} has one), got {listed}; set "
                f"kv_connector_extra_config.{want.value} in this engine's kv_transfer_config")
        dp, tp = sizes.pop()
        return {"dp_size": dp, "tp_size": tp}

    def _check_pd_peers(self) -> None:
        """vLLM-Ascend PD engines: the peers' sizes motor fills in are unambiguous."""
        for i, n in enumerate(self.nodes):
            if n.platform is not Platform.ASCEND:
                continue
            for j, e in enumerate(n.engines):
                if e.kind is not EngineKind.VLLM or e.role is Role.UNION:
                    continue
                side = "decode" if e.role is Role.PREFILL else "prefill"
                user = json_value(e.flag_value("kv-transfer-config"))
                if isinstance(user, dict):
                    extra = user.get("kv_connector_extra_config")
                    if isinstance(extra, dict) and side in extra:
                        continue
                self.pd_peer_parallel(e, where=f"nodes[{i}].engines[{j}]")

    def _check_priorities(self) -> None:
        """Every admission class a key limit names is one of ``admission.classes``."""
        c = self.coordinator
        classes = c.admission.classes
        named = [("coordinator.limits.default.priority", c.limits.default.priority)] + [
            (f"coordinator.limits.keys.{n}.priority", k.priority)
            for n, k in c.limits.keys.items()]
        for field, prio in named:
            if prio is not None and prio not in classes:
                raise ValueError(f"{field}: expected one of coordinator.admission.classes "
                                 f"({', '.join(classes)}), got {prio!r}")
        named = [(f"coordinator.admission.max_wait_s.{n}", n) for n in c.admission.max_wait_s]
        for field, prio in named:
            if prio not in classes:
                raise ValueError(f"{field}: expected one of coordinator.admission.classes "
                                 f"({', '.join(classes)}), got {prio!r}")

    def _check_timing(self) -> None:
        """Pairs of durations whose order is a contradiction the other way round."""
        ctl, c = self.controller, self.coordinator
        if ctl.heartbeat_timeout_s < 2 * ctl.heartbeat_interval_s:
            raise ValueError(
                f"controller.heartbeat_timeout_s: expected at least 2 x "
                f"controller.heartbeat_interval_s = {2 * ctl.heartbeat_interval_s:g} (one late "
                f"or lost heartbeat must not make the node's instances unhealthy), got "
                f"{ctl.heartbeat_timeout_s:g}")
        pairs: list[tuple[str, float, str, float]] = [
            ("coordinator.retries.backoff_s", c.retries.backoff_s,
             "coordinator.retries.backoff_max_s", c.retries.backoff_max_s),
            ("coordinator.breaker.open_s", c.breaker.open_s,
             "coordinator.breaker.open_max_s", c.breaker.open_max_s)]
        for at, e in self.engine_groups():
            pairs.append((f"{at}.restart.backoff_initial_s", e.restart.backoff_initial_s,
                          f"{at}.restart.backoff_max_s", e.restart.backoff_max_s))
        for low, lv, high, hv in pairs:
            if lv > hv:
                raise ValueError(f"{low}: expected at most {high} = {hv:g} (the cap of the "
                                 f"doubling delay it starts), got {lv:g}")
        if c.mode is DeploymentMode.PD_DECODE_FIRST and c.workers > 1:
            raise ValueError(
                f"coordinator.workers: expected 1 with coordinator.mode pd_decode_first (the "
                f"metaserver callback must reach the worker holding the request), got {c.workers}")

    def _check_roles(self) -> None:
        """The engines' roles fit ``coordinator.mode`` (see :func:`role_problem`); in a PD
        mode every model with prefill engines has decode engines and the other way round."""
        engines = list(self.engine_groups())
        if not engines:   # a controller-only / coordinator-only file: nothing to check
            return
        mode = self.coordinator.mode
        if mode is DeploymentMode.UNION:
            for at, e in engines:
                if e.role is not Role.UNION:
                    raise ValueError(
                        f"{at}.role: expected 'union' with coordinator.mode union (a "
                        f"{e.role.value} engine would be sent whole requests; a pd_* mode "
                        f"disaggregates), got {e.role.value!r}")
            return
        problem = role_problem(mode, {e.role for _, e in engines}, mode_field="mode")
        if problem is not None:
            listed = ", ".join(f"{at}.role {e.role.value!r}" for at, e in engines[:4])
            more = f" and {len(engines) - 4} more" if len(engines) > 4 else ""
            raise ValueError(f"coordinator.mode: {problem} ({listed}{more})")
        by_role: dict[Role, list[tuple[str, EngineConfig]]] = {Role.PREFILL: [], Role.DECODE: []}
        for at, e in engines:
            if e.role in by_role:
                by_role[e.role].append((at, e))
        for have, want in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            served = {e.model_name for _, e in by_role[want]}
            for at, e in by_role[have]:
                if e.model_name in served:
                    continue
                others = ", ".join(f"{e2.model_name!r} ({a2}.{_model_field(e2)})"
                                   for a2, e2 in by_role[want])
                raise ValueError(
                    f"{at}.{_model_field(e)}: expected a {want.value} engine serving the same "
                    f"model with coordinator.mode {mode.value} (a {have.value} engine's requests "
                    f"need one), got {e.model_name!r} while the {want.value} engines serve "
                    f"{others}")

    def _check_engine_flags(self) -> None:
        """``engine_config`` holds no flag motor sets itself (the table of
        :mod:`motor.config.engine_flags`) and no flag twice in two spellings."""
        for at, e in self.engine_groups():
            managed = managed_flags(e.kind.value)
            seen: dict[str, str] = {}
            for raw, v in e.engine_config.items():
                k = flag_key(raw)
                if not k:
                    raise ValueError(f"{at}.engine_config: expected flag names, got the empty "
                                     f"key {raw!r}")
                if k in managed:
                    raise ValueError(
                        f"{at}.engine_config.{raw}: expected a flag motor does not set itself "
                        f"(it sets --{k} of a {e.kind.value} engine from {at}.{managed[k]}), "
                        f"got {raw}: {_short(v)}")
                if k in seen:
                    raise ValueError(f"{at}.engine_config.{raw}: expected each flag once, got "
                                     f"--{k} also as {seen[k]!r}")
                seen[k] = raw

    def _check_names_and_ports(self) -> None:
        """Node names unique; no two listeners on one host and port."""
        for i, n in enumerate(self.nodes):
            for j, m in enumerate(self.nodes[:i]):
                if m.name == n.name:
                    raise ValueError(f"nodes[{i}].name: expected node names to be unique, got "
                                     f"{n.name!r} again (also nodes[{j}].name)")
        # every port motor opens on a host: no two listeners may share one
        taken: dict[tuple[str, int], str] = {}

        def claim(host: str, port: int, field: str) -> None:
            if not 1 <= port <= 65535:
                raise ValueError(f"{field}: expected a port in 1..65535, got {port}")
            h = "127.0.0.1" if host in ("localhost", "::1") else host
            for (oh, op), other in taken.items():
                if op == port and (oh == h or "0.0.0.0" in (oh, h)):
                    raise ValueError(f"{field}: port {port} on {host} is expected to be free, "
                                     f"got it also used by {other}")
            taken[(h, port)] = field

        claim(self.controller.host, self.controller.port, "controller.port")
        c = self.coordinator
        claim(c.host, c.port, "coordinator.port")
        mgmt = getattr(c, "management_port", None)
        if mgmt:
            claim(c.host, mgmt, "coordinator.management_port")
        for i, n in enumerate(self.nodes):
            nm = getattr(n, "mgmt_port", None)
            if nm:
                claim(n.host, nm, f"nodes[{i}].mgmt_port")
            for j, e in enumerate(n.engines):
                if e.span is not None and e.span.nodes[0] != n.name:
                    continue   # a headless part: no API port
                for k in range(1 if e.span is not None else e.count * e.dp_size):
                    inst, rank = divmod(k, e.dp_size)
                    what = f"nodes[{i}].engines[{j}].base_port" + (
                        f" (instance {inst}" + (f", DP rank {rank})" if e.dp_size > 1 else ")")
                        if k else "")
                    claim(e.host, e.base_port + k, what)


def json_value(v: Any) -> Any:
    """An ``engine_config`` value that may be given as JSON text: the parsed value (None when
    the text is no JSON); any other value as it is."""
    if isinstance(v, str):
        import json
        try:
            return json.loads(v)
        except ValueError:
            return None
    return v


def _ids(ids: Collection[int]) -> str:
    return ", ".join(str(d) for d in ids)


def allocate_devices(node: NodeConfig, where: str = "") -> list[list[int] | None]:
    """The devices of each engine group of ``node`` (config order): its ``devices`` when set,
    else the ``count * dp_size * tp_size`` lowest ids that no group before it and no explicit
    ``devices`` of the node takes; None for a group that uses none (kind ``sim``, a ``cpu``
    node).

    Parameters
    ----------
    node : the node
    where : the node's field path in messages (``nodes[0]``); empty = ``engines[j]``

    Raises
    ------
    ValueError
        two groups share a device (the message names both groups and the devices), or an id
        is not below ``node.devices``.
    """
    pre = f"{where}." if where else ""
    uses = [e.kind is not EngineKind.SIM and node.platform is not Platform.CPU
            for e in node.engines]
    owner: dict[int, int] = {}
    for j, e in enumerate(node.engines):
        if e.devices is None:
            continue
        if not uses[j]:
            raise ValueError(f"{pre}engines[{j}].devices: expected none on a {node.platform.value} "
                             f"node (no device variable is set), got {e.devices}")
        taken = [d for d in e.devices if d in owner]
        if taken:
            k = owner[taken[0]]
            ds = [d for d in taken if owner[d] == k]
            raise ValueError(
                f"{pre}engines[{j}].devices: expected devices no other engine group of node "
                f"{node.name!r} uses, got {_ids(ds)} also in {pre}engines[{k}].devices (engine "
                f"{node.engines[k].name!r}; engine {e.name!r} lists {e.devices})")
        for d in e.devices:
            owner[d] = j
    out: list[list[int] | None] = []
    nxt = 0
    for j, e in enumerate(node.engines):
        if not uses[j]:
            out.append(None)
            continue
        if e.devices is not None:
            got = list(e.devices)
        else:
            got = []
            while len(got) < e.devices_per_instance * e.count:
                if nxt not in owner:
                    got.append(nxt)
                    owner[nxt] = j
                nxt += 1
        if node.devices is not None and got and max(got) >= node.devices:
            how = f"listing {_ids(got)}" if e.devices is not None else \
                f"allocated {_ids(got)} after the groups before it"
            raise ValueError(
                f"{pre}engines[{j}].devices: expected ids below {pre}devices = {node.devices} "
                f"(the node's devices 0..{node.devices - 1}), got engine {e.name!r} {how}")
        out.append(got)
    return out


def _model_field(e: EngineConfig) -> str:
    """The field that names what engine ``e`` serves: ``served_model_name`` when set."""
    return "served_model_name" if e.served_model_name else "model"


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."
