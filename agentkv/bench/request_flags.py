"""The request and dataset-cycling flags of `agentkv bench` (argparse only: import-light).

Parsed by `agentkv.bench.request_opts.RequestOptions.from_flags` and `config_from_args`.
"""

from __future__ import annotations


def add_request_flags(p) -> None:
    """--header, --extra-body, --api-key, --api-key-file; --cycle and --cycle-cache."""
    p.add_argument(
        "--header",
        action="append",
        default=None,
        metavar="NAME:VALUE",
        help="an HTTP header sent with every request (repeatable), e.g. 'X-Tenant: a'",
    )
    p.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. '{\"top_k\": 1}' (or @FILE)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="sent as Authorization: Bearer KEY (default $OPENAI_API_KEY); never printed or saved",
    )
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE")
    p.add_argument(
        "--cycle",
        action="store_true",
        help="repeat the trace set until --duration or --max-requests ends the run (steady state); "
        "each pass's sessions get new ids",
    )
    p.add_argument(
        "--cycle-cache",
        default="fresh",
        choices=["fresh", "shared"],
        help="with --cycle: fresh (default) keys each pass's blocks apart, so passes never hit each "
        "other's cache; shared lets a pass reuse what an earlier one cached",
    )
