"""`agentkv cache analyze`: flags, then the grid run with a progress bar, tables, JSON or a chart."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agentkv.engine.models.catalogue import model_help
from agentkv.errors import UserError
from agentkv.scaleout.raytasks import add_ray_arg, import_ray
from agentkv.trace.command import add_trace_args


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    add_trace_args(p)
    p.add_argument(
        "--capacity",
        default="100GB",
        metavar="SIZES",
        help="GPU KV capacities, comma-separated, e.g. 50GB,100GB,200GB (default 100GB)",
    )
    p.add_argument(
        "--model",
        default="llama3-8b",
        help="for KV bytes per token (a hybrid model: its KV groups, as the engine lays them out); "
        + model_help(),
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), fp8 or nvfp4 (default auto)")
    p.add_argument(
        "--block-size",
        default="16",
        metavar="SIZES",
        help="block sizes in tokens, comma-separated, e.g. 16,64 (default 16)",
    )
    _pool_args(p)
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
    add_ray_arg(p, "the grid's cells")
    _output_args(p)
    p.set_defaults(func=analyze_command)


def _pool_args(p: argparse.ArgumentParser) -> None:
    """--policy, --cpu: what each cell's pool evicts, and the tier below it."""
    p.add_argument(
        "--policy",
        default=None,
        metavar="NAMES",
        help="eviction policies, comma-separated: lru, lfu, radix, arc, session, belady (default all; "
        "for a model with hybrid KV groups every one but belady, lru alone by default)",
    )
    p.add_argument(
        "--cpu",
        default=None,
        metavar="SIZE",
        help="a CPU tier below the GPU, e.g. 512GB (a hybrid model's keeps each group's blocks, "
        "as vLLM's offloading connector)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    """--json, --plot, --quiet."""
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--plot", default=None, metavar="OUT", help="write a hit rate vs capacity chart (.html or .svg)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def analyze_command(args: argparse.Namespace) -> int:
    """`agentkv cache analyze`: load the traces (or the bundled sample), run the grid, print and plot."""
    import msgspec
    from rich.console import Console

    from agentkv.cache.grid import make_grid, parse_block_sizes
    from agentkv.cache.view import PLOT_SUFFIXES, render, write_plot
    from agentkv.trace.command import load_noted

    plot = Path(args.plot) if args.plot else None
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise UserError(
            f"--plot: {plot} must end in .html or .svg (a self-contained chart; no PNG, so no "
            "plotting library is needed)"
        )
    jobs = _jobs(args)
    grid = make_grid(
        args.capacity,
        args.block_size,
        args.policy,
        args.model,
        args.kv_cache_dtype,
        args.cpu,
        args.concurrency,
    )
    # as vLLM warns when it overrides the flag
    if sorted(set(parse_block_sizes(args.block_size))) != sorted(grid.block_sizes):
        sizes = ", ".join(map(str, grid.block_sizes))
        print(
            f"note: --block-size {args.block_size}: {grid.model} runs with {sizes}-token KV blocks in vLLM",
            file=sys.stderr,
        )
    traces = load_noted(args)
    result = _run(args, traces, grid, jobs)
    if plot is not None:
        write_plot(result, plot)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    else:
        console = Console()
        render(result, console)
        if plot is not None:
            console.print(f"chart: {plot}")
    if result.interrupted:
        from agentkv.terminal import EXIT_INTERRUPTED

        total = len(grid.capacities) * len(grid.block_sizes) * len(grid.policies)
        print(f"agentkv: interrupted: {len(result.results)} of {total} replays done (shown)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _run(args: argparse.Namespace, traces, grid, jobs: int):
    """The analysis, with a progress bar and ETA on a terminal; the first Ctrl-C keeps the replays
    finished and drops the ones in hand, a second stops at once."""
    from rich.console import Console

    from agentkv.cache.analyze import analyze
    from agentkv.terminal import StopRequest, progress_bar

    err = Console(stderr=True)
    show = not args.quiet and err.is_terminal
    if not args.quiet and not show:  # no bar (piped): one line, so a long run is not silent
        err.print("analyzing (Ctrl-C stops and keeps the finished replays)", highlight=False)
    note = "agentkv: stopping: keeping the finished replays (Ctrl-C again to quit now)"
    started = time.monotonic()

    def line(done: int, total: int, what: str) -> None:  # piped: a line a step, as a sweep prints
        err.print(
            f"{done}/{total} steps, {time.monotonic() - started:.0f} s elapsed: {what}", highlight=False
        )

    with StopRequest(note) as stop, progress_bar(err, visible=show) as bar:
        task = bar.add_task("preparing accesses", total=None)
        return analyze(
            traces,
            grid,
            jobs=jobs,
            progress=(lambda d, t, what: bar.update(task, completed=d, total=t, description=what))
            if show or args.quiet
            else line,
            stop=stop,
            ray=args.ray,
        )


def _jobs(args: argparse.Namespace) -> int:
    """`--jobs` (default: usable cores, at most 4), checked; with `--ray`, Ray's install hint if it is
    missing, before the traces load."""
    from agentkv.cache.analyze import default_jobs

    if args.ray is not None:
        import_ray(args.ray)
    jobs = args.jobs if args.jobs is not None else default_jobs()
    if jobs < 1:
        raise UserError(f"--jobs: must be at least 1, got {jobs}")
    return jobs
