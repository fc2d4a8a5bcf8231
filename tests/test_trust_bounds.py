"""Issue #39's findings 3, 5, 6, 7 and 9: ε from the sampling that happened, nothing per client
in clear in a private run, one hostile client of four moves the state less than the honest
step by default, metric records bounded, the server's accounting out of a client's reach."""

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapps.config import compose
from strategies import codec
from strategies.base import PayloadFedAvg
from strategies.privacy import Privacy, epsilon_spent
from strategies.robust import Robustness

D = 400


class Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return self.nodes


def push(messages):
    for i, msg in enumerate(messages):
        msg.metadata.__dict__["_message_id"] = f"m{i}"  # what the grid does when it pushes them
    return {int(m.metadata.dst_node_id): m for m in messages}


def reply(request, values=None, **metrics):
    content = RecordDict({"metrics": MetricRecord({"num-examples": 10, **metrics})})
    if values is not None:
        content["arrays"] = codec.encode({"w": np.asarray(values, np.float32)})
    return Message(content, reply_to=request)


def strategy(clients=4, **kw):
    return PayloadFedAvg(initial_state={"w": np.zeros(D, np.float32)}, config_yaml="a: 1\n", num_clients=clients,
                         uplink="delta", **kw)


def round_of(strat, per_node, server_round=1):
    """One training round: {node: (update, metrics)} answered to the strategy's own messages."""
    requests = push(strat.configure_train(server_round, ArrayRecord(), ConfigRecord(), Grid(per_node)))
    replies = [reply(requests[v], u, **m) for v, (u, m) in per_node.items()]
    return strat.aggregate_train(server_round, replies)


# ---------------------------------------------------------------------- finding 3: ε
def test_epsilon_is_accounted_at_the_rate_rounds_really_sample():
    """The accountant assumes Poisson sampling at q; with privacy on, rounds sample so (#63: Flower's
    fixed-size sampling was accounted as Poisson before): q = fraction_train whatever min_clients says,
    each node kept on its own with probability q, the count a round trains varies around q·N, and ε is
    the accountant's at q."""
    from fedapps.privacy import sample_rate, settings_of

    cfg = compose(["privacy.mode=central", "privacy.epsilon=8", "rounds=10", "num_clients=10",
                   "strategy.fraction_train=0.5"], preset="test")
    assert sample_rate(cfg) == 0.5
    settings = settings_of(cfg)
    assert settings.poisson and settings.epsilon(10) == pytest.approx(8.0, rel=1e-3)  # calibrated for q = 0.5
    cfg.strategy.min_clients = 8  # a quorum, not a sample size, under Poisson sampling
    assert sample_rate(cfg) == 0.5
    cfg.strategy.fraction_train = 1.0  # every node every round: no sampling to amplify
    assert sample_rate(cfg) == 1.0

    planned = Privacy(mode="central", clip=0.1, delta=1e-5, noise_multiplier=1.0, rounds=200, sample_rate=0.1,
                      seed=7)
    strat = PayloadFedAvg(initial_state={"w": np.zeros(D, np.float32)}, config_yaml="a: 1\n", num_clients=1000,
                          uplink="delta", privacy=planned, fraction_train=0.1)
    grid = Grid(range(1, 1001))
    counts, seen = [], np.zeros(1001)
    for r in range(1, 201):
        chosen = [int(m.metadata.dst_node_id) for m in strat.configure_train(r, ArrayRecord(), ConfigRecord(), grid)]
        counts.append(len(chosen))
        seen[chosen] += 1
    assert 95 < np.mean(counts) < 105 and np.std(counts) > 5  # Binomial(1000, 0.1): mean 100, sd 9.5
    assert 0.095 < seen[1:].mean() / 200 < 0.105 and seen[1:].min() > 0  # every node about q of the rounds
    # a private round's record: ε at the rate the rounds sample, whatever the count that round
    one = PayloadFedAvg(initial_state={"w": np.zeros(D, np.float32)}, config_yaml="a: 1\n", num_clients=4,
                        uplink="delta", privacy=Privacy(mode="central", clip=0.1, delta=1e-5, noise_multiplier=1.0,
                                                        rounds=10, sample_rate=0.5, seed=3))
    requests = push(one.configure_train(1, ArrayRecord(), ConfigRecord(), Grid([1, 2, 3, 4])))
    one.aggregate_train(1, [reply(requests[v], np.full(D, 0.01)) for v in requests])
    record = one.history[-1] if one.history else one.round_record()
    assert record["privacy"]["sample_rate"] == 0.5
    assert record["privacy"]["epsilon"] == pytest.approx(epsilon_spent(1.0, 0.5, 1, 1e-5))


# ---------------------------------------------------------------------- finding 5: private runs
@pytest.mark.parametrize("private", [dict(privacy=Privacy(mode="local", clip=1.0, delta=1e-5, noise_multiplier=1.0,
                                                          rounds=3, sample_rate=1.0)), dict()])
def test_a_private_run_keeps_no_client_metric_per_client(private):
    strat = strategy(**private)
    round_of(strat, {v: (np.full(D, 0.01 * v), {"loss": 1.0 + v, "dp-norm": 3.0 * v}) for v in (1, 2, 3, 4)})
    clients = strat.round_record()["clients"]
    kept = {k for c in clients.values() for k in c if k.startswith("train_")}
    requests = push(strat.configure_evaluate(1, ArrayRecord(), ConfigRecord(), Grid([1, 2, 3, 4])))
    aggregated = strat.aggregate_evaluate(1, [reply(requests[v], perplexity=20.0 + v) for v in (1, 2, 3, 4)])
    record = strat.history[-1]
    per_client_eval = {k for c in record["clients"] for k in c if k.startswith("eval_") and "bytes" not in k}
    assert aggregated["perplexity"] == pytest.approx(22.5)  # the aggregate is kept either way
    if private:
        assert kept - {"train_downlink_payload_bytes", "train_downlink_message_bytes"} == set()
        assert per_client_eval == set()
    else:
        assert {"train_loss", "train_dp-norm"} <= kept and "eval_perplexity" in per_client_eval


def test_a_private_client_sends_nothing_but_its_update_and_one_example():
    """The real ClientApp, local DP on the tiny model: the reply's metrics are num-examples = 1."""
    from fedapps import registry
    from fedapps.config import to_yaml
    from inprocess import context, train_round

    cfg = compose(["privacy.mode=local", "privacy.noise_multiplier=0.5", "train.local_steps=1"], preset="test")
    strat = registry.get(cfg.algorithm.name).plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    replies = train_round(cfg, strat, 1, {1: context(1), 2: context(2)})
    assert [dict(r.content["metrics"]) for r in replies] == [{"num-examples": 1}] * 2


# ---------------------------------------------------------------------- finding 6: bounded influence
@pytest.mark.parametrize("attack", ["sign-flip", "orthogonal"])
def test_by_default_one_hostile_client_of_four_moves_the_state_less_than_the_honest_step(attack, caplog):
    rng = np.random.default_rng(0)
    common = rng.normal(size=D)
    honest = {v: common + rng.normal(size=D) for v in (1, 2, 3)}
    counts = {1: 900, 2: 1000, 3: 1100}
    clean = strategy(clients=3, robustness=Robustness())
    requests = push(clean.configure_train(1, ArrayRecord(), ConfigRecord(), Grid([1, 2, 3])))
    clean.aggregate_train(1, [reply(requests[v], honest[v] * 1e-3, **{"num-examples": counts[v]}) for v in honest])
    step = clean.global_state["w"].astype(np.float64)
    if attack == "sign-flip":
        hostile = -1e5 * step
    else:
        hostile = rng.normal(size=D)
        hostile = 1e3 * (hostile - hostile @ step / (step @ step) * step)  # within max_abs: bounded, not refused
    attacked = strategy()  # the defaults: robust=default
    requests = push(attacked.configure_train(1, ArrayRecord(), ConfigRecord(), Grid([1, 2, 3, 4])))
    replies = [reply(requests[v], honest[v] * 1e-3, **{"num-examples": counts[v]}) for v in honest]
    replies.append(reply(requests[4], hostile, **{"num-examples": 10**18}))
    caplog.clear()
    attacked.aggregate_train(1, replies)
    moved = attacked.global_state["w"].astype(np.float64)
    assert np.linalg.norm(moved - step) < np.linalg.norm(step)  # with 10 / 100 it was 17x
    kinds = {b["kind"] for b in attacked.round_record()["bounded"] if b["node_id"] == 4}
    assert kinds == {"examples-capped", "norm-clipped", "center-clipped"}
    # far outside its bound: the round's one line on its bounded replies is a WARNING naming it
    (line,) = [r for r in caplog.records if "replies bounded" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "far outside the bound (hostile-looking): node 4: num-examples 1000000000000000000 counted as " \
        in line.getMessage()


def test_honest_clients_whose_counts_differ_log_one_info_line_a_round_and_no_warning(caplog):
    """#60: the default bounds act on honest replies in most rounds (every count above the lower median
    is capped); that was a WARNING per client per round ("num-examples 360 counted as 214"). Now one
    INFO line for the round, and each reply's detail still in the round's record (metrics.jsonl)."""
    rng = np.random.default_rng(1)
    common = rng.normal(size=D)
    counts = {1: 360, 2: 214, 3: 150, 4: 500, 5: 214}
    sizes = {1: 1.0, 2: 0.8, 3: 1.2, 4: 2.5, 5: 0.9}  # node 4's update: 2.5 / 1.5 = 1.7x the clip bound
    strat = strategy(clients=5)  # the defaults: robust=default
    with caplog.at_level(logging.INFO, logger="flwr"):
        round_of(strat, {v: (sizes[v] * 1e-3 * (common + 0.1 * rng.normal(size=D)), {"num-examples": c})
                         for v, c in counts.items()})
    lines = [r for r in caplog.records if "bounded" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert message.startswith("round 1: 3 of 5 replies bounded: example counts capped at 214 (2), "
                              "update norms clipped to 1.5x the lower median, "), message
    assert ", distances from the median update clipped to 1x their lower median, " in message
    assert message.endswith(" (2)")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    bounded = strat.round_record()["bounded"]
    assert [(b["node_id"], b["kind"]) for b in bounded] == [(1, "examples-capped"), (4, "examples-capped"),
                                                           (4, "norm-clipped"), (2, "center-clipped"),
                                                           (4, "center-clipped")]
    assert bounded[0]["detail"] == "num-examples 360 counted as 214"


def test_an_evaluation_claim_of_many_examples_does_not_set_the_metric():
    strat = strategy()
    requests = push(strat.configure_evaluate(1, ArrayRecord(), ConfigRecord(), Grid([1, 2, 3, 4])))
    replies = [reply(requests[v], perplexity=20.0) for v in (1, 2, 3)]
    replies.append(reply(requests[4], perplexity=1.0, **{"num-examples": 10**18}))
    aggregated = strat.aggregate_evaluate(1, replies)
    assert aggregated["perplexity"] == pytest.approx((3 * 20.0 + 1.0) / 4)  # one vote, not 10^17


# ---------------------------------------------------------------------- finding 7: metric records
@pytest.mark.parametrize("metrics, why", [
    ({f"m{i}": 1.0 for i in range(10**4)}, "keys, more than 64"),
    ({"x" * 65: 1.0}, "longer than 64 characters"),
    ({f"l{i}": [1.0] * 4000 for i in range(3)}, "numbers, more than 8192"),
])
def test_a_huge_metric_record_is_refused_in_one_line(metrics, why):
    strat = strategy(clients=2)
    round_of(strat, {1: (np.full(D, 0.01), {}), 2: (np.full(D, 0.02), metrics)})
    refused = strat.round_record()["refused"]
    assert [(r["node_id"], r["kind"]) for r in refused] == [(2, "metrics")] and why in refused[0]["reason"]
    assert "\n" not in refused[0]["reason"] and len(refused[0]["reason"]) < 200


def test_one_clients_list_does_not_hide_a_metric_from_everyone():
    strat = strategy(clients=3)
    _, metrics = round_of(strat, {1: (np.full(D, 0.01), {"loss": 2.0}), 2: (np.full(D, 0.01), {"loss": 4.0}),
                                  3: (np.full(D, 0.01), {"loss": [9.0, 9.0]})})
    assert metrics["loss"] == pytest.approx(3.0)


# ---------------------------------------------------------------------- finding 9: the server's own fields
def test_a_client_metric_cannot_overwrite_the_servers_byte_accounting():
    strat = strategy(clients=2)
    round_of(strat, {1: (np.full(D, 0.01), {"downlink_payload_bytes": 1.0}), 2: (np.full(D, 0.01), {})})
    clients = strat.round_record()["clients"]
    assert clients["1"]["train_downlink_payload_bytes"] == clients["2"]["train_downlink_payload_bytes"] == 4 * D


def test_a_central_dp_server_records_the_norm_it_sees_and_nothing_the_client_reports():
    """bench/privacy.py calibrates its clip from these (clients no longer report their norm)."""
    central = Privacy(mode="central", clip=1e9, delta=1e-5, noise_multiplier=1e-9, rounds=1, sample_rate=1.0, seed=0)
    strat = strategy(clients=2, privacy=central)
    round_of(strat, {1: (np.full(D, 0.1), {"loss": 1.0}), 2: (np.full(D, 0.2), {"loss": 2.0})})
    norms = {c["node_id"]: c["update_norm"] for c in strat.round_record()["clients"].values()}
    assert norms == pytest.approx({1: 0.1 * D ** 0.5, 2: 0.2 * D ** 0.5})
    assert not [k for c in strat.round_record()["clients"].values() for k in c if k == "train_loss"]


def test_fraction_train_samples_what_flowers_fedavg_samples_with_100_clients():
    """#60: with 100 clients and fraction_train=0.1 every round sampled all 100 (min_clients: null meant all);
    as Flower's FedAvg, a round samples max(⌊N·fraction⌋, minimum) = 10, a different 10 each round."""
    cfg = compose(["num_clients=100", "strategy.fraction_train=0.1", "strategy.fraction_evaluate=0.05"], preset="test")
    from fedapps.method import strategy_settings

    kw = {k: v for k, v in strategy_settings(cfg, config_yaml="a: 1\n", on_round_end=None).items() if k in
          ("num_clients", "min_clients", "fraction_train", "fraction_evaluate")}
    strat = PayloadFedAvg(initial_state={"w": np.zeros(D, np.float32)}, config_yaml="a: 1\n", uplink="delta", **kw)
    grid = Grid(range(1, 101))
    first = push(strat.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    second = push(strat.configure_train(2, ArrayRecord(), ConfigRecord(), grid))
    assert len(first) == len(second) == 10 and set(first) != set(second)
    assert len(strat.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid)) == 5
    # a fraction whose count falls below the minimum: Flower's 2 by default, or min_clients
    few = PayloadFedAvg(initial_state={"w": np.zeros(D, np.float32)}, config_yaml="a: 1\n", uplink="delta",
                        num_clients=10, fraction_train=0.01)
    assert len(few.configure_train(1, ArrayRecord(), ConfigRecord(), Grid(range(1, 11)))) == 2
    with pytest.raises(Exception, match=r"strategy.fraction_train must be a number in \(0, 1\]"):
        compose(["strategy.fraction_train=0"], preset="test")
    with pytest.raises(Exception, match=r"strategy.min_clients must be null or an integer in 1..num_clients \(2\)"):
        compose(["strategy.min_clients=3"], preset="test")
