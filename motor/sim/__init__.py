"""``motor sim``: a simulated LLM engine that speaks vLLM's OpenAI-compatible HTTP API.

Modules: :mod:`~motor.sim.cli` (flags, process entry), :mod:`~motor.sim.options` (the
settings), :mod:`~motor.sim.server` (HTTP API), :mod:`~motor.sim.pd` (PD handshakes),
:mod:`~motor.sim.engine` (continuous-batching step loop and scheduler),
:mod:`~motor.sim.kv` (paged KV cache with prefix caching), :mod:`~motor.sim.tokenizer`
(byte-level tokenizer model directory and chat template), :mod:`~motor.sim.metrics`
(Prometheus metrics under vLLM's names), :mod:`~motor.sim.faults` (fault injection).
See ``docs/sim.md``.
"""
