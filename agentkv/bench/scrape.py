"""Scrape a target's Prometheus `/metrics` during a run (the parsing is `agentkv.metrics.scrape`)."""

from __future__ import annotations

import asyncio

import aiohttp

from agentkv.metrics.scrape import MetricsSnapshot, hit_rate, snapshot

__all__ = ["MetricsSnapshot", "Scraper", "hit_rate"]


class Scraper:
    """Reads `<base>/metrics` on the client's session; remembers why it could not when it cannot."""

    def __init__(self, session: aiohttp.ClientSession, base: str, timeout: float = 2.0):
        self.session, self.url, self.timeout = session, f"{base}/metrics", timeout
        self.absent_reason: str | None = None

    async def page(self) -> str | None:
        """The /metrics text, or None (and `absent_reason` says why) when the target serves none."""
        try:
            async with asyncio.timeout(self.timeout), self.session.get(self.url) as resp:
                if resp.status != 200:
                    self.absent_reason = f"GET /metrics answered HTTP {resp.status}"
                    return None
                return await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.absent_reason = f"GET /metrics failed ({type(e).__name__})"
        except UnicodeDecodeError:
            self.absent_reason = "GET /metrics answered text that does not decode (UTF-8 or its charset)"
        return None

    async def scrape(self) -> MetricsSnapshot | None:
        text = await self.page()
        if text is None:
            return None
        snap = snapshot(text)
        if snap == MetricsSnapshot():
            self.absent_reason = "/metrics has none of vLLM's or SGLang's cache and queue metrics"
            return None
        self.absent_reason = None
        return snap
