"""`agentkv route`: flags -> RouterConfig -> the proxy, with one clear error for bad input."""

from __future__ import annotations

import argparse
import logging

from agentkv.errors import UserError
from agentkv.route.proxy import RouterConfig, run_router
from agentkv.route.workers import parse_worker


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Validate the flags of `agentkv route` into a RouterConfig."""
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    if args.approx_capacity < 1 or not args.approx_ttl > 0:
        raise UserError("--approx-capacity must be >= 1 and --approx-ttl > 0")
    if not (args.temperature >= 0 and args.affinity >= 0 and args.kv_weight >= 0):
        raise UserError("--temperature, --affinity and --kv-weight must be >= 0")
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
    from agentkv.units import parse_capacity

    max_body = parse_capacity(args.max_body_size, "--max-body-size")
    if max_body < 1024:
        raise UserError(f"--max-body-size must be at least 1KiB, got {args.max_body_size}")
    specs = [parse_worker(s) for s in args.worker]
    urls = [s.url for s in specs]
    if len(set(urls)) != len(urls):
        raise UserError("--worker: the same URL is given twice")
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
        secret=args.router_secret,
        tokenizer=args.tokenizer,
        kv_weight=args.kv_weight,
        temperature=args.temperature,
        affinity=args.affinity,
        approx_capacity=args.approx_capacity,
        approx_ttl=args.approx_ttl,
        health_interval=args.health_interval,
        first_byte_timeout=args.first_byte_timeout or None,
        scrape_interval=args.scrape_interval,
        max_body_bytes=int(max_body),
        max_streams_per_tenant=args.max_streams_per_tenant,
        max_index_blocks=args.max_index_blocks,
        host=args.host,
        port=args.port,
    )


def route_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_router(config_from_args(args))
    return 0
