"""The method registry and the import graph it keeps acyclic (docs/design.md, "Layers")."""

import ast
from pathlib import Path

import pytest

from fedapps import registry
from fedapps.config import compose, to_yaml
from fedapps.method import Method

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "clients", "fedapps", "postcard", "strategies")


def test_every_config_group_is_a_registered_method_and_back():
    groups = {p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml")}
    assert groups == set(registry.METHODS)
    for name in groups:  # the group's name: key is the record it runs
        assert compose(algorithm=name).algorithm.name == name
        method = registry.get(name)
        assert isinstance(method, Method) and method.name == name
        assert all(callable(f) for f in (method.prepare, method.train, method.evaluate, method.plan_server))


def test_unknown_or_twice_registered_methods_are_refused():
    with pytest.raises(KeyError, match="no method registered as 'fedsgd'; known: fedala, fedavg-full"):
        registry.get("fedsgd")
    with pytest.raises(ValueError, match="'flite' is registered twice"):
        registry.register(registry.get("flite"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): a block for annotations, never run."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(path: Path, package: str) -> set[str]:
    """Every project module ``path`` imports, at module level or inside a function (a function-level
    import closes a circle as surely when it runs). Not read: ``if TYPE_CHECKING:`` blocks, which hold
    imports for annotations only and never run."""
    found = set()
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if _type_checking(node):
            statements.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            found.add(f"{base}.{node.module}" if node.module else base)
        else:
            statements.extend(ast.iter_child_nodes(node))
    return found


def test_the_project_has_no_import_circle_and_strategies_stand_alone():
    """Every package (``bench/`` has no ``__init__.py``: its scripts are modules ``bench.<name>``), every
    import wherever it is written: no circle; strategies import nothing of the project's but
    strategies, clients nothing of fedapps (nor of postcard or bench), fedapps nothing of postcard or bench."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = {m for m in _imports(path, package) if m in modules and m != name}
    for name, deps in graph.items():
        if name.startswith("strategies"):
            assert all(d.startswith("strategies") for d in deps), f"{name} imports {deps}"
        if name.startswith("clients"):
            assert not any(d.startswith(("fedapps", "postcard", "bench")) for d in deps), f"{name} imports {deps}"
        if name.startswith("fedapps"):  # the Flower wiring sits below the commands (#61: it imported postcard.pulls)
            assert not any(d.startswith(("postcard", "bench")) for d in deps), f"{name} imports {deps}"
    # depth-first search for a cycle; a package's __init__ importing its own submodules is no cycle
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [node, dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_composing_and_validating_a_config_imports_no_torch():
    """Each registered method's config composes and validates without torch (a fresh interpreter).
    FLITE's latent budget on a causal LM is measured on the model's layers (built on the meta
    device: torch), so FLITE is composed here with its latents per layer set."""
    import subprocess
    import sys

    extra = {"flite": ["algorithm.flite.latents=4"]}
    calls = "".join(f"compose({extra.get(name, [])!r}, algorithm={name!r})\n" for name in sorted(registry.METHODS))
    # and every task whose checks run when composed (passkey's settings and FedNL's window against them)
    calls += "".join(f"compose([], task={task!r})\n" for task in ("passkey", "niah", "mmlu", "shakespeare"))
    calls += "compose(['task.eval_split=val'], task='fmnist', algorithm='flite')\ncompose([], task='passkey', algorithm='fednl')\n"
    code = f"import sys\nfrom fedapps.config import compose\n{calls}print('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- the worked example
def _design_blocks() -> dict[str, str]:
    """The code blocks of docs/design.md's worked example, by the file they say they are."""
    import re

    text = (ROOT / "docs" / "design.md").read_text()
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S)
    out = {}
    for block in blocks:
        first = block.splitlines()[0]
        if first.startswith("# file: "):
            out[first[len("# file: "):].strip()] = block
    yaml_block = re.search(r"Config, `conf/algorithm/signlora.yaml`:\n\n```yaml\n(.*?)```", text, re.S)
    out["conf/algorithm/signlora.yaml"] = yaml_block.group(1)
    return out


def test_the_worked_example_of_a_new_method_registers_trains_and_aggregates(monkeypatch, tmp_path):
    import sys
    import types

    import numpy as np
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from inprocess import answer
    from fedapps.config import to_yaml
    from strategies.screening import CONFIG_RECORD

    blocks = _design_blocks()
    assert set(blocks) == {"strategies/signlora.py", "clients/signlora/__init__.py", "fedapps/signlora.py",
                           "conf/algorithm/signlora.yaml"}
    for path in ("strategies/signlora.py", "clients/signlora/__init__.py", "fedapps/signlora.py"):
        name = path.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".")
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        exec(compile(blocks[path], path, "exec"), module.__dict__)  # noqa: S102 - the doc's own code
    method = sys.modules["fedapps.signlora"].METHOD
    monkeypatch.setitem(registry.METHODS, "signlora", method)
    assert registry.get("signlora") is method

    conf = tmp_path / "conf"  # the doc's YAML as a config folder of its own, on Hydra's search path
    (conf / "algorithm").mkdir(parents=True)
    (conf / "algorithm" / "signlora.yaml").write_text(blocks["conf/algorithm/signlora.yaml"])
    cfg = compose(["train.local_steps=2", "algorithm.server_lr=0.5"], conf_path=[conf], algorithm="signlora",
                  preset="test")
    assert cfg.algorithm.name == "signlora" and cfg.algorithm.trainable == "lora"  # fedavg-lora's, by its defaults
    # its combine is linear (after_mean): differential privacy can carry it, and scales the private mean
    private = compose(["privacy.mode=central"], conf_path=[conf], algorithm="signlora", preset="test")
    assert method.plan_server(private, on_round_end=None, config_yaml=to_yaml(private)).strategy.linear

    plan = method.plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    strategy = plan.strategy
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    node = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                   run_config={})
    content = RecordDict({"arrays": strategy.downlink_arrays(), "config": ConfigRecord({"server-round": 1}),
                          CONFIG_RECORD: ConfigRecord({"yaml": to_yaml(cfg)})})
    out = answer(Message(content, dst_node_id=1, message_type="train"), node)
    assert not out.has_error(), out.error if out.has_error() else None
    assert out.content["metrics"]["partition-id"] == 0

    update, examples = strategy.validate_reply(out)
    assert examples > 0 and set(update) == set(strategy.uplink_keys)
    moved = 0
    for value in update.values():  # sign(Δ)·mean|Δ|: one magnitude per tensor
        magnitudes = np.unique(np.abs(value[value != 0]))
        assert magnitudes.size <= 1
        moved += magnitudes.size
    assert moved > 0  # training changed something
    new = strategy.step(1, strategy.combine([update], [examples])).values
    for key, value in new.items():
        np.testing.assert_allclose(value, before[key] + 0.5 * update[key], rtol=0, atol=1e-7)
    # its final state is saved and restored like any LoRA method's
    from clients.adapters import all_lora_state

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan.save_final(new, run_dir)
    model, _ = method.restore(cfg, run_dir)
    restored = {k: v.numpy() for k, v in all_lora_state(model).items()}
    assert set(restored) == set(new)
    for key, value in new.items():
        np.testing.assert_array_equal(restored[key], value)


@pytest.mark.parametrize("name", sorted(registry.METHODS))
def test_a_methods_record_names_the_strategy_it_builds(name, tmp_path):
    """#61: DP and secure aggregation are refused for a method that combines replies its own way by one rule:
    its strategy class is non-linear (it overrides combine). The config check reads Method.strategy's flag,
    the strategy its own: every registered method's record must name the class its plan_server builds."""
    from inprocess import pool_overrides

    cfg = compose(pool_overrides(name, tmp_path), algorithm=name, preset="test")
    method = registry.get(name)
    strategy = method.plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    assert method.strategy is not None and type(strategy) is method.strategy


# a method's own files: its glue, its strategy, its client folder (the baselines own the LoRA, full-weight and
# compressed-update baselines); fedapps/registry.py lists them all
OWNERS = {"baselines": ("fedavg-lora", "fedprox", "ffa-lora", "fedavg-full", "topk-ef", "powersgd"),
          "flite": ("flite",), "fednl": ("fednl",), "fedala": ("fedala",), "fedssi": ("fedssi",),
          "smartfed": ("smartfed",)}
# a user-facing program that picks methods to show, by name, and branches on none
NAMES_ALLOWED = {"fedapps/registry.py", "postcard/demo.py"}


def _owner(relative: str) -> str | None:
    parts = Path(relative).with_suffix("").parts
    for owner in OWNERS:
        if parts[:2] in (("fedapps", owner), ("strategies", owner)) or parts[:2] == ("clients", owner):
            return owner
    return None


def _string_constants(tree: ast.AST):
    """The string literals of a module that are not docstrings (a docstring may name anything)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            docstrings.add(id(node.body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_method_is_named_outside_its_own_files():
    """#61: nothing outside a method's module, strategy and client folder names it (the wiring reads its
    record): a task that branched on 'fednl', a comparison hard-wired to 'fedavg-lora' and a stale list of LoRA
    methods were found so. Names that are also wire formats (powersgd) are the format's to use."""
    from strategies.compress import UPDATE_FORMATS

    owned = {name: owner for owner, names in OWNERS.items() for name in names}
    assert set(owned) == set(registry.METHODS), "a registered method with no owner here: add it to OWNERS"
    found = []
    for pkg in ("fedapps", "strategies", "clients", "postcard"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative in NAMES_ALLOWED:
                continue
            for node in _string_constants(ast.parse(path.read_text())):
                if node.value in owned and node.value not in UPDATE_FORMATS and _owner(relative) != owned[node.value]:
                    found.append(f"{relative}:{node.lineno} {node.value!r}")
    assert not found, found


def test_no_method_imports_another_but_the_shared_baselines():
    """#61: a method's files import no other method's files; the baselines (the LoRA and full-weight FedAvg every
    LoRA method builds on) may be imported by the others and import none. The vision head FLITE freezes moved to
    clients.models.heads (the baselines and pretraining imported it from clients.flite), the knowledge pool to
    clients.pool and fedapps.pool (the LoRA baselines' warm start imported it from SmartFed)."""
    modules = {_module_name(p): p for pkg in ("fedapps", "strategies", "clients") for p in (ROOT / pkg).rglob("*.py")}

    def owner(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in OWNERS else None

    found = set()
    for name, path in modules.items():
        mine = owner(name)
        if mine is None:
            continue
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for dep in _imports(path, package):
            theirs = owner(dep) if dep in modules else None
            if theirs and theirs != mine and theirs != "baselines":
                found.add((name, dep))
    assert not found, sorted(found)
