"""Disaggregated prefill/decode in one `agentkv serve` worker, as vLLM's NIXL connector behaves to
its proxy: a request with `kv_transfer_params.do_remote_decode` runs as a prefill and its response
hands on `kv_transfer_params` (its block ids, engine id, host, port, TP size); a request carrying
those with `do_remote_prefill` is a decode whose prompt KV arrives over this worker's link (priced
by the link model for the tokens this worker does not cache already, transfers into one worker
queued one after another) and is then admitted with the prompt but its last token loaded, not
computed. Simplification: the prefill frees its blocks at once (vLLM holds them until the pull).
"""

from __future__ import annotations

import uuid

from agentkv.engine.kv_move import kv_transfer_seconds
from agentkv.kv.transfer import LinkModel
from agentkv.serve.protocol import GenRequest
from agentkv.serve.runner import EngineRunner, RequestStream


class KVLink:
    """One worker's side of KV transfers: its identity as a prefill, its inbound link as a decode."""

    def __init__(self, runner: EngineRunner, link: LinkModel, host: str, port: int | None) -> None:
        self.runner = runner
        self.link = link
        self.engine_id = uuid.uuid4().hex
        self.host, self.port = host, port
        self.free_at = 0.0  # engine time the inbound link is free again
        self.transfers = 0
        self.moved_bytes = 0

    def producer_params(self, stream: RequestStream) -> dict:
        """What a finished prefill hands the proxy for the decode (vLLM NIXL's fields)."""
        req = stream.engine_req
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [] if req is None or req.block_ids is None else req.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.runner.engine.config.tensor_parallel_size,
        }

    def receive(self, gen: GenRequest) -> tuple[list[int], int, float]:
        """(block hashes, tokens that arrive, wall seconds until they have) of a decode request."""
        kt = gen.kv_transfer
        eng = self.runner.engine
        bs = eng.config.block_size
        hashes = eng.hasher.hashes(gen.prompt_ids, bs, cache_salt=gen.cache_salt)
        arrived = min(len(gen.prompt_ids) - 1, len(kt.remote_block_ids or ()) * bs)
        local = eng.cached_prefix(hashes)[0] * bs
        tp_src = kt.tp_size or eng.config.tensor_parallel_size
        secs, moved = kv_transfer_seconds(eng, local, arrived, tp_src, self.link)
        now = self.runner.event_time()
        end = max(now, self.free_at) + secs
        if secs:
            self.free_at = end
        self.transfers += 1
        self.moved_bytes += moved
        return hashes, arrived, self.runner.real.wall_delay(end - now)
