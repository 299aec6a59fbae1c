"""The fit on a busy host's probes (synthetic samples from known coefficients, no engine): probes whose
samples scatter weigh less than those timed tightly, a gross outlier does not move the coefficients,
the cached-past setup comes from the pair's least samples, and a term no probe informs is held at
its default and said so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agentkv.calib import fit as F
from agentkv.calib.identify import fit_all
from agentkv.calib.plan import Probe, make_plan, samples, tiny_pair
from agentkv.engine.cost import load_coefficients
from tests.test_calibrate import TRUE  # the coefficients the serve test starts serve with

QWEN = F.Target("h100", "qwen2.5-7b")  # the recovery benchmark's target
OVERHEAD = (1e-3, 1e-7)
STRONG = ("gemm_eff", "attn_past_eff", "stream_gbps")
FIXTURES = Path(__file__).parent / "fixtures" / "calib"


def _sampled(seed: int) -> list[Probe]:
    """The 32K plan timed by the true model, `samples` per probe: 0.2 ms x Exp(1) of host delay on
    each prefill sample, 0.5% x N(0, 1) on each decode step."""
    rng = np.random.default_rng(seed)
    cm = QWEN.cost(TRUE)
    probes = make_plan(32768, 16, 8192, kv_tokens=400_000)
    for p in probes:
        v = F.predict(cm, QWEN, p, OVERHEAD)
        if p.family == "decode":
            p.samples_s = [v * (1 + 0.005 * rng.normal()) for _ in range(3)]
        elif p.family in F.FITTED:
            p.samples_s = [v + 2e-4 * rng.exponential() for _ in range(samples(p, 3))]
        p.settle()
    return probes


def _engine_error(f: F.Fit, probes: list[Probe], family: str) -> float:
    """Mean |error| (%) of the fitted engine against the true one on a family's probes, no overheads."""
    fit_cm, true_cm = QWEN.cost(f.coeffs), QWEN.cost(TRUE)
    errs = [
        abs(F.predict(fit_cm, QWEN, p) / F.predict(true_cm, QWEN, p) - 1) * 100
        for p in probes
        if p.family == family
    ]
    return sum(errs) / len(errs)


def test_a_probe_weighs_by_how_well_its_samples_agree() -> None:
    tight, loose = Probe("decode", n=1, ctx=1024), Probe("prefill_cold", new=16)
    tight.samples_s = [5.18e-3, 5.20e-3, 5.22e-3]
    loose.samples_s = [6e-3, 11e-3, 7e-3, 24e-3, 8e-3, 6.5e-3, 15e-3, 9e-3]
    assert F.weight(tight) == 1.0
    assert 0.0 < F.weight(loose) < 0.2
    one = Probe("decode", n=32, ctx=1024, samples_s=[54e-3])
    assert F.weight(one) == 1.0  # one sample cannot tell a spread
    # two can: a budget cuts the dearest probes to two, and a live run's pair, one of a busy moment,
    # had weighed fully at their mean (tests below)
    two = Probe("decode", n=32, ctx=1024, samples_s=[10.0e-3, 54.0e-3])
    assert 0.0 < F.weight(two) < 0.05
    agree = Probe("decode", n=32, ctx=1024, samples_s=[10.0e-3, 10.1e-3])
    assert F.weight(agree) == 1.0


def _stored(name: str) -> tuple[F.Target, list[Probe]]:
    """A stored run's probes (calibrate against serve started with TRUE, at load 12-17), settled."""
    doc = json.loads((FIXTURES / name).read_text())
    probes = [Probe(**x) for x in doc["probes"]]
    for p in probes:
        p.settle()
    return F.Target(**doc["modelled_as"]), probes


@pytest.mark.parametrize("name", ["serve-busy-decode.json", "serve-busy-pair.json"])
def test_a_busy_hosts_probes_fit_the_engine_serve_ran(name: str) -> None:
    """Two real calibrations of serve on the loaded 2-core host, whose small prefills carried 2-15 ms
    of host delay (samples spread 100-3,000%). Unweighted, the first fit `stream_gbps` +1,178% and
    missed the decode steps by 18% and the cached prefills by 26%; the second took the setup from
    the pair's medians (+112%). Now the fitted engine is within a few % of the true one."""
    t, probes = _stored(name)
    f = fit_all(t, probes)
    assert _engine_error(f, probes, "decode") < 3.0
    assert _engine_error(f, probes, "prefill_cached") < 8.0
    assert _engine_error(f, probes, "prefill_cold") < 8.0
    for n in STRONG:
        assert getattr(f.coeffs, n) == pytest.approx(getattr(TRUE, n), rel=0.1), n
    low = F.weights(probes)  # what the profile records: scattered prefills, no decode step under 0.5
    assert sum(k.startswith("prefill") and v < 0.5 for k, v in low.items()) >= 8, low
    assert all(v >= 0.5 for k, v in low.items() if k.startswith("decode")), low


def test_one_gross_outlier_probe_leaves_the_coefficients_within_ten_percent() -> None:
    """One probe measured 3x its time in every sample (a host stall through the whole probe): the
    robust loss weighs it linearly, and the rest keep the coefficients where they were."""
    probes = _sampled(4)
    bad = next(p for p in probes if p.label() == "prefill_cached new=1024 past=8192")
    bad.samples_s = [3 * s for s in bad.samples_s]
    bad.settle()
    f = fit_all(QWEN, probes)
    for name in (*STRONG, "overlap_k"):
        assert getattr(f.coeffs, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    assert abs(F.predict(QWEN.cost(f.coeffs), QWEN, bad, f.overhead) / bad.measured_s - 1) > 0.5


def test_the_setup_comes_from_the_pairs_least_samples_not_their_medians() -> None:
    """Half of the one-block cached prompt's samples 2-6 ms late (a busy host; its median then 3-4x
    the 1.4 ms setup above the cold prompt's, as in a run that fitted the setup +112%): the least of
    24 samples still carries only the setup."""
    probes = _sampled(5)
    cold, cached = tiny_pair(probes)
    rng = np.random.default_rng(5)
    cached.samples_s = [
        s + (rng.uniform(2e-3, 6e-3) if i % 2 else 0.0) for i, s in enumerate(cached.samples_s)
    ]
    cached.settle()
    assert cached.measured_s - cold.measured_s > 2 * 1.35e-3
    f = fit_all(QWEN, probes)
    assert f.coeffs.past_setup_s == pytest.approx(TRUE.past_setup_s, rel=0.1)


def test_a_term_no_probe_informs_is_held_at_its_default_and_named() -> None:
    """Without decode probes (a budget spent before them) nothing reads the per-stream KV rate: the
    fit keeps the bundled default rather than whatever the optimiser left, and says why."""
    probes = [p for p in _sampled(6) if p.family != "decode"]
    f = fit_all(QWEN, probes)
    default = load_coefficients()
    assert f.coeffs.stream_gbps == default.stream_gbps
    why = f.not_identifiable["stream_gbps"]
    assert "no probed step" in why and "is kept" in why, why
    for name in ("gemm_eff", "attn_past_eff"):  # what the prefills do inform is still fitted
        assert getattr(f.coeffs, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name


def _live(name: str) -> tuple[F.Target, list[Probe]]:
    """A stored live calibration of vLLM's CPU build (tiny Llama, its config.json beside it), settled."""
    doc = json.loads((FIXTURES / name).read_text())
    probes = [Probe(**x) for x in doc["probes"]]
    for p in probes:
        p.settle()
    return F.Target(**doc["modelled_as"] | {"model": str(FIXTURES / "tiny-llama")}), probes


@pytest.mark.parametrize("name", ["vllm-cpu-floor.json", "vllm-cpu-two-samples.json"])
def test_a_cpu_builds_decode_steps_are_fitted_as_measured(name: str) -> None:
    """Two real calibrations of the live vLLM CPU build whose fits missed the decode steps (decode MAPE
    33% and 31%; one-stream steps +86% and -42%): one put the prefills' 1.9 ms launch floor under every
    decode step, the other weighed two samples of a 32-stream probe (10 and 54 ms) fully at their mean;
    and with the copy roof at the catalogue GPU's no coefficient could read a batch's KV at a CPU's
    rate. One-stream steps, which bench's few lanes mostly run, now come back within 20% (their own
    samples spread 2.2-3.5 ms)."""
    t, probes = _live(name)
    f = fit_all(t, probes)
    mape = F.errors(t, probes, f.coeffs, f.overhead)
    assert mape["decode"] < 20.0, mape
    assert mape["prefill_cold"] < 25.0 and mape["prefill_cached"] < 10.0, mape
    cm = t.cost(f.coeffs)
    for p in (p for p in probes if p.family == "decode" and p.n == 1):
        assert abs(F.predict(cm, t, p) / p.measured_s - 1) < 0.2, (p.label(), p.samples_s)
    assert f.coeffs.copy_gbps < 100.0  # a CPU's KV rate, not the H200's 4,253 GB/s
    assert "copy_gbps" in f.free and "copy_gbps" not in f.not_identifiable


def test_a_gpus_copy_roof_stays_the_catalogues() -> None:
    """Where the catalogue's copy roof fits the probes (serve run with it), it is kept and held, so
    the single-stream KV rate and the launch floor are judged as before."""
    t, probes = _stored("serve-busy-decode.json")
    f = fit_all(t, probes)
    assert f.coeffs.copy_gbps == load_coefficients().copy_gbps
    assert "copy_gbps" not in f.free
