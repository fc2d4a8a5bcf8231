"""One local SuperLink per FLWR_HOME: its own ports, a clear refusal of another's, stopped by pid."""

import json
import subprocess

import pytest

from postcard import superlink
from postcard.app_run import run_app
from postcard.flwr_cli import executable, flower_env


def test_ports_are_a_pair_of_their_own_per_flwr_home(tmp_path):
    a, b = superlink.local_ports(tmp_path / "a"), superlink.local_ports(tmp_path / "b")
    assert a != b and a[1] == a[0] + 1 and b[1] == b[0] + 1
    assert all(40000 <= p < 58000 for p in (*a, *b))
    assert superlink.local_ports(tmp_path / "a") == superlink.local_ports(str(tmp_path / "x" / ".." / "a"))
    env = flower_env(tmp_path / "a")
    assert (env[superlink.HTTP_PORT_VAR], env[superlink.CONTROL_PORT_VAR]) == tuple(map(str, a))
    # ports the user set are kept
    env = superlink.local_env({"FLWR_HOME": str(tmp_path / "a"), superlink.HTTP_PORT_VAR: "41000"})
    assert env[superlink.HTTP_PORT_VAR] == "41000"


def test_the_env_command_prints_exports_for_a_shell(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert superlink.main(["env", str(tmp_path)]) == 0
    http, control = superlink.local_ports(tmp_path)
    assert capsys.readouterr().out.strip() == (f"export FLWR_HOME={tmp_path.resolve()} "
                                               f"{superlink.HTTP_PORT_VAR}={http} {superlink.CONTROL_PORT_VAR}={control} "
                                               "RAY_ADDRESS=local RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0")
    assert superlink.main(["start"]) == 2  # not a command


def _flwr_ls(env):
    """`flwr ls` on the local connection: starts this FLWR_HOME's local SuperLink when none runs."""
    return subprocess.run([executable("flwr"), "ls", "--format", "json"], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_two_flwr_homes_run_two_superlinks_side_by_side_and_each_stops_its_own(tmp_path, capsys):
    homes = [tmp_path / "one", tmp_path / "two"]
    try:
        for home in homes:
            out = _flwr_ls(flower_env(home))
            assert out.returncode == 0, out.stdout + out.stderr
            assert json.loads(out.stdout[out.stdout.find("{"):])["success"]
        pids = [superlink.running(home) for home in homes]
        assert all(len(p) == 1 for p in pids) and pids[0] != pids[1]
        # a third FLWR_HOME told to use the first one's ports is refused in one line, naming the owner
        squatter = dict(flower_env(tmp_path / "three"), **{k: flower_env(homes[0])[k] for k in
                                                           (superlink.HTTP_PORT_VAR, superlink.CONTROL_PORT_VAR)})
        with pytest.raises(superlink.SuperLinkBusy, match=f"belongs to FLWR_HOME {homes[0].resolve()}"):
            superlink.check_free(squatter)
        assert run_app(["."], env=squatter) == 2
        assert "python -m postcard.superlink stop" in capsys.readouterr().err
        superlink.check_free(flower_env(homes[1]))  # its own SuperLink is not in its way
        assert superlink.stop(homes[0]) and not superlink.running(homes[0])
        assert superlink.running(homes[1]) == pids[1]
    finally:
        for home in homes:
            superlink.stop(home)
    assert not superlink.running(homes[1])
