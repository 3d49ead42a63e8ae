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
   ``prompt_tokens_details`` and ``prompt_logprobs`` merged in. A stream asking for
   ``prompt_logprobs`` (> 0 or -1) gets vLLM's own 400 before any leg is sent: vLLM
   cannot stream them, and P's would be lost (D never computes the prompt).

With ``pd.joint.enabled`` the pair is chosen at once (:meth:`PdPath.plan`); a request
planned on a decode instance alone goes there with the client's body as sent (no
``kv_transfer_params``: vLLM's D prefills it locally, like any request).
"""
from __future__ import annotations

import time

import orjson

from motor.coordinator.routing.pd_common import Ctx, LegFailed, PdPath, prefill_body
from motor.protocol.openai import error_body

#: vLLM's own answer (400 BadRequestError, param prompt_logprobs) to a stream that asks
#: for prompt_logprobs > 0 or -1
STREAM_PROMPT_LOGPROBS = "`prompt_logprobs` are not available when `stream=True`."

NIXL_PULL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


class PrefillFirst(PdPath):
    name = "pd_prefill_first"
    decode_after_prefill = True

    async def run(self, ctx: Ctx) -> None:
        body = ctx.body
        plp = body.get("prompt_logprobs")
        if ctx.stream and isinstance(plp, int) and not isinstance(plp, bool) \
                and (plp > 0 or plp == -1):
            # vLLM refuses these itself (protocol.py of completions and chat); without
            # this check P would compute them and the stripped D stream would drop them
            raise LegFailed(400, STREAM_PROMPT_LOGPROBS,
                            error_body(400, STREAM_PROMPT_LOGPROBS, "prompt_logprobs"))
        plan = await self.plan(ctx)
        if plan is not None and plan.local:
            await self.serve_local(ctx, body)   # conditional disaggregation: D alone
            return
        p_body = prefill_body(body, dict(NIXL_PULL_REQUEST))
        _, p_answer = await self.prefill(ctx, orjson.dumps(p_body), set())
        ktp = p_answer.get("kv_transfer_params")
        d_body = dict(body)
        d_body.pop("prompt_logprobs", None)
        if isinstance(ktp, dict):
            d_body["kv_transfer_params"] = ktp
        # without params (P aborted / a connector that returns none) D computes the prompt
        t_decode = time.perf_counter()
        ep, up, lease = await self.open_decode(ctx, orjson.dumps(d_body), set())
        with lease:
            try:
                await self.answer_decode(ctx, ep, up, p_answer, t_decode)
            finally:
                up.close()


__all__ = ["LegFailed", "PrefillFirst"]
