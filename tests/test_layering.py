"""The packages' floors (docs/architecture.md): a package imports only packages on floors below its own, so the
import graph has no cycle and no package leans on one beside or above it. The test reads every import statement
under services/ (function-local ones too) and names each edge that breaks the rule; inside a package, it names any
circle of imports between its modules."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"

# Lowest first. A package may import the packages of lower floors only.
FLOORS = [
    {"v1"},  # the generated gRPC stubs
    {"core"},  # config, errors, servers and clients, storage, host, model helpers (LoRA, MoE)
    {"algorithms", "weight_sync", "sandbox", "tools"},
    {"reward", "sim"},  # sim: the simulated engines' cost models (rollout.engine sim, <role>.engine sim)
    {"env", "trainer"},  # the environment service; the trainer the three model roles share
    {"actor", "critic", "reference", "rollout"},  # the roles
    {"data", "gateway", "agents"},  # gateway: the OpenAI-compatible endpoint agents call, over the rollout router;
    #                                 agents: the user's agent code, run per episode (inline, subprocess, command)
    {"coordinator"},
    {"serve"},
    {"quickstart"},
    {"launch"},
    {"cli"},
    {"api"},  # rlfabric.train and rlfabric.connect: the CLI's paths as functions
    {"__init__", "__main__"},  # `import rlfabric` (its API), `python -m rlfabric` (the CLI)
]
# Edges between packages of one floor that stay for now, each with what would remove it (none today).
SIDEWAYS: dict[tuple[str, str], str] = {}
# Packages only some may import, whatever their floors.
ONLY_IMPORTED_BY = {"quickstart": {"launch", "cli"}}


def _package(path: Path) -> str:
    relative = path.relative_to(SERVICES)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where, for every rlfabric import between two packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SERVICES.rglob("*.py")):
        source = _package(path)
        if source == "v1":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "rlfabric" \
                    else [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "rlfabric" and len(parts) > 1 and parts[1] != source:
                    where = f"services/{path.relative_to(SERVICES)}:{node.lineno}"
                    edges.setdefault((source, parts[1]), []).append(where)
    return edges


def test_every_package_has_a_floor():
    floor_of = {package for floor in FLOORS for package in floor}
    packages = {_package(path) for path in SERVICES.rglob("*.py")} - {"__init__"}
    assert packages <= floor_of, f"place {sorted(packages - floor_of)} on a floor of tests/test_layering.py " \
                                 "and docs/architecture.md"


def test_no_package_imports_beside_or_above_itself():
    floor_of = {package: level for level, floor in enumerate(FLOORS) for package in floor}
    broken = []
    for (source, target), places in sorted(import_edges().items()):
        if target not in floor_of:
            continue  # the package test above names it
        if floor_of[target] >= floor_of[source] and (source, target) not in SIDEWAYS:
            side = "beside" if floor_of[target] == floor_of[source] else "above"
            broken.append(f"{source} imports {target}, {side} it: {', '.join(places)}")
        allowed = ONLY_IMPORTED_BY.get(target)
        if allowed is not None and source not in allowed:
            broken.append(f"{source} imports {target}, which only {sorted(allowed)} may: {', '.join(places)}")
    assert not broken, "\n".join(broken)


def test_the_sideways_edges_still_listed_exist():
    """An edge that went away leaves the list too, so it cannot hide a new one."""
    edges = import_edges()
    assert [edge for edge in SIDEWAYS if edge not in edges] == []


def test_every_package_is_installed():
    """`pip install .` (the image's build) installs the packages pyproject lists, not what is on disk."""
    import tomllib

    listed = set(tomllib.loads((SERVICES.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"rlfabric"} | {"rlfabric." + ".".join(init.parent.relative_to(SERVICES).parts)
                              for init in SERVICES.rglob("__init__.py") if init.parent != SERVICES}
    assert on_disk - {"rlfabric.__pycache__"} == listed


def test_the_trainer_reads_role_specs_not_role_names():
    """Issue 32, item 3: what differs between the actor, reference and critic is a field of their RoleSpec
    (trainer/roles.py). A comparison with a role's name anywhere else in the trainer is a branch that spec
    should hold; the test names each one."""
    names = {"actor", "reference", "critic"}
    branches = []
    for path in sorted((SERVICES / "trainer").glob("*.py")):
        if path.name == "roles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                constants = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(c.value in names for c in constants if isinstance(c.value, str)):
                    branches.append(f"services/trainer/{path.name}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
                if any(isinstance(k, ast.Constant) and k.value in names for k in node.value.keys):
                    branches.append(f"services/trainer/{path.name}:{node.lineno} (a dict by role name)")
    assert not branches, "role-name branches in the trainer: " + ", ".join(branches)


# Comparisons with a word that is a role's name but holds a config value, not a role.
NOT_A_ROLE = {
    "old_log_prob_source": "algorithm.old_log_prob_source: auto | actor | rollout",
    "reward": "rollout.multi_turn.reward: env | reward | both",
    "source": "rollout.multi_turn.reward as coordinator.multi_turn.combined_result's argument",
    "kind": "a weight-sync receiver's kind: rollout | reference (coordinator.weight_sync)",
}


def _operand_name(node: ast.expr) -> str:
    """`role` of `role`, `p.role` and `x.y.role`; "" for anything else."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def test_no_role_name_is_compared_outside_the_role_table():
    """Issue 44, item 3: what the launchers and `rlfabric serve` do differently per role is a column of the
    role table (core/roles.py: servicer, kind, GPU rule), so adding a role is adding a row. A comparison with a
    role's name (==, !=, in, not in) anywhere else in services/ is a branch the table should hold, and a literal
    listing three or more role names is a column of it written out again; the test names each."""
    from rlfabric.core.roles import ROLES

    def names(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value] if node.value in ROLES else []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in ROLES]
        return []

    branches = []
    for path in sorted(SERVICES.rglob("*.py")):
        where = path.relative_to(SERVICES)
        if where.parts[0] == "v1" or where == Path("core/roles.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                compared = [name for operand in operands for name in names(operand)]
                if compared and not any(_operand_name(operand) in NOT_A_ROLE for operand in operands):
                    branches.append(f"services/{where}:{node.lineno} ({', '.join(compared)})")
            elif isinstance(node, ast.Tuple | ast.List | ast.Set) and len(names(node)) >= 3:
                branches.append(f"services/{where}:{node.lineno} (a list of roles: {', '.join(names(node))})")
    assert not branches, "role names outside the role table (core/roles.py): " + "; ".join(branches)


def _module_name(path: Path) -> str:
    """services/rollout/engine.py -> rlfabric.rollout.engine; services/env/__init__.py -> rlfabric.env."""
    parts = ["rlfabric", *path.relative_to(SERVICES).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports() -> dict[str, set[str]]:
    """Module -> the rlfabric modules it imports (every import statement: function-local and typing-only ones
    too; `from rlfabric.rollout import wire` imports the module rlfabric.rollout.wire)."""
    paths = {_module_name(path): path for path in SERVICES.rglob("*.py") if _package(path) != "v1"}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from .stats import x` in rlfabric.algorithms, `from . import wire`
                    anchor = package.split(".")[:package.count(".") + 2 - node.level]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[module] = {target for target in imported if target in paths and target != module}
    return graph


def test_no_import_circle_between_modules_of_a_package():
    """Issue 44, item 2: inside a package, too, a module is read with what it imports only: no two modules
    import each other, directly or around a longer circle (the rollout engine and its agent rollouts did)."""
    graph = module_imports()
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target.split(".")[:2] != module.split(".")[:2]:
                continue  # between packages: the floors above keep those apart
            if target in path:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(circles)


# Module-level functions that several modules define on purpose, each the same contract written per module.
SAME_NAME_BY_DESIGN = {
    "main": "each script's entry point (python -m ...)",
    "build_service": "each role's servicer module, which the role table (core/roles.py) names",
    "compute_score": "each reward task's scorer (VeRL's contract), which the reward registry loads",
    "make_example": "each synthetic task's example maker, which data prep calls per task",
    "torch_dtype": "core.codec's reads a wire DataType (beside wire_dtype), core.dtypes' a config dtype name",
}


def test_no_function_is_defined_twice():
    """Issue 44, item 5: a helper has one home. Two module-level functions of one name anywhere under services/
    are a helper written twice (is_loopback was, with two meanings) unless SAME_NAME_BY_DESIGN says why. Methods
    are not counted: a class's method of a shared name is an interface implemented, not a helper copied."""
    homes: dict[str, list[str]] = {}
    for path in sorted(SERVICES.rglob("*.py")):
        if _package(path) == "v1":
            continue
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in SAME_NAME_BY_DESIGN:
                homes.setdefault(node.name, []).append(f"services/{path.relative_to(SERVICES)}:{node.lineno}")
    twice = {name: places for name, places in homes.items() if len(places) > 1}
    assert not twice, "defined more than once: " + "; ".join(f"{name} ({', '.join(places)})"
                                                             for name, places in sorted(twice.items()))


def test_every_function_defined_twice_by_design_still_is():
    """A name whose second definition went away leaves the list too, so it cannot hide a new copy."""
    homes: dict[str, int] = {}
    for path in SERVICES.rglob("*.py"):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                homes[node.name] = homes.get(node.name, 0) + 1
    assert [name for name in SAME_NAME_BY_DESIGN if homes.get(name, 0) < 2] == []


TESTS = Path(__file__).resolve().parent
# Test folders that test no one package but the mesh as a whole, or code outside services/.
MESH_WIDE = {
    "bench": "the benchmarks' own tests (bench/, beside services/)",
    "clients": "clients in other languages (examples/clients) against a live mesh",
    "deploy": "the images, the Helm chart and the Ray launcher, each bringing up every role",
    "docs": "the README and the docs site (docs/, mkdocs.yml) against the code they describe",
    "real_model": "a real pretrained model through every service",
    "reliability": "faults, hostile clients and fuzzing across the services",
}


def _test_folders() -> set[str]:
    """tests/'s folders that hold Python files (not one that a checkout left with only __pycache__ in it)."""
    return {path.name for path in TESTS.iterdir() if path.is_dir() and any(path.glob("*.py"))}


def test_the_tests_mirror_the_packages():
    """Issue 44, item 7: the tests of rlfabric.<package> are in tests/<package>/, so a package's tests are found
    where its name says. A test folder named after no package of services/ is named here, unless MESH_WIDE says
    why it stands apart."""
    packages = {path.name for path in SERVICES.iterdir() if (path / "__init__.py").exists()}
    assert sorted(_test_folders() - packages - set(MESH_WIDE)) == []


def test_every_mesh_wide_test_folder_still_is():
    """A folder that left tests/ (or became a package's) leaves MESH_WIDE too, so the list cannot hide one."""
    packages = {path.name for path in SERVICES.iterdir() if (path / "__init__.py").exists()}
    assert [name for name in MESH_WIDE if name not in _test_folders() or name in packages] == []

def test_no_module_exports_its_names_lazily():
    """Issue 44, item 7: a module-level __getattr__ (PEP 562) makes names that an editor cannot follow to their
    definition, as rlfabric.weight_sync's lazy exports were: import a name from the module that defines it."""
    lazy = []
    for path in sorted(SERVICES.rglob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                lazy.append(f"services/{path.relative_to(SERVICES)}:{node.lineno}")
    assert lazy == []


# A file past this many lines, or a class past this many, usually holds two ideas (issue 44's targets).
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 350


def test_no_module_or_class_outgrows_one_idea():
    too_long = []
    for path in sorted(SERVICES.rglob("*.py")):
        if path.relative_to(SERVICES).parts[0] == "v1":  # generated stubs
            continue
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(SERVICES)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(SERVICES)}: class {node.name}, "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
