"""What the `postcard` CLI prints and where it puts a sweep's runs (fast: no run is started)."""

import io
import shlex
import sys

from fedapps.config import compose
from postcard.app_run import stream_logs
from postcard.cli import sweep_run_name

COLOURED = "print('\\x1b[92mINFO \\x1b[0m:      round 1'); print('\\x1b[93mWARNING \\x1b[0m:   slow')"


def test_piped_logs_carry_no_colour_codes():
    out = io.StringIO()  # a pipe or a file: not a terminal
    assert stream_logs([sys.executable, "-c", COLOURED], env=None, out=out) == 0
    assert out.getvalue() == "INFO :      round 1\nWARNING :   slow\n"


NOISY = ("print('\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.'); "
         "print('INFO :      To change federation size, use the following command:'); "
         "print('INFO :      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>'); "
         "print('(ClientAppActor pid=7) WARNING :   Manually terminating ClientAppActor'); "
         "print('INFO :      round 1'); print('WARNING :   round 2: no train reply from node 5')")


def test_flowers_lines_that_ask_nothing_of_the_user_are_not_relayed():
    """#60: every run printed Flower's federation-size notes (with a hint that does not apply under postcard)
    and a WARNING as it ended its Ray actors; a WARNING that needs the user's eye still comes through."""
    out = io.StringIO()
    assert stream_logs([sys.executable, "-c", NOISY], env=None, out=out) == 0
    assert out.getvalue() == "INFO :      round 1\nWARNING :   round 2: no train reply from node 5\n"


def test_a_sweep_names_each_run_folder_by_the_values_it_sweeps():
    argv = ["-m", "algorithm=fedavg-lora,ffa-lora", "preset=test", "train.lr=1e-4,1e-3", "rounds=1"]
    job = ["algorithm=ffa-lora", "preset=test", "train.lr=1e-3", "rounds=1"]
    assert sweep_run_name(job, argv, 3) == "algorithm=ffa-lora,train.lr=1e-3"
    # a swept path becomes one folder name, never a path; nothing swept: the job's number
    assert sweep_run_name(["task.path=/data/a.jsonl"], ["-m", "task.path=/data/a.jsonl,/data/b.jsonl"], 0) \
        == "task.path=_data_a.jsonl"
    assert sweep_run_name(["rounds=2"], ["-m", "rounds=2"], 5) == "job-5"
    assert sweep_run_name(["train.lr=0.2"], ["-m", "train.lr=range(0.1,0.3,0.1)"], 1) == "train.lr=0.2"


def test_a_sweep_run_name_travels_to_the_server_intact():
    # run_composed hands the server `run_name='<name>'` inside its overrides string (shlex-joined)
    name = sweep_run_name(["algorithm=ffa-lora", "train.lr=1e-3"], ["-m", "algorithm=a,ffa-lora", "train.lr=1,1e-3"], 0)
    overrides = shlex.split(shlex.join([f"run_name='{name}'", "rounds=1"]))
    assert compose(overrides, preset="test").run_name == name
