"""The probe plan: which prompts to send, sized to the target's max model length and a time budget."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIN_MODEL_LEN = 1024  # below this the probes cannot separate prefill from overheads
SHORT_PREFILL = 1024  # new tokens up to which a prefill probe takes more samples
# GEMM overlap is largest where a step's weight read equals its GEMM time: ~190 tokens on an H100 at
# 70% GEMM efficiency (a 10% change in `overlap_k` moves that step 4%, a 2,048-token one 0.6%)
OVERLAP_NEW = 256
COLD = (16, 128, 192, 256, 512, 2048, 4096, 8192, 16384, 32768, 65536)
# attention among new tokens is largest in one full chunk (13% of an 8,192-token step on a 7B model):
# cold prompts of this many tokens up to the chunk take twice the samples
SELF_NEW = 4096
# attention to a cached past is pinned by the probes where it is a large share of the step: many new
# tokens after a long past (a 32K model: 4096 after 16384 spend ~half their time there; 1024 after
# 8192, the most the plan had before, under 30%, beside 5-20% of host delay)
CACHED_PAST = (2048, 4096, 8192, 16384, 32768)
CACHED_NEW = (128, 1024, 4096)
# the per-layer setup of a cached-past kernel is a fifth of the step of a few new tokens after a
# short past (a 7B model: 50 us of ~250 us a layer), but under 5% of any step above; after 512 cached
# tokens that step differs from a cold 16-token one by the setup alone (plus 1% of attention and
# parsing), so the two pin it directly; they take 8 samples per repeat. The closest pair is 16 new
# tokens after one cached block against the cold 16-token prompt: the prompts differ by one block, so
# the host's per-token time (parsing, hashing: 0.5-1.6 us a token on a busy host, as much as the setup
# after 512 cached tokens at time scale 1) cancels and only the setup separates them
TINY_NEW, TINY_PASTS = 16, (512, 2048, 4096, 8192)
DECODE_N = (1, 8, 32)
DECODE_CTX = (1024, 4096, 8192, 32768, 65536)
DECODE_TOKENS_MAX = 262_144  # N x context of one decode probe (keeps the KV it needs modest)
DECODE_OUT = 48  # output tokens per decode stream
INTERFERE_NEW = (2048, 8192)  # a cold prefill of this many tokens arrives ...
INTERFERE_N, INTERFERE_CTX = 8, 1024  # ... while this many streams of this context decode
# host time under traffic: a short prompt's first token while K streams of LOADED_CTX decode (an
# engine and API server sharing a busy host meet time per request that grows with the streams)
LOADED_NEW, LOADED_CTX, LOADED_N = 256, 512, (1, 3)
# the families measured as one decode step (calib.floor's rungs are long single-stream decodes)
DECODING = ("decode", "floor")


@dataclass(slots=True)
class Probe:
    """One measurement: `family` prefill_cold (new), prefill_cached (new after past), decode (n x ctx)
    or interference (a cold prefill of `new`, sent `lead_s` wall seconds after n x ctx streams start).

    Family loaded_ttft is a short cold prompt (`new`) sent beside n x ctx decoding streams.
    `measured_s` is engine seconds (wall x time scale): TTFT for prefill and loaded_ttft, inter-token
    time for decode, the longest decode gap across the prefill for interference."""

    family: str
    new: int = 0
    past: int = 0
    n: int = 1
    ctx: int = 0
    out: int = 1
    lead_s: float = 0.0
    samples_s: list[float] = field(default_factory=list)
    measured_s: float | None = None

    def settle(self) -> None:
        """`measured_s` from the samples: their median, and a stall's least (a maximum of gaps, which
        any hiccup inflates). calibrate samples in rounds (`probes.run_plan`), so the samples are
        independent draws of a busy host, as bench's requests are: the least of them, the run's
        fastest moment, predicted the live vLLM bench 33-51% too fast (docs/cost-model.md); a decode
        step's least is also biased low where a server catches up after a late wake-up."""
        pick = min if self.family == "interference" else statistics.median
        self.measured_s = pick(self.samples_s) if self.samples_s else None

    def label(self) -> str:
        """A short name for progress lines and tables."""
        if self.family in DECODING:
            return f"{self.family} n={self.n} ctx={self.ctx}"
        if self.family in ("interference", "loaded_ttft"):
            return f"{self.family} new={self.new} beside n={self.n} ctx={self.ctx}"
        return f"{self.family} new={self.new} past={self.past}"


def make_plan(
    max_model_len: int, block_size: int, chunk: int = 8192, kv_tokens: int | None = None
) -> list[Probe]:
    """Every probe that fits `max_model_len` (and half of `kv_tokens`, the KV cache, when known); a decode
    probe's streams get enough output to still be decoding after the last one's chunked prefill."""
    cap = min(DECODE_TOKENS_MAX, kv_tokens // 2) if kv_tokens else DECODE_TOKENS_MAX
    room = min(max_model_len, int(kv_tokens * 0.9) if kv_tokens else max_model_len) - DECODE_OUT - 1
    out: list[Probe] = [Probe("prefill_cold", new=n) for n in COLD if n <= room]
    out.append(Probe("prefill_cached", new=TINY_NEW, past=block_size))  # the pair of cold 16: one block
    for past in sorted(set(CACHED_PAST) | set(TINY_PASTS)):
        for new in CACHED_NEW if past in CACHED_PAST else ():
            if past + new <= room and past <= max_model_len // 2:
                out.append(Probe("prefill_cached", new=new, past=past))
        if past in TINY_PASTS and past <= max_model_len // 2 and past + TINY_NEW <= room:
            out.append(Probe("prefill_cached", new=TINY_NEW, past=past))
    for ctx in DECODE_CTX:
        for n in DECODE_N:
            if ctx + DECODE_OUT <= room and n * ctx <= cap:
                out.append(Probe("decode", n=n, ctx=ctx, out=DECODE_OUT + -(-n * ctx // chunk)))
    for new in INTERFERE_NEW:
        busy = INTERFERE_N * (INTERFERE_CTX + DECODE_OUT)
        if new <= room and busy <= cap and (not kv_tokens or new + busy <= kv_tokens * 0.9):
            out.append(Probe("interference", new=new, n=INTERFERE_N, ctx=INTERFERE_CTX, out=DECODE_OUT))
    for n in LOADED_N:
        if room >= LOADED_CTX + DECODE_OUT and n * (LOADED_CTX + DECODE_OUT) + LOADED_NEW <= cap:
            out.append(Probe("loaded_ttft", new=LOADED_NEW, n=n, ctx=LOADED_CTX, out=DECODE_OUT))
    for p in out:
        p.past -= p.past % block_size  # a cached past is whole blocks
    return out


def tiny_pair(probes: list[Probe]) -> tuple[Probe, Probe] | None:
    """(the cold TINY_NEW-token prompt, TINY_NEW new tokens after the shortest cached past) of
    `probes`: the two that differ by the cached-past setup alone (calib.pair); None without both."""
    cold = [p for p in probes if p.family == "prefill_cold" and p.new == TINY_NEW]
    cached = [p for p in probes if p.family == "prefill_cached" and p.new == TINY_NEW and p.past]
    return (cold[0], min(cached, key=lambda p: p.past)) if cold and cached else None


def samples(p: Probe, repeats: int) -> int:
    """How many times to send `p`: `repeats`, more for the prefills where a weak term is largest
    (host timing noise hurts the shortest most, and they cost least): up to 16 new tokens (launch
    floor, cached-past setup) 8x, up to 256 (GEMM overlap) 4x, up to 1,024 2x, and a cold prompt of
    4,096-8,192 tokens (attention among new tokens) 2x."""
    if p.family not in ("prefill_cold", "prefill_cached"):
        return repeats
    if p.new <= TINY_NEW:
        return repeats * 8
    if p.new <= OVERLAP_NEW:
        return repeats * 4
    if p.new <= SHORT_PREFILL or (p.family == "prefill_cold" and SELF_NEW <= p.new <= 8192):
        return repeats * 2
    return repeats


def within_budget(probes: list[Probe], est_wall_s: list[float], budget_s: float) -> list[Probe]:
    """The cheapest probes (by estimated wall seconds, all samples) that fit `budget_s`, in plan order."""
    order = sorted(range(len(probes)), key=lambda i: est_wall_s[i])
    keep, spent = set(), 0.0
    for i in order:
        if spent + est_wall_s[i] > budget_s:
            break
        keep.add(i)
        spent += est_wall_s[i]
    return [p for i, p in enumerate(probes) if i in keep]
