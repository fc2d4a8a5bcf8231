"""postcard.supernode: Flower's SuperNode loop with its two fixed waits shortened, nothing else."""

import time

import pytest

from postcard import supernode


def test_the_two_waits_are_shortened_and_every_other_call_passes_through(monkeypatch):
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", loop.time)  # restored after the test
    line = supernode.shorten_waits(0.01, 0.001)
    assert "0.01 s when idle (Flower: 3 s)" in line
    start = time.perf_counter()
    loop.time.sleep(supernode.IDLE)
    loop.time.sleep(supernode.REPLY)
    assert time.perf_counter() - start < 0.5  # instead of 3.5 s
    start = time.perf_counter()
    loop.time.sleep(0.2)  # any other wait as asked
    assert 0.19 <= time.perf_counter() - start < 0.5
    assert abs(loop.time.time() - time.time()) < 1


def test_another_loop_or_another_flwr_or_bad_waits_are_refused(monkeypatch, capsys):
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(supernode.inspect, "getsource", lambda module: "while True:\n    time.sleep(5)\n")
    with pytest.raises(RuntimeError, match="no longer has the waits"):
        supernode.shorten_waits(0.5, 0.05)
    assert loop.time is time
    assert supernode.main(["--idle-poll", "0"]) == 2
    monkeypatch.setattr(supernode, "check_flwr", lambda: "postcard worker: written for flwr 1.42.0, found flwr 9")
    assert supernode.main([]) == 2
    assert "postcard supernode: written for flwr 1.42.0" in capsys.readouterr().err
