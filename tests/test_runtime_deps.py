"""Plain `flwr run .` installs nothing at run time: Flower's runtime dependency installation (on by
default on a SuperLink not started with FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1) runs `uv sync`
of the app's pyproject.toml, and [tool.uv] exclude-dependencies leaves it nothing to install."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_every_dependency_is_excluded_from_uv_sync():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = {_name(d) for d in config["project"]["dependencies"]}
    for extra in config["project"].get("optional-dependencies", {}).values():
        wanted |= {_name(d) for d in extra}
    excluded = {_name(d) for d in config["tool"]["uv"]["exclude-dependencies"]}
    assert wanted <= excluded, f"add {sorted(wanted - excluded)} to [tool.uv] exclude-dependencies"


def test_flowers_runtime_install_of_this_apps_fab_installs_nothing(tmp_path):
    """This app's pyproject.toml as `flwr run .` bundles it (a FAB: Flower rewrites the file), installed by
    Flower's own installer (what the ServerApp and the simulation run before loading the app when runtime
    installation is on): no package lands in the run's environment, in well under the ~29 s it took."""
    from flwr.cli.build import build_fab_from_files

    fab, _ = build_fab_from_files({"pyproject.toml": ROOT / "pyproject.toml"})
    app = tmp_path / "app"
    zipfile.ZipFile(io.BytesIO(fab)).extractall(app)
    assert "exclude-dependencies" in tomllib.loads((app / "pyproject.toml").read_text())["tool"]["uv"]
    script = (
        "import json, sys, time\n"
        "from flwr.supercore.superexec.dependency_installer import install_app_dependencies\n"
        "start = time.monotonic()\n"
        f"env = install_app_dependencies({str(app)!r}, run_id=1)\n"
        "site = next(env.glob('lib/python*/site-packages'))\n"
        "print(json.dumps({'seconds': time.monotonic() - start, 'env': str(env),\n"
        "                  'installed': sorted(p.name for p in site.glob('*.dist-info'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PATH": str(Path(sys.executable).parent), "FLWR_HOME": str(tmp_path / "flwr"),
                              "HOME": str(tmp_path), "UV_CACHE_DIR": str(tmp_path / "uv-cache")})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["env"].startswith(str(tmp_path / "flwr" / "runtime-envs"))
    assert result["installed"] == [], result
    assert result["seconds"] < 15, result
