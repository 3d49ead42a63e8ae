"""``motor sim``: run one simulated engine speaking vLLM's OpenAI-compatible HTTP API.

The node manager launches it as ``python -m motor sim --port P --model M ...`` with
the engine's ``engine_config`` keys as ``--kebab-case`` flags, so option names here
are stable. Boolean options take ``--flag`` / ``--no-flag`` and also ``--flag true``
/ ``--flag false``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from motor.cli import (add_host_option, add_port_option, bounded, integer, non_negative_float,
                       non_negative_int, port_number, positive_float, positive_int,
                       probability)
from motor.sim.engine import EngineConfig
from motor.sim.faults import MODES, Faults
from motor.sim.options import PdOptions, SimOptions, TlsOptions
from motor.sim.tokenizer import DEFAULT_MODEL_DIR

logger = logging.getLogger("motor.sim")

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


def _str2bool(v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


def _bool_flag(group: argparse._ActionsContainer, name: str, default: bool, help_text: str) -> None:
    dest = name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, nargs="?", const=True, default=default,
                       type=_str2bool, metavar="BOOL", help=help_text)
    group.add_argument(f"--no-{name}", dest=dest, action="store_false",
                       help=f"turn --{name} off")




def _json_object_text(text: str) -> str:
    """argparse type of ``--kv-events-config``: the text of a JSON object."""
    try:
        ok = isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return text


_http_status = bounded(int, lambda i: 100 <= i <= 599, "an HTTP status 100..599")
_cert_reqs = bounded(int, lambda i: 0 <= i <= 2, "0, 1 or 2 (ssl.CERT_NONE / OPTIONAL / "
                                                 "REQUIRED)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    srv = parser.add_argument_group("server")
    add_host_option(srv, "127.0.0.1")
    add_port_option(srv, 8000, any_free=True, note="the bound port is printed on stdout")
    srv.add_argument("--model", default="motor-sim", metavar="NAME",
                     help="model name clients use (the served model name)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="served model name(s) like vLLM's flag; overrides --model for clients "
                          "(default: --model)")
    srv.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, metavar="DIR",
                     help="directory where the byte-level tokenizer model directory is written "
                          "(tokenizer.json, tokenizer_config.json with the chat template, ...)")
    srv.add_argument("--role", choices=["union", "prefill", "decode"], default="union",
                     metavar="ROLE",
                     help="PD role, union, prefill or decode: prefill / decode take part in the PD handshakes "
                          "(kv_transfer_params, metaserver, bootstrap rooms; docs/sim.md)")
    srv.add_argument("--dp-rank", type=non_negative_int, default=0, metavar="N",
                     help="data-parallel rank (reported; the metrics' engine label); with "
                          "--dp-master, the first of the --dp-size-local ranks played")
    tls = parser.add_argument_group("TLS on the API port (vLLM's flag names)")
    tls.add_argument("--ssl-certfile", default=None, metavar="PEM",
                     help="serve HTTPS with this certificate chain (leaf first)")
    tls.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                     help="its private key (default: in --ssl-certfile)")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                     help="CA bundle for client certificates (see --ssl-cert-reqs)")
    tls.add_argument("--ssl-cert-reqs", type=_cert_reqs, default=0, metavar="N",
                     help="client certificate: 0 not asked, 1 optional, 2 required "
                          "(signed by --ssl-ca-certs), as ssl.CERT_NONE / OPTIONAL / REQUIRED")
    dp = parser.add_argument_group("data parallel across nodes (docs/sim.md, motor.sim.dp)")
    dp.add_argument("--dp-size", type=positive_int, default=1, metavar="N",
                    help="DP ranks of the whole instance (with --dp-master)")
    dp.add_argument("--dp-size-local", type=positive_int, default=None, metavar="N",
                    help="DP ranks this process plays, from --dp-rank (default: --dp-size)")
    dp.add_argument("--dp-master", default=None, metavar="HOST:PORT",
                    help="the DP master's join address: the master listens there and serves "
                         "once every rank joined; a --headless process joins it")
    dp.add_argument("--headless", action="store_true", default=False,
                    help="play DP ranks without an API server, joined to --dp-master")
    _bool_flag(srv, "enable-prompt-tokens-details", False,
               "fill usage.prompt_tokens_details.cached_tokens (null otherwise, like vLLM)")
    _bool_flag(srv, "enable-force-include-usage", False,
               "usage on every stream chunk and a final usage chunk, whatever the request says")

    eng = parser.add_argument_group("engine")
    eng.add_argument("--max-model-len", type=positive_int, default=4096, metavar="N",
                     help="context length: prompt + output tokens")
    eng.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                     help="KV block size in tokens")
    eng.add_argument("--num-gpu-blocks", type=positive_int, default=4096, metavar="N",
                     help="KV cache capacity in blocks (4096 blocks of 16 tokens: 64k tokens)")
    eng.add_argument("--max-num-seqs", type=positive_int, default=256, metavar="N",
                     help="most sequences in the running batch")
    eng.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                     help="token budget of one step (longer prefills are chunked)")
    _bool_flag(eng, "enable-prefix-caching", True, "reuse cached KV blocks of shared prefixes")
    _bool_flag(eng, "context-keyed-text", False,
               "each generated token depends on (seed, the whole context so far), like greedy "
               "decoding: a request continued elsewhere with prompt + generated tokens goes on "
               "with the same text (motor's mid-stream failover tests)")
    eng.add_argument("--seed", type=integer, default=0, metavar="N",
                     help="global seed of the generated text")
    eng.add_argument("--eos-prob", type=probability, default=0.0, metavar="P",
                     help="probability that a generated token is EOS (<|im_end|>); 0 = never")

    tm = parser.add_argument_group("timing model: step time = (fixed + per-token costs) * scale")
    tm.add_argument("--time-scale", type=non_negative_float, default=1.0, metavar="X",
                    help="multiplies every step's time; 0 = as fast as possible")
    tm.add_argument("--step-fixed-ms", type=non_negative_float, default=2.0, metavar="MS",
                    help="fixed cost of one engine step, in ms")
    tm.add_argument("--prefill-token-us", type=non_negative_float, default=20.0, metavar="US",
                    help="cost of one prefill token in a step, in microseconds")
    tm.add_argument("--decode-token-us", type=non_negative_float, default=50.0, metavar="US",
                    help="cost of one decoding sequence in a step, in microseconds")

    fl = parser.add_argument_group("fault injection (also POST /admin/fault at run time)")
    fl.add_argument("--fault", choices=MODES, default="none", metavar="MODE",
                    help="fault mode: " + ", ".join(MODES) + " (see docs/sim.md)")
    fl.add_argument("--fault-status", type=_http_status, default=500, metavar="STATUS",
                    help="HTTP status of the error fault")
    fl.add_argument("--fault-tokens", type=non_negative_int, default=0, metavar="N",
                    help="tokens before drop_after / recomputed_after strike")
    fl.add_argument("--fault-factor", type=positive_float, default=1.0, metavar="X",
                    help="step-time factor of slow")
    fl.add_argument("--fault-count", type=non_negative_int, default=None, metavar="COUNT",
                    help="how many next requests a per-request fault hits; for crash: crash on "
                         "the COUNT-th generation request (default: all of them; crash: at "
                         "start-up)")

    pd = parser.add_argument_group("prefill/decode disaggregation (--role prefill|decode)")
    pd.add_argument("--kv-transfer-ms-per-block", type=non_negative_float, default=0.2,
                    metavar="MS",
                    help="simulated KV transfer time per block on the decode side, in ms "
                         "(times --time-scale)")
    pd.add_argument("--kv-lease-s", type=non_negative_float, default=30.0, metavar="S",
                    help="prefill-first: how long P holds blocks that no decode has read")
    pd.add_argument("--disaggregation-bootstrap-port", type=port_number, default=0,
                    metavar="PORT",
                    help="prefill role: port of the SGLang-style bootstrap server; "
                         "0 = any free port, reported by GET /server_info")
    pd.add_argument("--bootstrap-timeout-s", type=non_negative_float, default=30.0, metavar="S",
                    help="how long a leg waits for its peer (bootstrap room, metaserver push)")

    kv = parser.add_argument_group("KV events")
    kv.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                    help="ZMQ PUB endpoint for KV events in vLLM's format, e.g. "
                         "tcp://127.0.0.1:5557, bound (default: no KV events)")
    kv.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                    help="ZMQ ROUTER endpoint answering replay requests, bound (default: no "
                         "replay)")
    kv.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                    help="topic frame of KV event messages (default: empty)")
    kv.add_argument("--kv-events-buffer-steps", type=positive_int, default=10000, metavar="N",
                    help="batches kept for replay")
    kv.add_argument("--kv-events-config", default=None, metavar="JSON", type=_json_object_text,
                    help="vLLM's flag, for drop-in configs: {enable_kv_cache_events, endpoint, "
                         "replay_endpoint, topic, buffer_steps}; fills the options above")


def _apply_kv_events_config(args: argparse.Namespace) -> None:
    """Fill the --kv-events-* options from vLLM's --kv-events-config JSON."""
    if not args.kv_events_config:
        return
    try:
        cfg = json.loads(args.kv_events_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is expected to be JSON, got "
                         f"{args.kv_events_config!r} ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--kv-events-config is expected to be a JSON object, got {cfg!r}")
    enabled = cfg.get("enable_kv_cache_events", cfg.get("publisher") == "zmq")
    if not enabled:
        return
    args.kv_events_endpoint = args.kv_events_endpoint or cfg.get("endpoint", "tcp://*:5557")
    args.kv_events_replay_endpoint = (args.kv_events_replay_endpoint
                                      or cfg.get("replay_endpoint"))
    if "topic" in cfg:
        args.kv_events_topic = str(cfg["topic"])
    if "buffer_steps" in cfg:
        args.kv_events_buffer_steps = int(cfg["buffer_steps"])


def options_from_args(args: argparse.Namespace) -> SimOptions:
    _apply_kv_events_config(args)

    ec = EngineConfig(
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, time_scale=args.time_scale,
        step_fixed_ms=args.step_fixed_ms, prefill_token_us=args.prefill_token_us,
        decode_token_us=args.decode_token_us, seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching, eos_prob=args.eos_prob,
        context_keyed_text=args.context_keyed_text,
    )
    fault = {"mode": args.fault, "status": args.fault_status, "tokens": args.fault_tokens,
             "factor": args.fault_factor, "count": args.fault_count}
    Faults().set(fault)  # validate early
    opts = SimOptions(
        host=args.host, port=args.port, model=args.model,
        served_model_names=list(args.served_model_name or []), model_dir=args.model_dir,
        engine=ec, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        role=args.role, dp_rank=args.dp_rank, fault=fault,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic, kv_events_buffer_steps=args.kv_events_buffer_steps,
        pd=PdOptions(kv_transfer_ms_per_block=args.kv_transfer_ms_per_block,
                     kv_lease_s=args.kv_lease_s,
                     bootstrap_port=args.disaggregation_bootstrap_port,
                     bootstrap_timeout_s=args.bootstrap_timeout_s),
    )
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile: expected --ssl-certfile with it, got none")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError(f"--ssl-cert-reqs {args.ssl_cert_reqs}: expected --ssl-ca-certs (the "
                         f"CA that signs client certificates), got none")
    if args.ssl_certfile:
        opts.tls = TlsOptions(cert_file=args.ssl_certfile, key_file=args.ssl_keyfile,
                              ca_certs=args.ssl_ca_certs, cert_reqs=args.ssl_cert_reqs)
    if args.dp_master is not None:
        from motor.sim.dp import DpOptions, parse_address
        host, port = parse_address(args.dp_master)
        local = args.dp_size_local or args.dp_size
        if args.dp_rank + local > args.dp_size:
            raise ValueError(f"--dp-rank {args.dp_rank} + --dp-size-local {local}: expected "
                             f"at most --dp-size {args.dp_size}, got {args.dp_rank + local}")
        if not args.headless and args.dp_rank != 0:
            raise ValueError(f"--dp-rank: expected 0 for the DP master (no --headless), got "
                             f"{args.dp_rank}")
        opts.dp = DpOptions(dp_rank=args.dp_rank, dp_size=args.dp_size, dp_size_local=local,
                            master_host=host, master_port=port, headless=args.headless)
    elif args.headless:
        raise ValueError("--headless: expected --dp-master HOST:PORT with it (the master to "
                         "join), got none")
    return opts


async def _serve_headless(opts: SimOptions) -> int:
    from motor.sim.dp import run_headless
    assert opts.dp is not None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    return await run_headless(opts.dp, stop)


async def _serve(opts: SimOptions) -> int:
    if opts.dp is not None and opts.dp.headless:
        return await _serve_headless(opts)
    from motor.sim.server import ListenError, SimServer

    server = SimServer(opts)
    try:
        port = await server.start()
    except ListenError as e:
        print(f"motor sim: {e.message}", file=sys.stderr)
        return 1
    kv = ""
    if server.kv_publisher is not None:
        kv = f" kv_events={server.kv_publisher.endpoint}"
        if server.kv_publisher.replay_endpoint:
            kv += f" kv_replay={server.kv_publisher.replay_endpoint}"
    dp = ""
    if server.dp is not None:
        dp = (f" dp_size={opts.dp.dp_size if opts.dp else 1} dp_master="
              f"{opts.dp.master_host if opts.dp else ''}:{server.dp_port}")
    scheme = "https" if opts.tls is not None else "http"
    print(f"motor sim listening on {scheme}://{opts.host}:{port} model={server.model_name} "
          f"role={opts.role} dp_rank={opts.dp_rank}{kv}{dp}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
    logger.info("shutting down")
    await server.stop(drain_timeout_s=2.0)
    if server.dp is not None:
        print(f"motor sim: stopped; {server.dp.summary()}", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    from motor.http import install_uvloop

    try:
        opts = options_from_args(args)
        if opts.tls is not None:
            from motor.sim.server import tls_context
            tls_context(opts.tls)       # a file that does not load: exit 2, named
    except ValueError as e:  # FaultError and ConfigError too
        print(f"motor sim: {e}", file=sys.stderr)
        return 2
    if opts.fault["mode"] == "crash" and opts.fault.get("count") is None:
        print("motor sim: --fault crash: exiting with status 1 at start-up", file=sys.stderr)
        return 1
    ec = opts.engine
    if ec.num_gpu_blocks * ec.block_size < ec.max_model_len:
        print(f"motor sim: the KV cache ({ec.num_gpu_blocks} blocks x {ec.block_size} tokens) "
              f"cannot hold one sequence of --max-model-len {ec.max_model_len}", file=sys.stderr)
        return 2
    install_uvloop()
    try:
        return asyncio.run(_serve(opts))
    except KeyboardInterrupt:
        return 130
