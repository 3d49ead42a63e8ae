"""Type stubs for motor._fast.pairs (joint prefill/decode choice)."""
import numpy as np
import numpy.typing as npt

_F64 = npt.NDArray[np.float64]

def pick_pair(
    p_work: _F64,
    p_running: _F64,
    p_rates: _F64,
    d_queued: _F64,
    d_uncached: _F64,
    d_running: _F64,
    d_rates: _F64,
    transfer_s_per_token: _F64,
    decode_tokens: float = 0.0,
    chunk_tokens: float = 8192.0,
    local: bool = False,
    stall_weight: float = 0.0,
    start: int = 0,
    p_uncached: _F64 | None = None,
    handoff_s: float = 0.0,
) -> tuple[int, int, float, float, float]:
    """(prefill index or -1 for the decode instance alone, decode index, cost s,
    best pair s, best local s)."""

def pick_joint(
    n_prefill: int,
    overlap: npt.NDArray[np.int32] | None,
    prompt_tokens: float,
    block_size: float,
    tier_credit: _F64,
    queued: _F64,
    running: _F64,
    rates: _F64,
    transfer_s_per_token: _F64,
    decode_tokens: float = 0.0,
    chunk_tokens: float = 8192.0,
    local: bool = False,
    stall_weight: float = 0.0,
    start: int = 0,
    handoff_s: float = 0.0,
) -> tuple[int, int, float, float, float, float, float, float, float]:
    """(prefill index or -1, decode index or -1, cost s, best pair s, best local s, chosen
    decode instance's uncached tokens, its cached share, chosen prefill instance's uncached
    tokens, the pair's transfer s per token)."""
