"""The one `agentkv` entry point. Sub-commands stay thin: they parse flags and call the packages."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable

from agentkv import __version__
from agentkv.errors import UserError
from agentkv.placement import KV_WEIGHT, POLICIES

Handler = Callable[[argparse.Namespace], int | None]
# "auto" + agentkv.trace.formats.FORMATS, written out: importing the readers would slow `agentkv --help`
TRACE_FORMATS = ("auto", "agentx", "mooncake", "claude_code")


def _run(target: str, args: argparse.Namespace) -> int | None:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def _lazy(target: str) -> Handler:
    """The handler `module:function`, imported when the command runs (so `agentkv --help` stays
    quick); a partial, so the parsed args still pickle (simulate --sweep sends them to workers)."""
    return functools.partial(_run, target)


def _trace_commands(sub: argparse._SubParsersAction) -> None:
    """`agentkv trace ...`: read, convert, synthesise and summarise agentic traces."""
    trace = sub.add_parser("trace", help="read, convert, synthesise and summarise agentic traces")
    tsub = trace.add_subparsers(dest="trace_cmd", required=True, metavar="COMMAND")

    p = tsub.add_parser("stats", help="per-trace and total statistics, with the prefix-cache hit ceiling")
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="trace files or directories (default: the bundled sample)"
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="input format (default: detect from file name and content)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="N",
        help="show one row per trace up to N traces, else the N largest and a total (default 10)",
    )
    p.set_defaults(func=_lazy("agentkv.trace.stats:stats_command"))

    p = tsub.add_parser("synth", help="write seeded synthetic agentic sessions as AgentX JSON")
    p.add_argument(
        "--sessions", type=int, default=10, metavar="N", help="sessions (traces) to write (default 10)"
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="random seed; same seed, same bytes (default 0)"
    )
    p.add_argument(
        "-o",
        "--output",
        default="synth-traces",
        metavar="OUT",
        help="directory to write <trace id>.json files into (default ./synth-traces)",
    )
    p.add_argument("--gzip", action="store_true", help="write .json.gz files")
    p.set_defaults(func=_lazy("agentkv.trace.synth:synth_command"))

    p = tsub.add_parser(
        "convert", help="save traces (any format) as AgentX JSON, as kv-cache-tester and AIPerf read"
    )
    p.add_argument("paths", nargs="+", metavar="INPUT", help="trace files or directories")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="a .json or .json.gz file for one trace, or a directory for many",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="input format (default: detect from file name and content)",
    )
    p.add_argument("--gzip", action="store_true", help="gzip the files written into a directory (.json.gz)")
    p.set_defaults(func=_cmd_trace_convert)


def _cmd_trace_convert(args: argparse.Namespace) -> int:
    from agentkv.trace.formats.convert import convert

    for t, path in convert(args.paths, args.output, args.format, gzip=args.gzip):
        print(f"{path}  ({t.num_requests} requests, {t.num_subagents} sub-agents, from {t.format})")
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's knobs, under vLLM's flag names where vLLM has one (shared by simulate and serve)."""
    g = p.add_argument_group("engine (vLLM flag names)")
    g.add_argument("--gpu", default="h200", help="accelerator from the catalogue (default h200)")
    g.add_argument(
        "--model",
        default="llama3-8b",
        help="model shape: llama3-8b, llama3-70b, qwen3-32b, or a HF config.json / folder",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        metavar="GIB",
        help="CPU memory for KV offload, in GiB (vLLM's flag)",
    )
    g.add_argument(
        "--cpu-offload",
        default=None,
        metavar="SIZE",
        help="CPU offload tier as a size, e.g. 512GB (same as --kv-offloading-size)",
    )
    g.add_argument(
        "--disk-offload", default=None, metavar="SIZE", help="SSD tier below the CPU tier, e.g. 2TB"
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--eviction-policy", default="lru", help="lru, lfu, radix_lru, arc, session (default lru)")
    g.add_argument(
        "--prefix-caching-hash-algo",
        dest="hash_algo",
        default="xxhash",
        choices=["xxhash", "sha256", "sha256_cbor"],
    )


def engine_config_from_args(args: argparse.Namespace):
    from agentkv.engine.config import EngineConfig
    from agentkv.units import parse_capacity

    gib = float(1 << 30)
    offload = args.kv_offloading_size
    if args.cpu_offload:
        offload = parse_capacity(args.cpu_offload, "--cpu-offload") / gib
    disk = parse_capacity(args.disk_offload, "--disk-offload") / gib if args.disk_offload else 0.0
    return EngineConfig(
        gpu=args.gpu,
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_offloading_size=offload,
        kv_disk_size=disk,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        eviction_policy=args.eviction_policy,
        hash_algo=args.hash_algo,
    )


def add_kv_weight_arg(p: argparse.ArgumentParser) -> None:
    """kv_aware's price of one block still to prefill, in blocks of load (shared by simulate and route)."""
    p.add_argument(
        "--kv-weight",
        type=float,
        default=KV_WEIGHT,
        metavar="W",
        help=f"kv_aware: cost = W x blocks to prefill + blocks of load (default {KV_WEIGHT:g}; "
        "Dynamo's overlap weight is 1)",
    )


def _simulate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="replay traces on N simulated engines behind a router (virtual clock)"
    )
    p.add_argument(
        "paths", nargs="*", metavar="TRACE", help="trace files or directories (default: bundled sample)"
    )
    p.add_argument("--format", default="auto", choices=TRACE_FORMATS)
    p.add_argument("--workers", type=int, default=1, help="simulated engines (default 1)")
    p.add_argument("--lanes", type=int, default=16, help="concurrent session lanes (default 16)")
    p.add_argument("--router", default="kv_aware", choices=POLICIES)
    add_kv_weight_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warm-start", action="store_true", help="start each lane's first trace at a random point"
    )
    p.add_argument(
        "--idle-gap-cap", default="10s", help="longest gap while nothing is in flight (default 10s)"
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument(
        "--duration", default=None, help="stop releasing requests after this simulated time, e.g. 10m"
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run a grid over a setting (repeatable), e.g. --sweep lanes=16,64 --sweep cpu_offload=0,512GB",
    )
    p.add_argument("--out", default=None, help="write summary.json and requests.jsonl here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(func=_lazy("agentkv.sim.command:simulate_command"))


def _serve_command(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish KV events here, e.g. tcp://*:5557 (binds on '*', else connects, as vLLM)",
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
        "--workers",
        type=int,
        default=1,
        help="engines to start, on consecutive ports and event endpoints (default 1)",
    )
    p.add_argument(
        "--max-body-size", default=None, metavar="SIZE", help="largest request body (default 32MiB)"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="output length of chat requests without max_tokens (completions: 16, as vLLM)",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    p.set_defaults(func=_lazy("agentkv.serve.launch:serve_command"))


def _route_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="OpenAI-compatible router: KV-aware, session-aware, tenant-isolated")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL[=EVENTS[,REPLAY]]",
        required=True,
        help="an engine and, if it publishes KV events, its ZMQ event (and replay) endpoint, e.g. "
        "http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="kv_aware", choices=POLICIES)
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size (default 16)")
    p.add_argument(
        "--hash-algo",
        default="xxhash",
        choices=["xxhash", "sha256", "sha256_cbor"],
        help="the engines' prefix-caching hash (vLLM: sha256; agentkv serve: its --prefix-caching-hash-algo)",
    )
    p.add_argument("--hash-seed", default=None, help="the engines' hash seed (vLLM: PYTHONHASHSEED)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH|builtin",
        help="tokenize text prompts as the engines do: a HF tokenizer.json (or its folder), or "
        "'builtin' for agentkv serve; without it text is matched approximately",
    )
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
        help="HMAC secret for tenant cache salts (default $AGENTKV_ROUTER_SECRET, else random)",
    )
    add_kv_weight_arg(p)
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
        "--health-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between /health checks of each worker (default 1)",
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
        "--max-body-size", default="256MiB", metavar="SIZE", help="largest request body (default 256MiB)"
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_lazy("agentkv.route.command:route_command"))


def _bench_command(sub: argparse._SubParsersAction) -> None:
    from agentkv.bench.args import add_bench_args

    p = sub.add_parser(
        "bench",
        help="replay agentic sessions against an OpenAI-compatible server; "
        "requests.jsonl, summary.json and report.html (default: the embedded agentkv serve)",
    )
    add_bench_args(p)
    p.set_defaults(func=_lazy("agentkv.bench.command:bench_command"))


def _compare_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two run summaries (bench or simulate) side by side, with differences")
    p.add_argument("a", metavar="A", help="summary.json or a run folder")
    p.add_argument("b", metavar="B", help="summary.json or a run folder")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=_lazy("agentkv.bench.compare:compare_command"))


def _security_command(sub: argparse._SubParsersAction) -> None:
    sec = sub.add_parser("security", help="attacks that test agentkv's isolation promises")
    ssub = sec.add_subparsers(dest="security_cmd", required=True, metavar="COMMAND")
    p = ssub.add_parser(
        "side-channel", help="prefix-cache timing attack: can one client see another's prefixes?"
    )
    p.add_argument(
        "--target", required=True, metavar="URL", help="agentkv serve, agentkv route, or any OpenAI server"
    )
    p.add_argument(
        "--via-router",
        action="store_true",
        help="the target is agentkv route: victim and attacker use different tenants' keys",
    )
    p.add_argument("--api-key", default=None, metavar="K", help="the victim's API key")
    p.add_argument(
        "--attacker-key", default=None, metavar="K2", help="the attacker's API key (another tenant)"
    )
    p.add_argument("--trials", type=int, default=100, metavar="N", help="victim/probe rounds (default 100)")
    p.add_argument(
        "--prefix-tokens", type=int, default=4096, metavar="N", help="secret prefix length (default 4096)"
    )
    p.add_argument(
        "--calibration",
        type=int,
        default=6,
        metavar="N",
        help="the attacker's own cold/warm prompt pairs that set its threshold (default 6)",
    )
    p.add_argument(
        "--confidence", type=float, default=0.95, help="confidence level of the intervals (default 0.95)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name in requests (default: the target's first)")
    p.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="per-request time limit (default 60)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_lazy("agentkv.security.command:side_channel_command"))


def _cache_commands(sub: argparse._SubParsersAction) -> None:
    """`agentkv cache ...`: offline analysis of the KV cache on traces."""
    cache = sub.add_parser(
        "cache", help="offline KV-cache analysis of traces (eviction policies, capacities)"
    )
    csub = cache.add_subparsers(dest="cache_cmd", required=True, metavar="COMMAND")
    p = csub.add_parser(
        "analyze",
        help="token hit rate per (capacity, block size, eviction policy), with "
        "Belady's optimum and the unbounded-cache ceiling",
    )
    p.add_argument(
        "paths", nargs="*", metavar="TRACE", help="trace files or directories (default: bundled sample)"
    )
    p.add_argument("--format", default="auto", choices=TRACE_FORMATS)
    p.add_argument(
        "--capacity",
        default="100GB",
        metavar="SIZES",
        help="GPU KV capacities, comma-separated, e.g. 50GB,100GB,200GB (default 100GB)",
    )
    p.add_argument(
        "--model",
        default="llama3-8b",
        help="model shape for KV bytes per token: llama3-8b, llama3-70b, qwen3-32b, or a HF config.json",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8 (default auto)")
    p.add_argument(
        "--block-size",
        default="16",
        metavar="SIZES",
        help="block sizes in tokens, comma-separated, e.g. 16,64 (default 16)",
    )
    p.add_argument(
        "--policy",
        default=None,
        metavar="NAMES",
        help="eviction policies, comma-separated: lru, lfu, radix, arc, session, belady (default all)",
    )
    p.add_argument("--cpu", default=None, metavar="SIZE", help="a CPU tier below the GPU, e.g. 512GB")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="N sessions at a time, the next starting when one ends (default: all from t=0)",
    )
    p.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the grid (default: usable cores, at most 4)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--plot", default=None, metavar="OUT", help="write a hit rate vs capacity chart (.html or .svg)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=_lazy("agentkv.cache.view:analyze_command"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description="Replay, simulate and route agentic LLM inference; the KV cache at the centre.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _trace_commands(sub)
    _cache_commands(sub)
    _simulate_command(sub)
    _route_command(sub)
    _serve_command(sub)
    _bench_command(sub)
    _compare_command(sub)
    _security_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"agentkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
