"""A secure round through a strategy, both ends in-process (strategies.secure_round): the mean of the
masked updates equals the plain mean of the same quantised updates; dropouts; hostile replies."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from strategies import codec
from strategies.flite import FINGERPRINT_RECORD, FliteStrategy
from strategies.secure_local import local_round
from strategies.secure_round import SecureSettings

STATE = {"a": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(5, np.float32)}
SETTINGS = SecureSettings(bits=16, clip=0.5)


def strategy(settings=SETTINGS, cls=None, **kw):
    if cls is FliteStrategy:
        return FliteStrategy(fingerprint="fp", initial_state={"z": np.zeros(20, np.float32)}, config_yaml="",
                             num_clients=4, secure=settings, **kw)
    from strategies.base import PayloadFedAvg

    return PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=4, secure=settings, uplink="delta", **kw)


def drive(strat, updates, **kw):
    """One secure round with in-process clients; the new global state."""
    local_round(strat, updates, **kw)
    return {k: v.copy() for k, v in strat.global_state.items()}


def plain_mean(strat, updates, nodes):
    """What a plain server would compute from the same quantised updates (uniform weights)."""
    fixed = strat.secure.fixed_point(len(updates))
    decoded = []
    for v in nodes:
        flat = np.concatenate([np.asarray(updates[v][k], np.float64).ravel() for k in sorted(updates[v])])
        levels, _ = fixed.encode(flat, np.random.default_rng(v))
        decoded.append(levels * fixed.step - fixed.clip)
    return np.mean(decoded, axis=0)


def updates_for(nodes, scale=0.1):
    return {v: {k: np.random.default_rng(v).normal(0, scale, s.shape) for k, s in STATE.items()} for v in nodes}


def flat(state, base=STATE):
    return np.concatenate([(state[k].astype(np.float64) - base[k]).ravel() for k in sorted(state)])


def test_the_secure_mean_is_the_plain_mean_of_the_quantised_updates():
    strat = strategy()
    updates = updates_for([3, 9, 14, 20])
    new = drive(strat, updates)
    np.testing.assert_allclose(flat(new), plain_mean(strat, updates, [3, 9, 14, 20]), atol=1e-6)
    record = strat.round_record()
    assert record["secure"]["uploaded"] == 4 and record["secure"]["modulus_bits"] == 18
    assert record["secure"]["out_of_range"] == 0  # honest uploads never sum outside the range
    clients = record["clients"]
    assert all(c["uplink_payload_bytes"] == 17 * 4 for c in clients.values())  # 17 values, uint32 residues
    assert all(c["secagg_uplink_bytes"] > 0 and c["secagg_downlink_bytes"] > 0 for c in clients.values())


@pytest.mark.parametrize("skip_upload, skip_unmask", [([9], []), ([9, 14], []), ([], [3]), ([], [3, 20])])
def test_dropouts_are_recovered_while_t_remain(skip_upload, skip_unmask):
    strat = strategy(SecureSettings(bits=16, clip=0.5))  # 5 clients: t = 3, a majority
    updates = updates_for([3, 9, 14, 20, 27])
    new = drive(strat, updates, skip_upload=skip_upload, skip_unmask=skip_unmask)
    uploaded = [v for v in (3, 9, 14, 20, 27) if v not in skip_upload]
    np.testing.assert_allclose(flat(new), plain_mean(strat, updates, uploaded), atol=1e-6)


def test_below_the_threshold_the_round_is_abandoned_and_the_state_unchanged():
    strat = strategy(SecureSettings(bits=16, clip=0.5, threshold=3))
    new = drive(strat, updates_for([3, 9, 14, 20]), skip_unmask=[3, 9])
    assert all(np.array_equal(new[k], STATE[k]) for k in STATE)
    assert "fewer than the threshold 3" in strat.round_record()["refused"][-1]["reason"]


def test_a_hostile_upload_is_refused_by_its_size_and_a_hostile_value_moves_the_mean_at_most_the_bound():
    strat = strategy()

    def oversize(replies):  # node 20 sends one value too many
        arrays = replies[-1].content["arrays"]
        a = arrays["a"]
        arrays["a"] = Array(dtype=a.dtype, shape=(13,), stype=a.stype, data=a.data + a.data[:4])

    new = drive(strat, updates_for([3, 9, 14, 20]), tamper=oversize)
    refused = strat.round_record()["refused"]
    assert refused and refused[0]["node_id"] == 20 and "must be postcard.secagg uint32 of shape (3, 4)" in \
        refused[0]["reason"]
    assert strat.round_record()["secure"]["uploaded"] == 3 and np.all(np.isfinite(flat(new)))

    strat = strategy()

    def huge(replies):  # node 20 replaces its residues with random ones: an arbitrary contribution
        arrays = replies[-1].content["arrays"]
        for key in list(arrays):
            a = arrays[key]
            values = np.random.default_rng(0).integers(0, 2**18, int(np.prod(a.shape)), dtype=np.uint32)
            arrays[key] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=values.tobytes())

    new = drive(strat, updates_for([3, 9, 14, 20]), tamper=huge)
    assert np.max(np.abs(flat(new))) <= strat.secure.fixed_point(4).mean_bound(4) + 1e-9  # = clip


def test_flite_checks_the_fingerprint_of_a_masked_reply_and_int4_masks_fit_in_a_byte():
    settings = SecureSettings.from_config({"enabled": True, "bits": None, "clip": 0.05}, "int4")
    assert settings.bits == 4 and settings.fixed_point(4).dtype == np.uint8
    strat = strategy(settings, cls=FliteStrategy)
    updates = {v: {"z": np.random.default_rng(v).normal(0, 0.01, 20)} for v in (1, 2, 3, 4)}
    good = {FINGERPRINT_RECORD: ConfigRecord({"fingerprint": "fp"})}
    drive(strat, updates, records=good)
    assert {c["uplink_payload_bytes"] for c in strat.round_record()["clients"].values()} == {20}  # one byte a latent
    assert not np.array_equal(strat.global_state["z"], np.zeros(20, np.float32))
    strat = strategy(settings, cls=FliteStrategy)
    drive(strat, updates, records={FINGERPRINT_RECORD: ConfigRecord({"fingerprint": "other"})})
    assert len(strat.round_record()["refused"]) >= 4 and "fingerprint" in strat.round_record()["refused"][0]["reason"]
    assert np.array_equal(strat.global_state["z"], np.zeros(20, np.float32))


def test_settings_and_plain_records():
    assert SecureSettings.from_config({"enabled": False}, "fp32") is None
    assert SecureSettings.from_config({"enabled": True, "bits": None, "clip": 0.1}, "fp32").bits == 16
    assert codec.payload_bytes(ArrayRecord()) == 0


def test_a_malformed_stage_reply_drops_its_node_and_a_node_refuses_weaker_settings():
    from flwr.app import Message, RecordDict

    from strategies.secagg import SecAggError
    from strategies.secure_client import client_keys, client_shares
    from strategies.secure_round import KEYS, RECORD

    strat = strategy(SecureSettings(bits=16, clip=0.5, threshold=2))
    train = [Message(RecordDict({"arrays": strat.downlink_arrays(), "config": ConfigRecord({})}), dst_node_id=v,
                     message_type="train") for v in (1, 2, 3)]
    msgs = strat.secure_stages.begin(1, train)
    assert [m.metadata.message_type for m in msgs] == [KEYS] * 3
    states = {v: RecordDict() for v in (1, 2, 3)}
    replies = [Message(client_keys(m, states[m.metadata.dst_node_id], strat.secure), reply_to=m) for m in msgs]
    replies[2].content[RECORD]["s-key"] = b"short"  # node 3's key is malformed
    shares = strat.secure_stages.keys(1, replies)
    assert sorted(m.metadata.dst_node_id for m in shares) == [1, 2]
    assert strat.secure_stages.round.dropped[3].startswith("keys: its s key must be 32 bytes")
    assert strat.round_record()["refused"][-1]["node_id"] == 3 and strat.round_record()["refused"][-1]["kind"] == "secagg"
    # a server asking node 1 for a threshold of 1 (shares that give the secret away) is refused
    shares[0].content[RECORD]["threshold"] = 1
    with pytest.raises(SecAggError, match="the server asks for threshold 1"):
        client_shares(1, shares[0], states[1], strat.secure)


class _Bounded:
    """A method's own bound on tensor 'b' (as FedNL bounds its memory), which a plain round checks per reply."""

    @staticmethod
    def make():
        from strategies.base import PayloadFedAvg

        class Bounded(PayloadFedAvg):
            def value_bounds(self, key):
                return 0.1 if key == "b" else None

        return Bounded(initial_state=STATE, config_yaml="", num_clients=3, secure=SETTINGS, uplink="delta")


def test_a_secure_mean_beyond_the_methods_bound_is_refused_and_an_honest_one_passes():
    """#61: under secure aggregation no single update can be checked, but the unmasked mean can: honest
    proposals inside a bound average inside it (up to one quantisation step); one client masking values
    beyond it moves the mean out, and the round is refused, the state unchanged (before: committed)."""
    honest = {v: {"a": np.zeros((3, 4)), "b": np.full(5, 0.05)} for v in (3, 9, 14)}
    strat = _Bounded.make()
    new = drive(strat, honest)
    np.testing.assert_allclose(new["b"], 0.05, atol=1e-4)
    hostile = {**honest, 14: {"a": np.zeros((3, 4)), "b": np.full(5, 0.5)}}
    strat = _Bounded.make()
    new = drive(strat, hostile)
    np.testing.assert_array_equal(new["b"], STATE["b"])
    refused = strat.round_record()["refused"]
    assert [r["kind"] for r in refused] == ["round"] and "beyond ±0.1" in refused[0]["reason"]
