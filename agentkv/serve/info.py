"""The small read-only endpoints of `agentkv serve`: models, health, version, metrics, sglang's probes,
and the KV-block digest for checking a router's index."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from agentkv import __version__
from agentkv.gate.errors import JSON
from agentkv.kv.digest import block_digest
from agentkv.serve.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from agentkv.serve.app import Server

_enc = msgspec.json.Encoder()


def add_info_routes(app: web.Application, server: Server) -> None:
    """GET endpoints that read the server's state and change nothing."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(request: web.Request) -> web.Response:
        return web.Response(body=_enc.encode({"version": __version__}), content_type=JSON)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=server.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(request: web.Request) -> web.Response:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "agentkv",
            "root": server.config.model,
            "parent": None,
            "max_model_len": server.limits.max_model_len,
            "permission": [],
        }
        return web.Response(body=_enc.encode({"object": "list", "data": [card]}), content_type=JSON)

    async def debug_kv_blocks(request: web.Request) -> web.Response:
        """The count and an order-free digest of the GPU prefix cache's block hashes (what the KV
        events announced), to check a router's index against; no hash is revealed."""
        return web.json_response({"GPU": block_digest(server.runner.engine.cached_block_hashes())})

    async def server_info(request: web.Request) -> web.Response:
        return web.Response(body=_enc.encode(_server_info(server)), content_type=JSON)

    async def model_info(request: web.Request) -> web.Response:
        info = {
            "model_path": server.config.model,
            "tokenizer_path": None,
            "is_generation": True,
            "served_model_name": server.model_name,
            "max_model_len": server.limits.max_model_len,
            "vocab_size": server.limits.vocab_size,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
        }
        return web.Response(body=_enc.encode(info), content_type=JSON)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/debug/kv_blocks", debug_kv_blocks)


def _server_info(server: Server) -> dict:
    """sglang-router probes this: the server's settings, in sglang's key names where it has them."""
    eng = server.runner.engine
    cfg = server.config
    return {
        "model_path": cfg.model,
        "served_model_name": server.model_name,
        "tokenizer_path": None,
        "skip_tokenizer_init": True,
        "tp_size": cfg.tensor_parallel_size,
        "dp_size": 1,
        "page_size": cfg.block_size,
        "context_length": server.limits.max_model_len,
        "max_total_num_tokens": eng.num_gpu_blocks * cfg.block_size,
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "gpu": cfg.gpu,
        "time_scale": server.options.time_scale,
        "kv_events_endpoint": server.publisher.endpoint if server.publisher else None,
        "version": __version__,
        "engine": "agentkv",
    }
