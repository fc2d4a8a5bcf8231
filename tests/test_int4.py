"""int4 latent wire format: sizes, error bound, edge cases, and the codec path."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from strategies import codec
from strategies.int4 import int4_nbytes, int4_roundtrip, int4_step, pack_int4, unpack_int4


def latents(n: int, seed: int = 0, std: float = 0.3) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=n) * std).astype(np.float32)


def assert_within_half_step(x: np.ndarray, y: np.ndarray) -> None:
    step = int4_step(x)
    # Half a step, plus the rounding of the fp32 result (a few ulps of the largest value).
    slack = 4 * np.finfo(np.float32).eps * float(np.abs(x).max(initial=0.0))
    assert float(np.abs(x - y).max(initial=0.0)) <= step / 2 + slack


def test_1280_latents_take_648_bytes_and_round_trip_within_half_a_step():
    x = latents(1280)
    data = pack_int4(x)
    assert len(data) == 648 == int4_nbytes(1280) == 640 + 8
    y = unpack_int4(data, 1280)
    assert y.dtype == np.float32 and y.shape == (1280,)
    assert_within_half_step(x, y)
    # The extremes are levels 0 and 15; the minimum is the zero point, exactly.
    assert y.min() == x.min()
    assert abs(float(y.max()) - float(x.max())) <= 1e-6 * abs(float(x.max()))
    # 16 levels at most, evenly spaced by the step.
    levels = np.unique(y)
    assert len(levels) <= 16
    scale, zero = struct.unpack("<ff", data[-8:])
    assert scale == pytest.approx(int4_step(x)) and zero == x.min()
    np.testing.assert_allclose(np.diff(levels) / scale, np.round(np.diff(levels) / scale), atol=1e-4)


def test_error_bound_holds_across_many_random_vectors():
    rng = np.random.default_rng(1)
    for trial in range(50):
        n = int(rng.integers(1, 300))
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 3) + rng.uniform(-5, 5)).astype(np.float32)
        y = unpack_int4(pack_int4(x), n)
        assert_within_half_step(x, y)
        np.testing.assert_array_equal(int4_roundtrip(x), y)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    x = latents(1280, seed=4)
    step = int4_step(x)
    rng = np.random.default_rng(0)
    decoded = np.stack([unpack_int4(pack_int4(x, rng=rng), 1280) for _ in range(400)])
    assert len(pack_int4(x, rng=rng)) == 648
    assert float(np.abs(decoded - x).max()) < step * (1 + 1e-6)
    # Each mean of 400 draws is within ~4 standard errors (<= step/2/sqrt(400)) of x.
    assert float(np.abs(decoded.mean(0) - x).max()) < 4 * (step / 2) / np.sqrt(400) + 1e-7
    # Round to nearest is biased on the same values; stochastic rounding is not.
    nearest = unpack_int4(pack_int4(x), 1280)
    assert float(np.abs(decoded.mean(0) - x).mean()) < 0.5 * float(np.abs(nearest - x).mean())
    np.testing.assert_array_equal(unpack_int4(pack_int4(np.full(5, 2.0, np.float32), rng=rng), 5), 2.0)


def test_nibbles_are_packed_low_first():
    x = np.arange(16, dtype=np.float32)  # min 0, max 15: scale 1, levels = values
    data = pack_int4(x)
    assert data[:8] == bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    assert struct.unpack("<ff", data[8:]) == (1.0, 0.0)
    np.testing.assert_array_equal(unpack_int4(data, 16), x)


@pytest.mark.parametrize("n", [1, 3, 5, 1279])
def test_odd_lengths(n):
    x = latents(n, seed=n)
    data = pack_int4(x)
    assert len(data) == (n + 1) // 2 + 8
    assert data[(n - 1) // 2] >> 4 == 0  # the padding nibble is zero
    y = unpack_int4(data, n)
    assert y.shape == (n,)
    assert_within_half_step(x, y)


@pytest.mark.parametrize("value", [0.0, -2.5, 1e-30, 3.0e38])
@pytest.mark.parametrize("n", [1, 2, 7, 1280])
def test_constant_tensors_round_trip_exactly(value, n):
    x = np.full(n, value, dtype=np.float32)
    data = pack_int4(x)
    assert int4_step(x) == 0.0
    np.testing.assert_array_equal(unpack_int4(data, n), x)


def test_empty_vector():
    data = pack_int4(np.zeros(0, dtype=np.float32))
    assert len(data) == 8
    assert unpack_int4(data, 0).shape == (0,)


def test_extreme_range_stays_finite():
    x = np.array([-3.4e38, 0.0, 3.4e38], dtype=np.float32)
    y = unpack_int4(pack_int4(x), 3)
    assert np.all(np.isfinite(y))
    assert_within_half_step(x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected(bad):
    x = latents(10)
    x[3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        pack_int4(x)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="1-D"):
        pack_int4(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="numbers"):
        pack_int4(np.array(["a", "b"]))
    data = pack_int4(latents(1280))
    for wrong in (data[:-1], data + b"\x00", data[:100]):
        with pytest.raises(ValueError, match=r"must be 648 bytes, got \d+"):
            unpack_int4(wrong, 1280)
    with pytest.raises(ValueError, match="must be 8 bytes, got 648"):
        unpack_int4(data, 0)
    with pytest.raises(ValueError, match="numel"):
        unpack_int4(data, -1)


def test_corrupt_trailers_and_padding_are_rejected():
    body = pack_int4(latents(7))[:-8]
    for scale, zero in ((float("nan"), 0.0), (1.0, float("inf")), (-1.0, 0.0)):
        with pytest.raises(ValueError, match="scale"):
            unpack_int4(body + struct.pack("<ff", scale, zero), 7)
    padded = bytearray(pack_int4(latents(7)))
    padded[3] |= 0xF0  # the high nibble of the last byte is padding for 7 values
    with pytest.raises(ValueError, match="padding"):
        unpack_int4(bytes(padded), 7)


def test_through_the_codec():
    payload = {"z": latents(1280), "odd": latents(5, seed=2), "flat": np.full(4, 0.25, dtype=np.float32)}
    record = codec.encode(payload, "int4")
    assert codec.payload_bytes(record) == 648 + (3 + 8) + (2 + 8)
    decoded = codec.decode(record)
    assert set(decoded) == set(payload)
    for name, x in payload.items():
        assert decoded[name].shape == x.shape and decoded[name].dtype == np.float32
        assert_within_half_step(x, decoded[name])
    np.testing.assert_array_equal(decoded["flat"], payload["flat"])
    # fp32 stays exact; int4 is 7.9x smaller for 1,280 latents.
    fp32 = codec.encode({"z": payload["z"]}, "fp32")
    assert codec.payload_bytes(fp32) == 5120
    np.testing.assert_array_equal(codec.decode(fp32)["z"], payload["z"])


def test_codec_refuses_bad_int4_payloads():
    with pytest.raises(codec.PayloadError, match="NaN or Inf"):
        codec.encode({"z": np.array([1.0, np.nan], dtype=np.float32)}, "int4")
    record = codec.encode({"z": latents(1280)}, "int4")
    good = record["z"]
    from flwr.app import Array, ArrayRecord

    short = ArrayRecord()
    short["z"] = Array(dtype="float32", shape=(1280,), stype=codec.INT4, data=good.data[:-1])
    with pytest.raises(codec.PayloadError, match="carries 647 bytes, expected 648"):
        codec.decode(short)
    corrupt = ArrayRecord()
    corrupt["z"] = Array(dtype="float32", shape=(1280,), stype=codec.INT4,
                         data=good.data[:-8] + struct.pack("<ff", -1.0, 0.0))
    with pytest.raises(ValueError, match="scale"):
        codec.decode(corrupt)


# ---------------------------------------------------------------- block-wise int4 (int4b)
from strategies.int4 import BLOCK, int4_blocks_nbytes, pack_int4_blocks, unpack_int4_blocks  # noqa: E402


def test_block_wise_int4_sizes_and_per_block_error_bound():
    assert BLOCK == 64 and int4_blocks_nbytes(1280) == 640 + 20 * 8 == 800
    rng = np.random.default_rng(7)
    for n in (1, 2, 63, 64, 65, 127, 1280, 1281):
        # each block at its own magnitude: one scale for all would lose the small blocks entirely
        x = (rng.standard_normal(n) * np.repeat(10.0 ** np.arange(-4, 4), -(-n // 8))[:n]).astype(np.float32)
        data = pack_int4_blocks(x)
        assert len(data) == int4_blocks_nbytes(n)
        y = unpack_int4_blocks(data, n)
        assert y.dtype == np.float32 and y.shape == (n,)
        for start in range(0, n, BLOCK):
            block, got = x[start:start + BLOCK], y[start:start + BLOCK]
            assert_within_half_step(block, got)  # the block's own step, not the whole vector's
            assert got.min() == block.min()


def test_block_wise_int4_beats_one_scale_when_magnitudes_differ():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(64) * 1e-3, rng.standard_normal(64) * 1.0]).astype(np.float32)
    small_one_scale = np.abs(unpack_int4(pack_int4(x), 128) - x)[:64].max()
    small_blocks = np.abs(unpack_int4_blocks(pack_int4_blocks(x), 128) - x)[:64].max()
    assert small_blocks < small_one_scale / 100


def test_block_wise_stochastic_rounding_is_unbiased():
    x = latents(130, seed=5) * np.repeat([1e-3, 1.0, 10.0], [64, 64, 2]).astype(np.float32)
    rng = np.random.default_rng(0)
    decoded = np.stack([unpack_int4_blocks(pack_int4_blocks(x, rng=rng), 130) for _ in range(400)])
    for start in range(0, 130, BLOCK):
        block = x[start:start + BLOCK]
        step = float(block.max() - block.min()) / 15
        assert np.abs(decoded[:, start:start + BLOCK] - block).max() < step * (1 + 1e-6) + 1e-12
        assert np.abs(decoded[:, start:start + BLOCK].mean(0) - block).max() <= 4 * step / 2 / 20 + 1e-12


def test_block_wise_int4_refuses_corrupt_data():
    data = pack_int4_blocks(latents(65))
    assert len(data) == 33 + 2 * 8
    with pytest.raises(ValueError, match="must be 49 bytes, got 48"):
        unpack_int4_blocks(data[:-1], 65)
    nibbles = data[:33]
    for scale, zero in ((float("nan"), 0.0), (1.0, float("inf")), (-1.0, 0.0)):
        with pytest.raises(ValueError, match="scale"):
            unpack_int4_blocks(nibbles + data[33:41] + struct.pack("<ff", scale, zero), 65)
    padded = bytearray(data)
    padded[32] |= 0xF0
    with pytest.raises(ValueError, match="padding"):
        unpack_int4_blocks(bytes(padded), 65)


def test_block_wise_int4_through_the_codec_and_refused_where_not_sent():
    z = latents(1280)
    record = codec.encode({"z": z}, "int4b")
    assert record["z"].stype == codec.INT4B and codec.payload_bytes(record) == 800
    np.testing.assert_array_equal(codec.decode(record)["z"], unpack_int4_blocks(pack_int4_blocks(z), 1280))
    from flwr.app import Array, ArrayRecord

    short = ArrayRecord()
    short["z"] = Array(dtype="float32", shape=(1280,), stype=codec.INT4B, data=record["z"].data[:-1])
    with pytest.raises(codec.PayloadError, match="carries 799 bytes, expected 800"):
        codec.decode(short)
    with pytest.raises(codec.PayloadError, match="this run sends"):
        codec.check_declared("z", record["z"], {codec.INT4})
