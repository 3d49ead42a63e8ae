"""``pd_prefill_first``: vLLM's NixlConnector (pull) / Mooncake-style handshake.

1. P gets the client's body with ``stream: false``, ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` when present), no ``stream_options`` / ``min_tokens``,
   and ``kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false,
   remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null}``
   (vLLM ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``);
2. P's answer carries a top-level ``kv_transfer_params``; D gets the client's original
   body with that dict verbatim as ``kv_transfer_params`` (``prompt_logprobs`` removed:
   D has no prompt hidden states, case B24) and the same ``X-Request-Id``;
3. D's answer goes to the client (streamed as it comes), with P's
   ``prompt_tokens_details`` and ``prompt_logprobs`` merged in.
"""
from __future__ import annotations

import time

import orjson

from motor.coordinator.routing.common import Ctx, LegFailed, PdMode, prefill_body

NIXL_PULL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


class PrefillFirst(PdMode):
    name = "pd_prefill_first"

    async def run(self, ctx: Ctx) -> None:
        body = ctx.body
        p_body = prefill_body(body, dict(NIXL_PULL_REQUEST))
        _, p_answer = await self.prefill(ctx, orjson.dumps(p_body), set())
        ktp = p_answer.get("kv_transfer_params")
        d_body = dict(body)
        d_body.pop("prompt_logprobs", None)
        if isinstance(ktp, dict):
            d_body["kv_transfer_params"] = ktp
        # without params (P aborted / a connector that returns none) D computes the prompt
        t_decode = time.perf_counter()
        ep, up = await self.open_decode(ctx, orjson.dumps(d_body), set())
        try:
            await self.answer_decode(ctx, ep, up, p_answer, t_decode)
        finally:
            up.close()
            self.release_decode(ctx, ep)


__all__ = ["LegFailed", "PrefillFirst"]
