"""The prefix-cache timing attack: can one client tell whether another recently sent a given prefix?

Each trial, a victim sends a fresh secret prefix. The attacker then probes one candidate: the
victim's prefix (half of the trials, in a seeded random order) or a fresh one of the same length,
each followed by a fresh suffix so the probe is never the victim's exact prompt. The attacker
scores each probe by its time to first token (lower: cached) and, when the server reports it, by
`usage.prompt_tokens_details.cached_tokens`. Its decision threshold comes only from its own
traffic (a fresh prompt, then the same prompt again), as a real attacker would calibrate. The
report is the ROC AUC (DeLong CI) and accuracy (Wilson CI) per signal: AUC near 1 means the cache
leaks across clients; an interval holding 0.5 means the attacker does no better than chance.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from agentkv.errors import UserError
from agentkv.security.stats import Interval, auc_delong, wilson

TOKEN_RANGE = (1000, 30000)  # ids every agentkv / vLLM tokenizer has


@dataclass(slots=True)
class AttackConfig:
    """One attack run: the target, the two clients' keys, how many trials of what size."""

    target: str
    via_router: bool = False
    victim_key: str | None = None
    attacker_key: str | None = None
    trials: int = 100
    prefix_tokens: int = 4096
    suffix_tokens: int = 16
    calibration: int = 6
    seed: int = 0
    confidence: float = 0.95
    model: str | None = None
    timeout: float = 60.0

    def check(self) -> None:
        """UserError for settings the attack cannot run with."""
        if self.trials < 8:
            raise UserError(f"--trials must be >= 8 (4 of each class), got {self.trials}")
        if self.prefix_tokens < 16:
            raise UserError(f"--prefix-tokens must be >= 16 (one KV block), got {self.prefix_tokens}")
        if self.calibration < 1:
            raise UserError(f"--calibration must be >= 1, got {self.calibration}")
        if not 0 < self.confidence < 1:
            raise UserError(f"--confidence must be in (0, 1), got {self.confidence}")
        if not 0 < self.timeout < float("inf"):
            raise UserError(f"--timeout must be a finite number of seconds > 0, got {self.timeout}")
        if self.via_router:
            if not self.victim_key or not self.attacker_key:
                raise UserError(
                    "--via-router needs --api-key (the victim's) and --attacker-key (another tenant's)"
                )
            if self.victim_key == self.attacker_key:
                raise UserError("--api-key and --attacker-key must differ: the attack is across tenants")


@dataclass(frozen=True, slots=True)
class Probe:
    """One attacker probe: whether it carried the victim's prefix, its TTFT, the cached tokens reported."""

    victim_prefix: bool
    ttft: float
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class SignalResult:
    """How well one signal separates victim-prefix probes (positives) from fresh ones."""

    signal: str  # "ttft" or "cached_tokens"
    auc: Interval
    accuracy: Interval  # with the attacker's own threshold
    threshold: float
    median_positive: float
    median_negative: float


@dataclass(slots=True)
class SideChannelReport:
    """Everything a run found; `leaks` when some signal's AUC interval lies above 0.5."""

    target: str
    via_router: bool
    trials: int
    prefix_tokens: int
    confidence: float
    calibration_cold_ms: float
    calibration_warm_ms: float
    signals: list[SignalResult] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def leaks(self) -> bool:
        return any(s.auc.low > 0.5 for s in self.signals)

    def to_dict(self) -> dict:
        d = msgspec.to_builtins(self)
        d["leaks"] = self.leaks
        return d


class _Client:
    """Sends one-token completions as one client (API key), timing the first streamed token."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base: str,
        key: str | None,
        model: str | None,
        who: str,
        timeout: float,
    ) -> None:
        self.session, self.base, self.model, self.who = session, base, model, who
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def models(self) -> list[str]:
        try:
            async with self.session.get(
                self.base + "/v1/models", headers=self.headers, timeout=self.timeout
            ) as r:
                if r.status != 200:
                    raise _http_error(self.who, "GET /v1/models", r.status, await r.read())
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UserError(f"target {self.base} is not reachable ({type(e).__name__}); is it up?") from None
        try:
            return [m["id"] for m in data["data"]]
        except (KeyError, TypeError):
            return []

    async def complete(self, prompt: list[int]) -> tuple[float, int | None]:
        """(seconds to the first token, cached_tokens or None) of a streamed one-token completion."""
        body: dict = {
            "prompt": prompt,
            "max_tokens": 1,
            "stream": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        data = msgspec.json.encode(body)
        cached = None
        first = None
        try:
            t0 = time.perf_counter()
            async with self.session.post(
                self.base + "/v1/completions", data=data, headers=self.headers, timeout=self.timeout
            ) as r:
                if r.status != 200:
                    raise _http_error(self.who, "POST /v1/completions", r.status, await r.read())
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    if b'"usage"' in line:
                        usage = msgspec.json.decode(line[6:]).get("usage") or {}
                        details = usage.get("prompt_tokens_details") or {}
                        if isinstance(details.get("cached_tokens"), int):
                            cached = details["cached_tokens"]
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UserError(f"{self.who}: request to {self.base} failed ({type(e).__name__})") from None
        if first is None:
            raise UserError(f"{self.who}: {self.base} streamed no token")
        return first, cached


def _http_error(who: str, what: str, status: int, body: bytes) -> UserError:
    """A one-line error with the server's own message (ours never quote prompts; ours are random ids)."""
    try:
        err = msgspec.json.decode(body).get("error") or {}
        detail = f"{err.get('type', '')}: {str(err.get('message', ''))[:200]}"
    except (msgspec.DecodeError, AttributeError):
        detail = "no JSON error body"
    return UserError(f"{who}: {what} answered HTTP {status} ({detail})")


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def analyse(probes: list[Probe], cold: list[float], warm: list[float], level: float) -> list[SignalResult]:
    """Per signal: AUC and accuracy over the probes. TTFT uses the attacker's calibrated threshold
    (midway between its own cold and warm medians); cached_tokens calls any cached token a hit."""
    pos = [p for p in probes if p.victim_prefix]
    neg = [p for p in probes if not p.victim_prefix]
    threshold = (statistics.median(cold) + statistics.median(warm)) / 2
    right = sum((p.ttft < threshold) == p.victim_prefix for p in probes)
    out = [
        SignalResult(
            "ttft",
            auc_delong([-p.ttft for p in pos], [-p.ttft for p in neg], level),
            wilson(right, len(probes), level),
            threshold * 1000,
            _median_ms([p.ttft for p in pos]),
            _median_ms([p.ttft for p in neg]),
        )
    ]
    if all(p.cached_tokens is not None for p in probes):
        right = sum((p.cached_tokens > 0) == p.victim_prefix for p in probes)
        out.append(
            SignalResult(
                "cached_tokens",
                auc_delong([p.cached_tokens for p in pos], [p.cached_tokens for p in neg], level),
                wilson(right, len(probes), level),
                0.5,
                statistics.median(p.cached_tokens for p in pos),
                statistics.median(p.cached_tokens for p in neg),
            )
        )
    return out


async def run_attack(cfg: AttackConfig, on_trial=None) -> SideChannelReport:
    """Calibrate, run `cfg.trials` victim/attacker rounds against `cfg.target`, analyse."""
    cfg.check()
    rng = random.Random(cfg.seed)
    lo, hi = TOKEN_RANGE

    def fresh(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    base = cfg.target.rstrip("/").removesuffix("/v1")
    if "://" not in base:
        base = "http://" + base
    t_start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        attacker = _Client(session, base, cfg.attacker_key, cfg.model, "attacker", cfg.timeout)
        model = cfg.model or next(iter(await attacker.models()), None)
        attacker.model = model
        victim = _Client(session, base, cfg.victim_key, model, "victim", cfg.timeout)
        await victim.complete(fresh(16))  # both keys work, connections are warm
        await attacker.complete(fresh(16))
        cold, warm = [], []
        for _ in range(cfg.calibration):  # the attacker's own prompt, twice: uncached, then cached
            p = fresh(cfg.prefix_tokens)
            cold.append((await attacker.complete(p + fresh(cfg.suffix_tokens)))[0])
            warm.append((await attacker.complete(p + fresh(cfg.suffix_tokens)))[0])
        labels = [i < cfg.trials // 2 for i in range(cfg.trials)]
        rng.shuffle(labels)
        probes: list[Probe] = []
        for i, label in enumerate(labels):
            secret = fresh(cfg.prefix_tokens)
            await victim.complete(secret + fresh(cfg.suffix_tokens))
            candidate = secret if label else fresh(cfg.prefix_tokens)
            ttft, cached = await attacker.complete(candidate + fresh(cfg.suffix_tokens))
            probes.append(Probe(label, ttft, cached))
            if on_trial is not None:
                on_trial(i + 1, cfg.trials)
    report = SideChannelReport(
        cfg.target,
        cfg.via_router,
        cfg.trials,
        cfg.prefix_tokens,
        cfg.confidence,
        _median_ms(cold),
        _median_ms(warm),
        analyse(probes, cold, warm, cfg.confidence),
    )
    report.wall_seconds = time.perf_counter() - t_start
    return report


def side_channel(cfg: AttackConfig, on_trial=None) -> SideChannelReport:
    """`run_attack` on a fresh event loop."""
    return asyncio.run(run_attack(cfg, on_trial))
