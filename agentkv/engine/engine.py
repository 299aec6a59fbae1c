"""The agentkv engine: vLLM's scheduling and paged prefix cache, timed by a calibrated cost model.

No weights and no GPU: a step's duration comes from `CostModel`, output tokens are counted, not
computed. `step()` runs one engine step at the clock's `now()` and returns what happened, with
the step's end time; the driver advances a virtual clock (simulator) or sleeps (server).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from agentkv.engine.config import EngineConfig
from agentkv.engine.cost import CostModel, load_coefficients
from agentkv.engine.hardware import get_model
from agentkv.engine.outputs import DecodeBurst, EngineStats, RequestOutput, StepResult
from agentkv.engine.pools import make_pool, seq_token_capacity
from agentkv.engine.request import EngineRequest, Status
from agentkv.engine.scheduler import Scheduler
from agentkv.kv.events import KVEvent
from agentkv.kv.groups import HybridPool
from agentkv.kv.hashing import make_hasher

__all__ = ["DecodeBurst", "Engine", "EngineStats", "RequestOutput", "StepResult"]


class Engine:
    """One simulated serving replica: `add_request`, `step`, `abort`, with vLLM-like counters."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        clock=None,
        *,
        on_event: Callable[[KVEvent], None] | None = None,
        record_tokens: bool = False,
        itl_sink: list[float] | None = None,
    ):
        from agentkv.engine.clock import VirtualClock

        self.config = cfg = config or EngineConfig()
        self.clock = clock or VirtualClock()
        self.record_tokens = record_tokens
        self.itl_sink = itl_sink  # when given, every inter-token gap is appended (for ITL percentiles)
        shape = get_model(cfg.model)
        self.model_shape = shape
        coeffs = load_coefficients(cfg.cost_profile) if cfg.cost_profile else None
        self.cost = CostModel(cfg.gpu, shape, coeffs=coeffs, **cfg.cost_kwargs())
        self.max_model_len = cfg.max_model_len or shape.max_position
        setup = make_pool(cfg, shape, self.cost, self.max_model_len, on_event)
        self.num_gpu_blocks = setup.num_gpu_blocks  # as vLLM reports it, null block included
        self.block_bytes = setup.block_bytes
        self.pool = setup.pool
        self.hybrid = isinstance(self.pool, HybridPool)
        self.max_seq_tokens = seq_token_capacity(self.pool)  # longer requests can never run here
        self.scheduler = Scheduler(cfg, self.pool)
        self.hasher = make_hasher(cfg.hash_algo, cfg.seed if cfg.hash_algo == "xxhash" else None)
        self.requests: dict[str, EngineRequest] = {}
        self.stats = EngineStats()
        # simulator fast path: steps where only the last running request prefills run without
        # touching the decoding ones, whose updates are applied later (`_Deferred`); same results
        self.defer_decodes = False
        self._deferred: _Deferred | None = None
        self.deferred_steps = 0  # steps run that way

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        *,
        max_tokens: int,
        prompt_len: int | None = None,
        token_ids: Sequence[int] | None = None,
        block_hashes: list[int] | None = None,
        cache_salt: str | None = None,
        session_id: object = None,
        user_data: object = None,
        arrival: float | None = None,
        hash_array: np.ndarray | None = None,
        external_tokens: int = 0,
    ) -> EngineRequest:
        """Queue a request: token ids (hashed here, salted per tenant) or a length with hashes.
        `external_tokens`: its first prompt tokens' KV was computed elsewhere and has arrived (the
        decode side of prefill/decode disaggregation): admission allocates them but computes none."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if token_ids is not None:
            prompt_len = len(token_ids)
            if block_hashes is None:
                block_hashes = self.hasher.hashes(token_ids, self.config.block_size, cache_salt=cache_salt)
        if prompt_len is None or prompt_len < 1:
            raise ValueError("a request needs a prompt of at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        now = self.clock.now() if arrival is None else arrival
        req = EngineRequest(
            request_id,
            prompt_len,
            max_tokens,
            block_hashes or [],
            now,
            session_id=session_id,
            token_ids=token_ids,
            record_tokens=self.record_tokens,
            user_data=user_data,
        )
        if not 0 <= external_tokens < prompt_len:
            raise ValueError(f"external_tokens must be in [0, prompt_len), got {external_tokens}")
        req.external_tokens = external_tokens
        if hash_array is not None and session_id is not None:
            req.hash_array = hash_array
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks (a client went away); False if unknown."""
        self.sync()
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, Status.ABORTED)
        req.finish_reason = "abort"
        req.finished_at = self.clock.now()
        self.stats.requests_aborted += 1
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> StepResult | None:
        """Schedule and 'run' one batch starting now; None when nothing can run."""
        if self.defer_decodes:
            res = self._deferred_step()
            if res is not None:
                return res
        now = self.clock.now()
        batch, preempted = self.scheduler.schedule(now)
        if not batch:
            return None
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        promote = 0.0
        n_prefill_tokens = 0
        for req, n in batch:
            nc, plen = req.num_computed, req.prompt_len
            if plen + req.num_output - nc > 1 or nc < plen:  # (req.is_prefill, inlined: a step's hot loop)
                prefills.append((n, nc))
                n_prefill_tokens += n
            else:
                decodes.append(nc)
            if req.promote_s:
                promote += req.promote_s
                req.promote_s = 0.0
        dt = self.cost.step_time(prefills, decodes) + promote
        end = now + dt
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.promote_s += promote
        outputs: list[RequestOutput] = []
        finished: list[EngineRequest] = []
        itl, max_len = self.itl_sink, self.max_model_len
        for req, n in batch:
            nc = req.num_computed = req.num_computed + n
            nt = req.prompt_len + req.num_output  # (req.num_tokens, inlined)
            if nc < nt:
                continue  # a chunk of a longer prefill: no token yet
            out = req.num_output = req.num_output + 1
            if req.first_token is None:
                req.first_token = end
            else:
                gap = end - req.last_token
                if gap > req.itl_max:
                    req.itl_max = gap
                if itl is not None and req.measured:
                    itl.append(gap)
            req.last_token = end
            if req.token_times is not None:
                req.token_times.append(end)
            done = out >= req.max_tokens or nt + 1 >= max_len
            if done:
                req.finish_reason = "length"
                req.finished_at = end
                finished.append(req)
            outputs.append(RequestOutput(req, 1, done))
        st.prompt_tokens += n_prefill_tokens
        st.generation_tokens += len(outputs)
        for req in finished:
            self._finish(req)
        return StepResult(now, end, outputs, n_prefill_tokens, len(decodes), len(preempted))

    def _finish(self, req: EngineRequest) -> None:
        """Free a finished request; its blocks become a lookup hint for requests sharing its prefix."""
        if req.hash_array is not None:  # set with a session id only (add_request)
            self.scheduler.hints.add(req.hash_array, self.pool.block_table(req.request_id))
        if req.block_ids is not None:  # a disaggregated prefill hands its block ids on (as vLLM's connector)
            table = self.pool.block_table(req.request_id)
            req.block_ids = [] if table is None else table.tolist()
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        self.stats.requests_finished += 1

    # -- decode bursts (simulator fast path) -----------------------------------------------------
    def plan_burst(self, max_steps: int = 1 << 20) -> DecodeBurst | None:
        """The coming run of pure-decode steps, when nothing else can change the batch before its
        first request finishes: every running one decoding, blocks for all of it free, and no waiting
        request that a step could admit meanwhile (`Scheduler.burst_room`). Steps are exactly those
        `step()` would run; None when that is not the case."""
        sched = self.scheduler
        if not sched.running or self._deferred is not None:  # (deferred: one request prefills)
            return None
        reqs = sched.running
        k = max_steps
        limit = self.max_model_len
        ctx_sum = ctx_max = 0
        bs = self.config.block_size
        slack: list[int] = []  # each request's free slots in its last block: it takes a new block
        for r in reversed(reqs):  # at steps slack+1, slack+1+bs, ... (the latest admitted first: the
            nc, nt = r.num_computed, r.num_tokens  # likeliest still in prefill, so no burst)
            if nt - nc != 1 or nc < r.prompt_len or r.promote_s:
                return None
            if r.max_tokens - r.num_output < k:
                k = r.max_tokens - r.num_output
            if limit - nt < k:
                k = limit - nt
            ctx_sum += nc
            if nc > ctx_max:
                ctx_max = nc
            slack.append(-nc % bs)
        free = self.pool.free_token_blocks if self.hybrid else self.pool.num_free_blocks
        need_k = sum([(k - s + bs - 1) // bs for s in slack if s < k])  # new blocks k steps take
        if sched.waiting:  # a burst past a queue the steps would not admit from (vLLM's too)
            room = sched.burst_room(need_k)
            if room is None:
                return None
            free = min(free, room)
        if need_k > free:  # the most steps whose new blocks fit: the step before the (free+1)-th
            rounds, i = divmod(free, len(slack))  # new block, the i-th of its round of len(slack)
            k = sorted(slack)[i] + rounds * bs
        if k < 2:
            return None
        now = self.clock.now()
        if sched.waiting:  # the ends `step()` would reach, to the last bit (bursts with nothing
            return DecodeBurst(now, self._step_ends(now, len(reqs), ctx_sum, ctx_max, k), list(reqs))
        durations = self.cost.decode_steps(len(reqs), ctx_sum, ctx_max, k)  # waiting keep their rounding)
        return DecodeBurst(now, (now + np.cumsum(durations)).tolist(), list(reqs))

    def _step_ends(self, now: float, n: int, ctx_sum: int, ctx_max: int, k: int) -> list[float]:
        """The end times of `k` decode-only steps of `n` requests, as `step()` computes each."""
        ends = self.cost.decode_step_ends(now, n, ctx_sum, ctx_max, k)  # the fitted formula's fast path
        if ends is not None:
            return ends
        agg, ends = self.cost.step_time_agg, []
        for i in range(k):
            now += agg(0, 0, 0.0, 0.0, False, 0, n, ctx_sum + i * n, ctx_max + i)
            ends.append(now)
        return ends

    def commit_burst(self, burst: DecodeBurst, steps: int) -> StepResult:
        """Apply the first `steps` steps of `burst` (as `steps` calls of `step()` would)."""
        ends = burst.ends[:steps]
        end = ends[-1]
        bs_gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        inner_max = max(bs_gaps, default=0.0)
        pool = self.pool
        outputs: list[RequestOutput] = []
        finished: list[EngineRequest] = []
        for req in burst.requests:
            if not pool.allocate_slots(req, steps, req.num_computed):
                raise RuntimeError("decode burst: blocks planned as free were not")  # plan_burst checked
            self._decoded(req, ends, bs_gaps, inner_max)
            if req.num_output >= req.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
                req.finished_at = end
                finished.append(req)
                outputs.append(RequestOutput(req, steps, True))
        st = self.stats
        st.steps += steps
        st.busy_s += end - burst.start
        st.generation_tokens += steps * len(burst.requests)
        for req in finished:
            self._finish(req)
        return StepResult(burst.start, end, outputs, 0, len(burst.requests), 0)

    def _decoded(self, req: EngineRequest, ends: list[float], gaps: list[float], top: float) -> None:
        """What decode steps ending at `ends` did to `req`, one token each: its token gaps (`gaps`
        between the steps, their largest `top`), counters and times (a burst's or deferred steps)."""
        first = ends[0] - req.last_token
        g = first if first > top else top
        if g > req.itl_max:
            req.itl_max = g
        if self.itl_sink is not None and req.measured:
            self.itl_sink.append(first)
            self.itl_sink.extend(gaps)
        if req.token_times is not None:
            req.token_times.extend(ends)
        req.num_computed += len(ends)
        req.num_output += len(ends)
        req.last_token = ends[-1]

    # -- deferred decodes (simulator fast path) ---------------------------------------------------
    def _deferred_step(self) -> StepResult | None:
        """One step as `step()` would run it while the running requests are decoders whose
        allocations change nothing this step, then one prefill whose chunk takes the rest of the
        token budget and leaves it still prefilling: only that chunk's allocation runs (after those
        of the decoders that reach a block boundary now, in the running order), and the decoders'
        token updates wait in `_Deferred`. None (all updates applied) when a step is not of that kind."""
        dd = self._deferred
        if dd is None:
            dd = self._deferred = self._defer_start()
            if dd is None:
                return None
        j, p, c = len(dd.ends), dd.prefill, dd.chunk
        if j >= dd.stop or p.num_tokens - p.num_computed <= c or p.promote_s:
            self.sync()  # a decoder finishes, or the prefill does: a step of `step()`'s own
            return None
        pool = self.pool
        due = sorted(dd.due.pop(j, ()))  # decoders at a block boundary now, in running order
        grows = [(dd.decoders[i], dd.ncs[i] + j + 1) for i in due]
        grows.append((p, p.num_computed + c))
        if not pool.surely_fits(grows):
            self.sync()  # room may run out: `step()` decides who is preempted
            return None
        for i in due:  # (their token updates still wait: an allocation reads only the count passed)
            d, nc = dd.decoders[i], dd.ncs[i] + j
            if not pool.allocate_slots(d, 1, nc):
                raise RuntimeError("deferred decodes: blocks checked as free were not")
            nxt = j + 1 + pool.quiet_decodes(d, nc + 1)
            if nxt < dd.stop:
                dd.due.setdefault(nxt, []).append(i)
        ncp = p.num_computed
        if not pool.allocate_slots(p, c, ncp):
            raise RuntimeError("deferred decodes: blocks checked as free were not")
        nd = len(dd.decoders)
        now = self.clock.now()
        # step()'s cost call, its sums formed the same way (the decoders' contexts each one more a step)
        dt = self.cost.step_time_agg(
            c,
            ncp,
            0.0 + c * (c + 1) * 0.5,
            0.0 + c * ncp,
            ncp > 0,
            1,
            nd,
            dd.ctx_sum + j * nd,
            dd.ctx_max + j,
        )
        end = now + dt
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.prompt_tokens += c
        st.generation_tokens += nd
        p.num_computed = ncp + c
        dd.ends.append(end)
        self.deferred_steps += 1
        return StepResult(now, end, [], c, nd, 0)

    def _defer_start(self) -> _Deferred | None:
        """The deferred state when the running requests are decoders and then one prefill that the
        next step leaves unfinished (None otherwise): each decoder's first step whose allocation is
        not a no-op, and the first step at which one finishes (the deferral ends before it)."""
        sched = self.scheduler
        running = sched.running
        if len(running) < 2 or sched._align:  # ('align': state groups cut chunks where states go)
            return None
        p = running[-1]
        nd = len(running) - 1
        c = self.config.max_num_batched_tokens - nd
        if c <= 0 or p.num_tokens - p.num_computed <= c or p.promote_s:
            return None
        decoders = running[:-1]
        limit, pool = self.max_model_len, self.pool
        ncs: list[int] = []
        stop = 1 << 62
        for d in decoders:
            nc, nt = d.num_computed, d.prompt_len + d.num_output
            if nt - nc != 1 or nc < d.prompt_len or d.promote_s:
                return None
            fin = min(d.max_tokens - d.num_output, limit - nt) - 1  # the step (from 0) it finishes in
            if fin < stop:
                stop = fin
                if stop < 1:
                    return None
            ncs.append(nc)
        due: dict[int, list[int]] = {}
        for i, k in enumerate(map(pool.quiet_decodes, decoders, ncs)):
            if k < stop:
                due.setdefault(k, []).append(i)
        return _Deferred(p, decoders, ncs, c, stop, due, sum(ncs), max(ncs))

    def _catch_up(self, dd: _Deferred, i: int) -> None:
        """Apply the deferred steps to decoder `i`: what `step()` did to it in each."""
        a, ends = dd.synced[i], dd.ends
        b = len(ends)
        if a == b:
            return
        if dd.gaps_from != a:  # the gaps between the steps from `a` on (shared by decoders synced alike)
            dd.gaps = [y - x for x, y in zip(ends[a:], ends[a + 1 :], strict=False)]
            dd.gaps_from, dd.gaps_to = a, b
        elif dd.gaps_to != b:
            dd.gaps += [y - x for x, y in zip(ends[dd.gaps_to - 1 :], ends[dd.gaps_to :], strict=False)]
            dd.gaps_to = b
        self._decoded(dd.decoders[i], ends[a:], dd.gaps, max(dd.gaps, default=0.0))
        dd.synced[i] = b

    def sync(self) -> None:
        """Apply every deferred decode (`defer_decodes`): the requests as `step()` alone leaves them."""
        dd = self._deferred
        if dd is None:
            return
        self._deferred = None
        for i in range(len(dd.decoders)):
            self._catch_up(dd, i)

    # -- the KV cache, as routers, the simulator and the server see it ---------------------------
    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """(GPU blocks, lower-tier blocks after them) of the prompt's leading run, found without a lookup."""
        return self.pool.cached_prefix(block_hashes)

    def cached_block_hashes(self) -> Iterable[int]:
        """The hashes the GPU prefix cache holds (a live view: do not keep it across steps)."""
        return self.pool.cached.keys()

    def session_paused(self, session_id: object, now: float, reason: str = "tool_use") -> None:
        """A hint for session-aware eviction: the session's request ended at `now`, waiting on `reason`."""
        self.pool.session_paused(session_id, now, reason)

    def session_resumed(self, session_id: object, now: float) -> None:
        """A hint for session-aware eviction: the session's next request arrived at `now`."""
        self.pool.session_resumed(session_id, now)

    # -- metrics -------------------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.pool.stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.pool.stats.hits

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks a new allocation can take: empty ones plus evictable cached ones."""
        return self.pool.num_free_blocks

    @property
    def active_blocks(self) -> int:
        """GPU blocks held by running requests."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def lower_tier_tokens(self) -> dict[str, int]:
        """Prompt tokens found below the GPU at first scheduling, by tier (a live dict: read only)."""
        return self.scheduler.lower_tier_tokens


class _Deferred:
    """Steps run by `Engine._deferred_step` since the decoders' last updates: the prefill, the
    decoders in running order with their computed tokens at the start, each one's steps applied
    (`synced`), the steps' end times, which steps reach a decoder's block boundary (`due`), and the
    step at which one finishes (`stop`)."""

    __slots__ = ("prefill", "decoders", "ncs", "chunk", "stop", "due", "ctx_sum", "ctx_max", "ends", "synced")
    __slots__ += ("gaps", "gaps_from", "gaps_to")

    def __init__(self, prefill, decoders, ncs, chunk, stop, due, ctx_sum, ctx_max) -> None:
        self.prefill, self.decoders, self.ncs, self.chunk = prefill, decoders, ncs, chunk
        self.stop, self.due, self.ctx_sum, self.ctx_max = stop, due, ctx_sum, ctx_max
        self.ends: list[float] = []
        self.synced = [0] * len(decoders)
        self.gaps: list[float] = []
        self.gaps_from = self.gaps_to = -1
