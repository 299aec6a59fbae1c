"""`agentkv serve`: flags -> engine config and server options -> one server or N workers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv.engine.config import EngineConfig, add_engine_args
from agentkv.errors import UserError
from agentkv.gate.options import add_http_args, http_limits_from_args
from agentkv.kv.transfer import nvlink

if TYPE_CHECKING:
    from agentkv.serve.app import ServeOptions


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv serve`: server, KV events, and the engine's (vLLM names)."""
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible server (vLLM's API, metrics and KV events) on the engine"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="engine seconds per wall second: 10 runs the simulated GPU ten times faster (default 1)",
    )
    p.add_argument(
        "--served-model-name", default=None, metavar="NAME", help="model name in the API (default --model)"
    )
    _kv_events_args(p.add_argument_group("KV events (vLLM's ZMQ publisher, and agentkv's protections)"))
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="engines to start, on consecutive ports and event endpoints (default 1)",
    )
    p.add_argument(
        "--disagg",
        default=None,
        metavar="prefill=N,decode=M",
        help="disaggregated prefill/decode: N prefill and M decode workers on ports PORT+1 on, behind a "
        "proxy on PORT that drives them as vLLM's NIXL proxy does (replaces --workers)",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="--disagg: GB/s of the KV link into a decode worker (default the GPU's NVLink; RDMA "
        "between nodes: the NIC's, e.g. 50; inf: free)",
    )
    add_http_args(p, parse_processes=1)
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="output length of chat requests without max_tokens (completions: 16, as vLLM)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level (default warning)",
    )
    add_engine_args(p)
    p.set_defaults(func=serve_command)


def _kv_events_args(p) -> None:
    """Where KV events go, and how they are protected (host, CURVE and token ids are agentkv's own)."""
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish KV events here, e.g. tcp://*:5557 (binds on '*', else connects, as vLLM; "
        "'*' binds --kv-events-host)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="replay ROUTER socket for missed event batches, e.g. tcp://*:5558",
    )
    p.add_argument(
        "--kv-events-topic", default="kv-events", help="ZMQ topic of event messages (default kv-events)"
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s form: {"endpoint": ..., "replay_endpoint": ..., "topic": ...}',
    )
    p.add_argument(
        "--kv-events-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address a tcp://*:PORT event endpoint binds (default 127.0.0.1; '*' or 0.0.0.0: "
        "every interface, which shows every tenant's block hashes to anyone who reaches it)",
    )
    p.add_argument(
        "--kv-events-curve-secret-key",
        default=None,
        metavar="FILE|DIR",
        help="turn ZMQ CURVE on for the event and replay sockets with this key pair "
        "(a .key_secret file from `agentkv security keys`), or a folder holding one pair per "
        "--workers: worker-0.key_secret, worker-1.key_secret, ...; needs --kv-events-curve-allow",
    )
    p.add_argument(
        "--kv-events-curve-allow",
        default=None,
        metavar="FILE|DIR",
        help="public keys (a .key file, or a folder of them) of the subscribers (routers) admitted",
    )
    p.add_argument(
        "--kv-events-token-ids",
        default="on",
        choices=["on", "off"],
        help="send prompt token ids in BlockStored events (default on, as vLLM; a router needs only "
        "the hashes)",
    )


def _curve_from_args(args: argparse.Namespace, workers: int | None = None) -> list | None:
    """The publishers' CurveServers, one per worker, from the two CURVE flags (both or neither), or None.

    A folder gives worker I its own pair, DIR/worker-I.key_secret, so a router can pin each worker;
    a file gives every worker the same pair."""
    secret, allow = args.kv_events_curve_secret_key, args.kv_events_curve_allow
    if secret is None and allow is None:
        return None
    if secret is None or allow is None:
        raise UserError(
            "--kv-events-curve-secret-key and --kv-events-curve-allow go together: the key proves "
            "the server, the allow-list admits the subscribers"
        )
    from agentkv.events.curve import SECRET_SUFFIX, CurveServer, load_keypair, load_public_keys

    n = workers if workers is not None else max(1, getattr(args, "workers", 1))
    flag, folder = "--kv-events-curve-secret-key", Path(secret)
    allowed = load_public_keys(allow, "--kv-events-curve-allow")
    if not folder.is_dir():
        return [CurveServer(*load_keypair(folder, flag), allowed)] * n
    pairs = []
    for i in range(n):
        f = folder / f"worker-{i}{SECRET_SUFFIX}"
        if not f.is_file():
            raise UserError(
                f"{flag} {folder}: no {f.name} for worker {i} (one pair per worker: "
                f"agentkv security keys --out {folder} --name worker-{i})"
            )
        pairs.append(load_keypair(f, flag))
    if len({public for public, _ in pairs}) < n:
        raise UserError(f"{flag} {folder}: two workers' files hold the same key pair; give each its own")
    return [CurveServer(public, key, allowed) for public, key in pairs]


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from the CLI flags (vLLM's `--kv-events-config` JSON or agentkv's own flags)."""
    from agentkv.serve.app import ServeOptions

    if not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise UserError(f"--time-scale must be a finite number > 0, got {args.time_scale}")
    endpoint, replay, topic = args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic
    if args.kv_events_config:
        try:
            cfg = json.loads(args.kv_events_config)
        except json.JSONDecodeError as e:
            raise UserError(f"--kv-events-config: not valid JSON ({e.msg})") from None
        if not isinstance(cfg, dict):
            raise UserError("--kv-events-config: expected a JSON object")
        if cfg.get("enable_kv_cache_events", True) and cfg.get("publisher", "zmq") == "zmq":
            endpoint = endpoint or cfg.get("endpoint", "tcp://*:5557")
            replay = replay or cfg.get("replay_endpoint")
            topic = cfg.get("topic") or topic
    if args.default_max_tokens < 1:
        raise UserError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.kv_link_gbps is not None and not args.kv_link_gbps > 0:
        raise UserError(f"--kv-link-gbps must be > 0 (inf: a free link), got {args.kv_link_gbps}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    return ServeOptions(
        host=args.host,
        port=args.port,
        time_scale=args.time_scale,
        served_model_name=args.served_model_name,
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay,
        kv_events_topic=topic,
        kv_events_host=args.kv_events_host,
        kv_events_curve=(_curve_from_args(args) or [None])[0],
        kv_events_token_ids=args.kv_events_token_ids == "on",
        http=http_limits_from_args(args),
        default_max_tokens=args.default_max_tokens,
        kv_link=None if args.kv_link_gbps is None else nvlink(args.kv_link_gbps),
    )


def serve_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv serve`."""
    from agentkv.serve.launch import run_one, run_workers, worker_options

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s"
    )
    config = EngineConfig.from_args(args)
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    opts = options_from_args(args)
    if args.disagg is not None:
        return _run_disagg(config, opts, args)
    if args.workers == 1:
        return run_one(config, opts)
    return run_workers(config, worker_options(opts, args.workers, _curve_from_args(args)))


def _run_disagg(config: EngineConfig, opts: ServeOptions, args: argparse.Namespace) -> int:
    """N prefill and M decode workers on PORT+1.., the proxy (serve/pd_proxy.py) on PORT."""
    from agentkv.engine.kv_move import parse_disagg
    from agentkv.gate.conn import base_url
    from agentkv.serve.launch import ProxySpec, run_workers, worker_options

    n_prefill, n_decode = parse_disagg(args.disagg)
    if args.workers != 1:
        raise UserError("--disagg sets the workers (prefill=N,decode=M); leave out --workers")
    if opts.port == 0:
        raise UserError("--disagg needs an explicit --port (the proxy's; workers take the ports after it)")
    shifted = dataclasses.replace(opts, port=opts.port + 1)
    options = worker_options(shifted, n_prefill + n_decode, _curve_from_args(args, n_prefill + n_decode))
    urls = [base_url(o.host, o.port) for o in options]
    spec = ProxySpec(tuple(urls[:n_prefill]), tuple(urls[n_prefill:]), opts.host, opts.port, opts.http)
    return run_workers(config, options, front=spec)
