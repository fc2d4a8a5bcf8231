"""``flwr run`` with an exit status: submit, stream the logs, exit with how the run ended.

    python -m postcard.app_run [flwr run arguments]      # e.g. . --run-config "algorithm='fednl'"

``flwr run --stream`` exits 0 whether the run completed or failed, so a script cannot tell.
This submits the run (``flwr run ... --format json``, which prints its run id), streams its
logs (``flwr log RUN_ID --stream``), then reads its status from the SuperLink
(``flwr ls --run-id RUN_ID --format json``) and exits 0 for ``finished:completed``, 1 for a
failed or stopped run (with Flower's status details and, when the run folder says why,
Postcard's error), 2 when the run could not be submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _env() -> dict[str, str]:
    """This venv first on PATH: `flwr run` starts `flower-superlink` from PATH, even when the venv is not
    activated."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def _flwr() -> str:
    path = shutil.which("flwr", path=_env()["PATH"])
    if path is None:
        raise SystemExit("postcard.app_run: the `flwr` command is not installed next to this Python")
    return path


def _json(text: str) -> dict:
    """The JSON object in ``flwr ... --format json`` output (Flower may print other lines first)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in flwr's output: {text.strip()[-500:]!r}")
    return json.loads(text[start:text.rindex("}") + 1])


def run_status(flwr: str, run_id: str, timeout: float = 60.0) -> dict:
    """The run's record from ``flwr ls --run-id`` once its status is ``finished:*``."""
    deadline = time.time() + timeout
    while True:
        out = subprocess.run([flwr, "ls", "--run-id", run_id, "--format", "json"], capture_output=True, text=True,
                             env=_env())
        try:
            runs = _json(out.stdout).get("runs") or []
        except ValueError:
            runs = []
        record = runs[0] if runs else {}
        if str(record.get("status", "")).startswith("finished") or time.time() > deadline:
            return record
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    args = [a for a in args if a != "--stream"]  # the logs are streamed here
    flwr = _flwr()
    submitted = subprocess.run([flwr, "run", *args, "--format", "json"], capture_output=True, text=True, env=_env())
    try:
        reply = _json(submitted.stdout)
    except ValueError:
        reply = {}
    run_id = str(reply.get("run-id") or "")
    if submitted.returncode != 0 or not reply.get("success", False) or not run_id:
        print(submitted.stdout + submitted.stderr, file=sys.stderr)
        print(f"postcard.app_run: the run was not submitted (flwr run exit {submitted.returncode})", file=sys.stderr)
        return 2
    print(f"postcard.app_run: run {run_id} submitted; streaming its logs", flush=True)
    subprocess.run([flwr, "log", run_id, "--stream"], env=_env())
    record = run_status(flwr, run_id)
    status = str(record.get("status", "unknown"))
    if status == "finished:completed":
        print(f"postcard.app_run: run {run_id} {status}", flush=True)
        return 0
    details = record.get("status-details") or ""
    print(f"postcard.app_run: run {run_id} {status}" + (f": {details}" if details else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
