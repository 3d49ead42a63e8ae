"""B24: vLLM-style PD kv_transfer_params / prompt_logprobs handling."""
from __future__ import annotations

import pytest


@pytest.mark.skip(reason="needs PD mode (issue 6)")
def test_pd_kv_transfer_params_and_prompt_logprobs():
    """P-PD-VLLM: FB-P gets stream false / max_tokens 1 / do_remote_decode; FB-D gets the
    client's fields + FB-P's kv_transfer_params; prompt_logprobs from FB-P."""
