"""`agentkv route`: flags -> RouterConfig -> the proxy, with one clear error for bad input."""

from __future__ import annotations

import argparse
import logging

from agentkv.errors import UserError
from agentkv.gate.options import add_http_args, http_limits_from_args
from agentkv.kv import HASH_ALGOS
from agentkv.placement import POLICIES, add_kv_weight_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv route`."""
    p = sub.add_parser("route", help="OpenAI-compatible router: KV-aware, session-aware, tenant-isolated")
    _listen_args(p.add_argument_group("workers and listening"))
    _policy_args(p.add_argument_group("routing policy"))
    _hash_args(p.add_argument_group("how the engines hash prompts"))
    _approx_args(p.add_argument_group("approximate mode (no KV events)"))
    _tenant_args(p.add_argument_group("tenants"))
    _curve_args(p.add_argument_group("KV event authentication (ZMQ CURVE)"))
    _health_args(p.add_argument_group("worker health and limits"))
    _door_args(p.add_argument_group("client connections and request bodies"))
    p.set_defaults(func=route_command)


def _listen_args(p) -> None:
    """Workers and listening."""
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL[=EVENTS[,REPLAY]]",
        required=True,
        help="an engine and, if it publishes KV events, its ZMQ event (and replay) endpoint, e.g. "
        "http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 (repeatable)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this host only, as agentkv serve; 0.0.0.0 for every "
        "interface, behind --api-keys)",
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="router processes sharing --port (SO_REUSEPORT), each with its own event subscribers; the "
        "kernel spreads connections over them (default 1)",
    )


def _policy_args(p) -> None:
    """The placement policy and kv_aware's knobs."""
    p.add_argument(
        "--policy", default="kv_aware", choices=POLICIES, help="placement policy (default kv_aware)"
    )
    add_kv_weight_arg(p, queue_weight=0.0)  # 0: see docs/route.md, "Policy"
    p.add_argument(
        "--temperature", type=float, default=0.0, help="kv_aware: softmax sampling temperature (0: argmin)"
    )
    p.add_argument(
        "--affinity",
        type=float,
        default=8.0,
        metavar="BLOCKS",
        help="kv_aware: a session (x-session-id) keeps its worker while within this many blocks "
        "of the best cost and not overloaded (default 8; 0 turns it off)",
    )
    p.add_argument(
        "--tie-break",
        choices=("rotate", "session"),
        default=None,
        help="kv_aware: among workers of equal cost, rotate (spreads idle load best), or go where a keyed "
        "hash of the session id points, the same on every replica given one --router-secret-file "
        "(default: rotate; session with --processes over 1)",
    )


def _hash_args(p) -> None:
    """How the engines hash prompts."""
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size (default 16)")
    p.add_argument(
        "--hash-algo",
        default="xxhash",
        choices=HASH_ALGOS,
        help="the engines' prefix-caching hash (vLLM: sha256; agentkv serve: its --prefix-caching-hash-algo)",
    )
    p.add_argument("--hash-seed", default=None, help="the engines' hash seed (vLLM: PYTHONHASHSEED)")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        metavar="TOKENS",
        help="hybrid models: the window of the engines' sliding_window groups (the model config's "
        "sliding_window, e.g. 128 for gpt-oss), so a predicted hit needs the window's blocks as vLLM's does",
    )
    p.add_argument(
        "--attention-chunk-size",
        type=int,
        default=0,
        metavar="TOKENS",
        help="hybrid models: the chunk of chunked_local_attention groups (the config's attention_chunk_size)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH|builtin",
        help="tokenize text prompts as the engines do: a HF tokenizer.json (or its folder), or "
        "'builtin' for agentkv serve; without it text is matched approximately",
    )


def _approx_args(p) -> None:
    """Approximate mode (no KV events)."""
    p.add_argument(
        "--approximate",
        action="store_true",
        help="ignore KV events: predict each worker's cache from the router's own decisions",
    )
    p.add_argument(
        "--approx-capacity",
        type=int,
        default=65_536,
        metavar="BLOCKS",
        help="approximate mode: blocks assumed cached per worker (default 65,536)",
    )
    p.add_argument(
        "--approx-ttl",
        type=float,
        default=300.0,
        metavar="S",
        help="approximate mode: seconds a routed prefix is assumed cached (default 300)",
    )


def _tenant_args(p) -> None:
    """Tenants."""
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="API keys -> tenants (JSON {key: tenant} or '<key> <tenant>' lines; see docs/route.md)",
    )
    p.add_argument(
        "--router-secret",
        default=None,
        metavar="S",
        help="HMAC secret for tenant cache salts (visible in ps: prefer --router-secret-file or "
        "$AGENTKV_ROUTER_SECRET; default random)",
    )
    p.add_argument(
        "--router-secret-file",
        default=None,
        metavar="FILE",
        help="read the HMAC secret from the first line of FILE",
    )


def _curve_args(p) -> None:
    """CURVE: the router's key pair and each worker's pinned public key."""
    p.add_argument(
        "--kv-events-curve-secret-key",
        default=None,
        metavar="FILE",
        help="the router's CURVE key pair (a .key_secret file from `agentkv security keys`); its "
        "public key must be in each worker's --kv-events-curve-allow",
    )
    p.add_argument(
        "--kv-events-curve-server-key",
        action="append",
        default=[],
        metavar="[URL=]FILE",
        help="a worker's CURVE public key (.key file): events are taken only from the holder of its "
        "secret key; without URL= for every event worker without its own (repeatable)",
    )


def _health_args(p) -> None:
    """Worker health and limits."""
    p.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between /health checks of each worker (default 1)",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds a /health probe may take; one timeout takes out a worker whose requests are "
        "stuck while others answer, otherwise 3 in a row (default 2)",
    )
    p.add_argument(
        "--first-byte-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds a worker may take to send a request's first byte before the request is "
        "retried on another worker (default 0: no limit; a worker taken out of rotation "
        "releases its waiting requests either way)",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between /metrics scrapes of each worker (0: off)",
    )
    p.add_argument(
        "--max-streams-per-tenant",
        type=int,
        default=1024,
        metavar="N",
        help="concurrent requests per tenant; more get 429 (default 1024; 0: no limit)",
    )
    p.add_argument(
        "--max-index-blocks",
        type=int,
        default=1 << 22,
        metavar="N",
        help="blocks indexed per worker; stores past it are dropped and counted (default 4,194,304)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default info)",
    )


def _door_args(p) -> None:
    """What clients may send and hold: body caps, timeouts, connections, parsing off the loop."""
    add_http_args(p, parse_processes=2)
    p.add_argument(
        "--max-parses-per-tenant",
        type=int,
        default=2,
        metavar="N",
        help="bodies over 32KiB of one tenant read and parsed at once; more wait their turn before "
        "their body is read (default 2)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="N",
        help="the workers' context length in tokens: longer prompts are not tokenized or hashed, "
        "only forwarded (default 0: the largest max_model_len the workers' /v1/models report)",
    )


def config_from_args(args: argparse.Namespace):
    """Validate the flags of `agentkv route` into a RouterConfig."""
    from agentkv.route.proxy import RouterConfig
    from agentkv.route.workers import parse_worker

    _check_numbers(args)
    specs = [parse_worker(s) for s in args.worker]
    urls = [s.url for s in specs]
    if len(set(urls)) != len(urls):
        raise UserError("--worker: the same URL is given twice")
    specs = _with_curve(specs, args.kv_events_curve_secret_key, args.kv_events_curve_server_key)
    seed = args.hash_seed
    if seed is not None and args.hash_algo == "xxhash":
        seed = int(seed) if seed.isdigit() else seed
    return RouterConfig(
        workers=specs,
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        hash_seed=seed,
        policy=args.policy,
        approximate=args.approximate,
        api_keys=args.api_keys,
        secret=_secret(args),
        tokenizer=args.tokenizer,
        kv_weight=args.kv_weight,
        kv_queue_weight=args.kv_queue_weight,
        kv_queue_cap=args.kv_queue_cap,
        temperature=args.temperature,
        affinity=args.affinity,
        tie_break=args.tie_break or ("session" if args.processes > 1 else "rotate"),
        approx_capacity=args.approx_capacity,
        approx_ttl=args.approx_ttl,
        health_interval=args.health_interval,
        first_byte_timeout=args.first_byte_timeout or None,
        scrape_interval=args.scrape_interval,
        http=http_limits_from_args(args),
        max_parses_per_tenant=args.max_parses_per_tenant,
        max_model_len=args.max_model_len,
        health_timeout=args.health_timeout,
        max_streams_per_tenant=args.max_streams_per_tenant,
        max_index_blocks=args.max_index_blocks,
        windows={"sliding": args.sliding_window, "chunked": args.attention_chunk_size},
        host=args.host,
        port=args.port,
    )


def _check_numbers(args: argparse.Namespace) -> None:
    """One-line errors for numeric flags out of range (before anything starts)."""
    if not 1 <= args.processes <= 256:
        raise UserError(f"--processes must be 1 to 256, got {args.processes}")
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    if not (0 <= args.sliding_window <= 1 << 24 and 0 <= args.attention_chunk_size <= 1 << 24):
        raise UserError(
            "--sliding-window and --attention-chunk-size must be 0 (not told) to 16,777,216 tokens"
        )
    if args.approx_capacity < 1 or not args.approx_ttl > 0:
        raise UserError("--approx-capacity must be >= 1 and --approx-ttl > 0")
    if not all(
        0 <= v < float("inf") for v in (args.temperature, args.affinity, args.kv_weight, args.kv_queue_weight)
    ):
        raise UserError("--temperature, --affinity, --kv-weight and --kv-queue-weight must be finite, >= 0")
    if not args.health_interval > 0 or not args.scrape_interval >= 0:
        raise UserError(
            f"--health-interval must be > 0 seconds and --scrape-interval >= 0 (0: off), got "
            f"{args.health_interval:g} and {args.scrape_interval:g}"
        )
    if not args.first_byte_timeout >= 0:
        raise UserError(
            f"--first-byte-timeout must be >= 0 seconds (0: no limit), got {args.first_byte_timeout}"
        )
    if args.max_streams_per_tenant < 0 or args.max_index_blocks < 1:
        raise UserError("--max-streams-per-tenant must be >= 0 and --max-index-blocks >= 1")
    if not args.health_timeout > 0 or args.max_parses_per_tenant < 1 or args.max_model_len < 0:
        raise UserError(
            "--health-timeout must be > 0 seconds, --max-parses-per-tenant >= 1 and --max-model-len >= 0"
        )


def _with_curve(specs: list, secret: str | None, server_keys: list[str]) -> list:
    """The worker specs with their CurveClient: one key for all (`FILE`) and per worker (`URL=FILE`)."""
    if secret is None and not server_keys:
        return specs
    if secret is None or not server_keys:
        raise UserError(
            "--kv-events-curve-secret-key and --kv-events-curve-server-key go together: the router's "
            "key pair proves the router, the server key pins each worker"
        )
    import dataclasses

    from agentkv.events.curve import CurveClient, load_keypair, load_public_key

    flag = "--kv-events-curve-server-key"
    public, secret_key = load_keypair(secret, "--kv-events-curve-secret-key")
    default, per_url = None, {}
    for item in server_keys:
        url, sep, path = item.partition("=") if item.startswith(("http://", "https://")) else ("", "", item)
        if sep and url.rstrip("/") not in {s.url for s in specs if s.events}:
            raise UserError(f"{flag} {item}: {url} is not a --worker with an events endpoint")
        if not sep and default is not None:
            raise UserError(f"{flag}: a key for every worker is given twice (use URL=FILE per worker)")
        key = load_public_key(path, flag)
        if sep:
            per_url[url.rstrip("/")] = key
        else:
            default = key
    out = []
    for s in specs:
        key = per_url.get(s.url, default)
        curve = CurveClient(public, secret_key, key) if key is not None and s.events else None
        out.append(dataclasses.replace(s, curve=curve))
    return out


def _secret(args: argparse.Namespace) -> str | None:
    """--router-secret-file's first line, else --router-secret (with a warning: ps shows it)."""
    if args.router_secret_file and args.router_secret:
        raise UserError("give --router-secret or --router-secret-file, not both")
    if args.router_secret_file:
        from agentkv.route.tenants import read_secret_file

        return read_secret_file(args.router_secret_file)
    if args.router_secret:
        logging.getLogger("agentkv.route").warning(
            "--router-secret is visible to every user of this machine (ps); use --router-secret-file "
            "or $AGENTKV_ROUTER_SECRET"
        )
    return args.router_secret


def route_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    if args.processes > 1:
        from agentkv.route.processes import run_processes

        return run_processes(cfg, args.processes, args.log_level.upper())
    from agentkv.route.listen import run_router

    run_router(cfg)
    return 0
