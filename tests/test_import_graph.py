"""The package structure holds (issue 27): no import cycle, imports go one way (``recipes -> rl ->
glm5_mcore``, Hydra only in ``recipes/``; inside ``rl/``, down ``RL_LAYERS``), no module past ~400 lines, no
private name used across modules.

Every ``import`` in ``glm5_mcore/``, ``rl/`` and ``recipes/`` counts, function-local ones too (they are read
with ``ast``, nothing is imported), so a late import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glm5_mcore", "rl", "recipes")
MAX_LINES = 420
TOO_LONG_ALLOWED: set[str] = set()  # modules allowed past MAX_LINES while a split is under way
ABOVE = {  # package -> top-level names it must not import (they sit above it)
    "glm5_mcore": {"recipes", "rl", "hydra", "launch", "bench"},
    "rl": {"recipes", "hydra", "launch", "bench"},
    "recipes": {"launch", "bench"},
}

RL_LAYERS = {  # rl sub-package -> the rl sub-packages below it, which it may import (and rl.config, the schema)
    "rl.rollout": set(),                                   # the engines
    "rl.train": {"rl.rollout"},                            # a trainer rank (makes the engines' adapter payload)
    "rl.tasks": {"rl.rollout"},                            # prompts, rewards, tool episodes over any engine
    "rl.cluster": {"rl.rollout", "rl.train", "rl.tasks"},  # Ray actors holding trainers and engines
    "rl.schedule": {"rl.rollout", "rl.train", "rl.tasks"},  # where a step's samples come from
}
"""The top of ``rl/`` (``rl.driver``, ``rl.validate``, ``rl.metrics``) imports any of them; nothing in ``rl/``
imports the driver."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (``pkg.__init__`` as ``pkg``)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement of the module ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, [], node.lineno) if sub in known else (base, [a.name], node.lineno))
    return out


def edges(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    graph = {m: set() for m in known}
    for m, f in known.items():
        for target, _, _ in imports(m, f, known):
            if target in known and target != m:
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    known = modules(root)
    bad = []
    for m, f in known.items():
        forbidden = ABOVE[m.split(".")[0]]
        for target, _, line in imports(m, f, known):
            if target.split(".")[0] in forbidden:
                bad.append(f"{f.relative_to(root)}:{line} imports {target}")
    return bad


def rl_upward_imports(root: Path = ROOT) -> list[str]:
    """Imports inside ``rl/`` that go up or sideways against ``RL_LAYERS``."""
    known = modules(root)
    bad = []
    for m, f in known.items():
        if not m.startswith("rl."):
            continue
        pkg = ".".join(m.split(".")[:2])
        for target, _, line in imports(m, f, known):
            if not target.startswith("rl.") or target == "rl.config" or target.startswith(pkg + "."):
                continue
            where = ".".join(target.split(".")[:2])
            if target == "rl.driver" or (pkg in RL_LAYERS and where not in RL_LAYERS[pkg]):
                bad.append(f"{f.relative_to(root)}:{line} imports {target}")
    return bad


def long_modules(root: Path = ROOT) -> list[str]:
    out = []
    for m, f in modules(root).items():
        rel = str(f.relative_to(root))
        n = len(f.read_text().splitlines())
        if n > MAX_LINES and rel not in TOO_LONG_ALLOWED:
            out.append(f"{rel}: {n} lines")
    return out


def private_imports(root: Path = ROOT) -> list[str]:
    """``from pkg.mod import _name`` and ``mod._name`` (``mod`` an imported project module) across modules."""
    known = modules(root)
    bad = []
    for m, f in known.items():
        tree = ast.parse(f.read_text(), str(f))
        aliases = {}
        for target, names, line in imports(m, f, known):
            if target.split(".")[0] not in PACKAGES or target == m:
                continue
            bad += [f"{f.relative_to(root)}:{line} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        for node in ast.walk(tree):  # module aliases: import a.b as x / from a import b (a module)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in known:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if f"{node.module}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != m):
                bad.append(f"{f.relative_to(root)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_import_cycle():
    assert cycles(edges()) == []


def test_library_never_imports_recipes_rl_or_hydra():
    assert upward_imports() == []


def test_rl_imports_go_down_its_layers():
    assert rl_upward_imports() == []


def test_no_module_over_420_lines():
    assert long_modules() == []


def test_no_private_name_across_modules():
    assert private_imports() == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """A cycle through a function-local import, an upward import, a long module and a private name in a
    scratch tree are each found (so the checks above cannot pass by seeing nothing)."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "glm5_mcore" / "a.py").write_text("from glm5_mcore.b import f\n\n\ndef _g():\n    pass\n")
    (tmp_path / "glm5_mcore" / "b.py").write_text("def f():\n    from glm5_mcore.a import _g\n    import hydra\n")
    (tmp_path / "rl" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    for sub in ("train", "schedule"):
        (tmp_path / "rl" / sub).mkdir()
        (tmp_path / "rl" / sub / "__init__.py").write_text("")
    (tmp_path / "rl" / "schedule" / "s.py").write_text("x = 1\n")
    (tmp_path / "rl" / "train" / "t.py").write_text("def f():\n    from rl.schedule.s import x\n")
    assert cycles(edges(tmp_path)) == [["glm5_mcore.a", "glm5_mcore.b"]]
    assert upward_imports(tmp_path) == ["glm5_mcore/b.py:3 imports hydra"]
    assert long_modules(tmp_path) == [f"rl/long.py: {MAX_LINES + 1} lines"]
    assert private_imports(tmp_path) == ["glm5_mcore/b.py:2 imports glm5_mcore.a._g"]
    assert rl_upward_imports(tmp_path) == ["rl/train/t.py:2 imports rl.schedule.s"]
