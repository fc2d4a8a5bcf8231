"""#61: every registered method's strategy through every path its combiner allows — plain under the default
robust bounds, central differential privacy, secure aggregation — or refused with the reason where it does
not (a non-linear combiner under DP or secure aggregation). The strategies are the hostile catalogue's
(tests/hostile.py), which follows the registry: a method added tomorrow is exercised here too."""

import numpy as np
import pytest
from flwr.app import ConfigRecord

from hostile import NODES, SPECS, configured_round, honest_payload, reply_to
from strategies.flite import FINGERPRINT_RECORD
from strategies.privacy import Privacy
from strategies.robust import Robustness
from strategies.secure_local import local_round
from strategies.secure_round import SecureSettings

DENSE = ("fp32", "int4")


def _dp() -> Privacy:
    return Privacy.from_config({"mode": "central", "clip": 0.05, "delta": 1e-5, "noise_multiplier": 0.5, "seed": 3},
                               rounds=2, sample_rate=1.0)


def _honest_round(strategy, spec) -> None:
    requests = configured_round(strategy, 1)
    strategy.aggregate_train(1, [reply_to(requests[n], honest_payload(spec, strategy, n, 1)) for n in NODES])


def _moved(strategy, before) -> float:
    return max(float(np.max(np.abs(strategy.global_state[k] - before[k]))) for k in before)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_plain_under_the_default_bounds(spec):
    strategy = spec.build(robustness=Robustness())
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    _honest_round(strategy, spec)
    record = strategy.round_record()
    assert record["accepted"] == len(NODES) and not record["refused"]
    assert _moved(strategy, before) > 0 and all(np.all(np.isfinite(v)) for v in strategy.global_state.values())


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_differential_privacy_releases_the_linear_mean_or_refuses_the_method(spec):
    if not (type(spec.build()).linear and spec.wire in DENSE):
        with pytest.raises(ValueError, match="differential privacy"):
            spec.build(privacy=_dp())
        return
    strategy = spec.build(privacy=_dp())
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    _honest_round(strategy, spec)
    assert strategy.release.released == 1 and strategy.round_record()["privacy"]["epsilon"] > 0
    assert _moved(strategy, before) > 0 and all(np.all(np.isfinite(v)) for v in strategy.global_state.values())


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_secure_aggregation_reaches_the_plain_mean_or_refuses_the_method(spec):
    settings = SecureSettings(bits=20, clip=0.5)
    if not (type(spec.build()).linear and spec.wire in DENSE):
        with pytest.raises(ValueError, match="secure aggregation"):
            spec.build(secure=settings)
        return
    strategy = spec.build(secure=settings)
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    rng = np.random.default_rng(0)
    updates = {n: {k: 0.01 * rng.standard_normal(shape) for k, shape in strategy.layout().items()} for n in NODES}
    records = {}
    if hasattr(strategy, "fingerprint"):  # FLITE's replies carry their parametrisation's fingerprint
        records[FINGERPRINT_RECORD] = ConfigRecord({"fingerprint": strategy.fingerprint})
    local_round(strategy, updates, records=records)
    assert strategy.round_record()["secure"]["uploaded"] == len(NODES) and not strategy.round_record()["refused"]
    if strategy.server_opt.plain and strategy.channel is None:  # the new state: the old + the mean update
        for key in before:
            mean = np.mean([u[key] for u in updates.values()], axis=0)
            np.testing.assert_allclose(strategy.global_state[key], before[key] + mean, atol=1e-5)
    else:
        assert _moved(strategy, before) > 0
