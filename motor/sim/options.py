"""The simulator's options: what :mod:`motor.sim.cli` builds from the flags and hands to
:class:`motor.sim.server.SimServer` (and, through it, to :class:`motor.sim.pd.PdSim`).

Plain dataclasses with no behaviour, in their own module so that the server and the PD
handshakes can both depend on them without depending on each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from motor.sim.dp import DpOptions
from motor.sim.engine import EngineConfig


@dataclass
class PdOptions:
    """Prefill/decode handshake settings (``--kv-transfer-ms-per-block`` and friends).

    Attributes
    ----------
    kv_transfer_ms_per_block : float
        Simulated KV transfer time per block, in milliseconds (scaled by the engine's
        ``time_scale``).
    kv_lease_s : float
        Seconds a prefill instance holds blocks for a decode instance to pull.
    bootstrap_port : int
        Prefill role: the bootstrap server's port (0 = any free port).
    bootstrap_timeout_s : float
        Seconds either side waits for the other half of a handshake (then 500).
    """
    kv_transfer_ms_per_block: float = 0.2
    kv_lease_s: float = 30.0
    bootstrap_port: int = 0          # prefill role: the bootstrap server's port (0 = any)
    bootstrap_timeout_s: float = 30.0


@dataclass
class TlsOptions:
    """HTTPS on the API port (``--ssl-certfile`` and friends, vLLM's names).

    Attributes
    ----------
    cert_file, key_file : str, str or None
        PEM certificate chain (leaf first) and private key (None: in ``cert_file``).
    ca_certs : str or None
        PEM CA bundle for client certificates.
    cert_reqs : int
        0 / 1 / 2: a client certificate is not asked, optional, required
        (``ssl.CERT_NONE`` / ``CERT_OPTIONAL`` / ``CERT_REQUIRED``).
    """
    cert_file: str
    key_file: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0


@dataclass
class SimOptions:
    """Everything a simulator needs; built from the CLI flags by :mod:`motor.sim.cli`."""
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "motor-sim"
    served_model_names: list[str] = field(default_factory=list)
    model_dir: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    role: str = "union"
    dp_rank: int = 0
    fault: dict[str, Any] = field(default_factory=lambda: {"mode": "none"})
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10000
    pd: PdOptions = field(default_factory=PdOptions)
    #: data parallel across nodes (``--dp-master``); None = a rank on its own
    dp: DpOptions | None = None
    #: HTTPS on the API port; None = plain HTTP (the PD bootstrap and DP ports stay plain)
    tls: TlsOptions | None = None

    @property
    def names(self) -> list[str]:
        """The served model names (``served_model_names``, else ``[model]``)."""
        return self.served_model_names or [self.model]
