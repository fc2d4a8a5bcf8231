"""Secure aggregation's protocol (strategies.secagg): exact sums, dropout recovery, what the server sees."""

import numpy as np
import pytest
from Crypto.Protocol.SecretSharing import Shamir
from scipy.stats import chisquare

from strategies import secagg
from strategies.secagg import ClientSecrets, FixedPoint, SecAggError

ROUND = 3


def setup(nodes, threshold, with_digests=False):
    """Stages 1 and 2 for ``nodes``: secrets, public keys, commitments, shares held by each node
    (and the digests each dealer published: {dealer: {holder: digests}})."""
    secrets = {v: ClientSecrets.new() for v in nodes}
    public = {v: s.public_keys() for v, s in secrets.items()}
    commitments, held, digests = {}, {v: {} for v in nodes}, {}
    for owner in nodes:
        commitments[owner], out, digests[owner] = secagg.make_shares(owner, secrets[owner], public, threshold, ROUND)
        for holder, blob in out.items():
            held[holder][owner] = blob
    if with_digests:
        return secrets, public, commitments, held, digests
    return secrets, public, commitments, held


def run(nodes, values, fixed, threshold, *, upload, reveal_by, tamper=None):
    secrets, public, commitments, held, digests = setup(nodes, threshold, with_digests=True)
    rng = np.random.default_rng(0)
    masked = {v: secagg.mask(v, secrets[v], public, fixed.encode(values[v], rng)[0], fixed, ROUND) for v in upload}
    dropped = sorted(set(nodes) - set(upload))
    revealed = {v: secagg.reveal(v, secrets[v], held[v], public, upload, dropped, threshold, ROUND,
                                 {o: d[v] for o, d in digests.items()})
                for v in reveal_by}
    if tamper:
        tamper(revealed)
    liars = {}
    total = secagg.unmask(masked, public, commitments, revealed, fixed, threshold, ROUND, digests, liars=liars)
    run.liars = liars
    return masked, total


def test_the_unmasked_sum_is_the_plain_sum_of_the_levels_exactly():
    nodes = [11, 7, 42, 3]
    fixed = FixedPoint(bits=4, clip=1.0, num_clients=4)
    assert fixed.modulus_bits == 6 and fixed.dtype == np.uint8  # int4 values of 4 clients: 6 bits, one byte
    values = {v: np.random.default_rng(v).uniform(-1, 1, 1280) for v in nodes}
    secrets, public, commitments, held, digests = setup(nodes, 3, with_digests=True)
    levels = {v: fixed.encode(values[v], np.random.default_rng(v))[0] for v in nodes}
    masked = {v: secagg.mask(v, secrets[v], public, levels[v], fixed, ROUND) for v in nodes}
    assert all(m.dtype == np.uint8 and m.nbytes == 1280 for m in masked.values())  # 2x the int4 payload's 640
    revealed = {v: secagg.reveal(v, secrets[v], held[v], public, nodes, [], 3, ROUND) for v in nodes}
    total = secagg.unmask(masked, public, commitments, revealed, fixed, 3, ROUND, digests)
    np.testing.assert_array_equal(total, sum(levels.values()))
    # decoded: the mean of the values within half a step (stochastic rounding: unbiased, error < one step)
    mean = fixed.decode_sum(total, 4) / 4
    assert np.max(np.abs(mean - np.mean([values[v] for v in nodes], axis=0))) < fixed.step


@pytest.mark.parametrize("dropped", [[5], [5, 9]])
def test_clients_dropping_before_upload_are_recovered_when_t_remain(dropped):
    nodes = [1, 2, 5, 8, 9]
    fixed = FixedPoint(bits=16, clip=0.5, num_clients=5)
    values = {v: np.random.default_rng(v).normal(0, 0.1, 300) for v in nodes}
    upload = [v for v in nodes if v not in dropped]
    _, total = run(nodes, values, fixed, 3, upload=upload, reveal_by=upload)
    got = fixed.decode_sum(total, len(upload))
    np.testing.assert_allclose(got, np.sum([values[v] for v in upload], axis=0), atol=len(upload) * fixed.step)


def test_clients_dropping_after_upload_are_recovered_and_below_t_the_round_fails():
    nodes = [1, 2, 3, 4, 5]
    fixed = FixedPoint(bits=8, clip=1.0, num_clients=5)
    values = {v: np.full(10, 0.2 * v - 0.5) for v in nodes}
    # all five uploaded; two then vanish before revealing: three shares are enough
    _, total = run(nodes, values, fixed, 3, upload=nodes, reveal_by=[1, 3, 5])
    np.testing.assert_allclose(fixed.decode_sum(total, 5), np.sum([values[v] for v in nodes], axis=0),
                               atol=5 * fixed.step)
    with pytest.raises(SecAggError, match="fewer than the threshold 3"):
        run(nodes, values, fixed, 3, upload=nodes, reveal_by=[1, 3])
    with pytest.raises(SecAggError, match="fewer than the threshold 4"):  # a client refuses to help below t
        run(nodes, values, fixed, 4, upload=[1, 2, 3], reveal_by=[1, 2, 3])


def test_a_lying_holder_is_named_and_set_aside_and_a_forged_ciphertext_refused():
    nodes = [1, 2, 3, 4, 5]
    fixed = FixedPoint(bits=4, clip=1.0, num_clients=5)
    values = {v: np.zeros(8) for v in nodes}

    def corrupt(revealed):  # node 2 lies about its share of node 1's seed
        kind, index, share = revealed[2][1]
        revealed[2][1] = (kind, index, bytes(16))

    _, total = run(nodes, values, fixed, 3, upload=nodes, reveal_by=nodes, tamper=corrupt)
    np.testing.assert_allclose(fixed.decode_sum(total, 5), 0, atol=5 * fixed.step)
    assert list(run.liars) == [2] and "not the one node 1 dealt it" in run.liars[2]
    secrets, public, _, held = setup(nodes, 3)
    forged = bytearray(held[2][1])
    forged[-1] ^= 1
    with pytest.raises(SecAggError, match="does not authenticate"):
        secagg.open_share(2, secrets[2], 1, public, bytes(forged), ROUND)
    with pytest.raises(SecAggError, match="named both uploaded and dropped"):
        secagg.reveal(2, secrets[2], held[2], public, [1, 2, 3], [3], 3, ROUND)


def test_a_masked_upload_looks_uniform_to_the_server():
    nodes = [1, 2, 3]
    fixed = FixedPoint(bits=4, clip=1.0, num_clients=3)  # 6-bit residues in uint8
    # fixed keys and seed, so the test is deterministic (fresh keys would fail a 1e-4 test once in 10,000 runs);
    # any 32 bytes are an X25519 private key
    secrets = {v: ClientSecrets(bytes([v]) * 32, bytes([v + 10]) * 32, bytes([v + 20]) * 32) for v in nodes}
    public = {v: s.public_keys() for v, s in secrets.items()}
    levels = np.zeros(64 * 500, np.uint64)  # the most structured input there is
    masked = secagg.mask(1, secrets[1], public, levels, fixed, ROUND)
    counts = np.bincount(masked, minlength=64)
    assert len(counts) == 64
    assert chisquare(counts).pvalue > 1e-3
    alone = secagg.mask(1, ClientSecrets(bytes(32), bytes(32), bytes(32)), {1: public[1]}, levels, fixed,
                        ROUND)  # alone: only its self mask, still uniform
    assert chisquare(np.bincount(alone, minlength=64)).pvalue > 1e-3


def test_fewer_than_t_shares_reveal_nothing():
    secret = bytes(range(16))
    pieces = Shamir.split(3, 5, secret)
    assert Shamir.combine(pieces[:3]) == secret
    assert Shamir.combine(pieces[:2]) != secret  # two of three: some other secret entirely
    # the shares themselves are uniform bytes, whatever the secret
    first_bytes = [Shamir.split(3, 5, bytes(16))[0][1][0] for _ in range(2000)]
    # fresh randomness each run: a 1e-6 level keeps a false alarm to one run in a million
    assert chisquare(np.bincount(first_bytes, minlength=256)).pvalue > 1e-6


def test_fixed_point_bounds_any_reply():
    fixed = FixedPoint(bits=4, clip=0.5, num_clients=4)
    levels, clipped = fixed.encode(np.array([-2.0, -0.5, 0.0, 0.5, 3.0]), np.random.default_rng(0))
    assert clipped == 2 and levels.min() >= 0 and levels.max() <= 15
    residues = np.arange(fixed.modulus, dtype=np.uint64)  # every residue four uploads can sum to
    total, outside = fixed.clamp_sum(residues, 4)
    assert outside == fixed.modulus - 1 - 4 * fixed.levels  # 61..63: no four honest uploads give them
    worst = fixed.decode_sum(total, 4) / 4  # any residue decodes inside the honest range
    assert np.all(np.abs(worst) <= fixed.mean_bound(4) + 1e-12) and fixed.mean_bound(4) == fixed.clip
    with pytest.raises(SecAggError, match="1..24 bits"):
        FixedPoint(bits=25, clip=1.0, num_clients=4)
    with pytest.raises(SecAggError, match="1..255 clients"):
        FixedPoint(bits=4, clip=1.0, num_clients=256)
    with pytest.raises(SecAggError, match="NaN"):
        fixed.encode(np.array([np.nan]), np.random.default_rng(0))


def test_a_client_that_wraps_its_residues_around_the_modulus_cannot_leave_the_honest_range():
    """#62 finding 7: five clients (k = 4 + 3 bits: 128 residues, 75 honest); a hostile one picks its residue so
    that the sum wraps. Before the clamp the decoded mean reached 2.4x clip; now it stays within clip, and the
    out-of-range values are counted (a sign that some client cheated)."""
    fixed = FixedPoint(bits=4, clip=1.0, num_clients=5)
    rng = np.random.default_rng(0)
    honest = [fixed.encode(rng.uniform(-0.2, 0.2, 1000), rng)[0] for _ in range(4)]
    wrap = (np.uint64(fixed.modulus - 1) - np.sum(honest, axis=0)) % np.uint64(fixed.modulus)  # sum -> 2^k - 1
    total = (np.sum(honest, axis=0) + wrap) % np.uint64(fixed.modulus)
    assert np.all(fixed.decode_sum(total, 5) / 5 > 2.3 * fixed.clip)  # what the sum decodes to unclamped
    clamped, outside = fixed.clamp_sum(total, 5)
    assert outside == 1000
    assert np.all(np.abs(fixed.decode_sum(clamped, 5) / 5) <= fixed.clip + 1e-12)
