"""The package's layers import in one direction only, with no cycle -- imports inside
functions included (docs/design.md, "Layout").

    foundation (config, constants, activation, mesh, quant, weights, reference, routing,
    grouped, placement, replicas)
    -> scheduler -> kernels -> runtime (and the unfused baselines)
    -> module (moe, custom_op, eplb) -> integrations -> cli and bench (and the package facade)

Read from the source with ``ast``, so the test needs no GPU and imports nothing.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "comet"

#: Layer of each module, by the longest matching prefix of its dotted name.
LAYERS = [
    ("comet.constants", 0), ("comet.config", 0), ("comet.weights", 0),
    ("comet.activation", 0), ("comet.mesh", 0), ("comet.quant", 0),
    ("comet.reference", 0), ("comet.routing", 0), ("comet.grouped", 0),
    ("comet.placement", 0), ("comet.replicas", 0),
    ("comet.scheduler", 1),
    ("comet.kernels", 2),
    ("comet.runtime", 3), ("comet.baseline", 3), ("comet.baseline_backward", 3),
    ("comet.moe", 4), ("comet.custom_op", 4), ("comet.eplb", 4),
    ("comet.integrations", 5),
    ("comet.cli", 6), ("comet.bench", 6), ("comet.__main__", 6), ("comet", 6),
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """Every comet module ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import mod`` imports the module; ``from pkg import name`` the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in mods and t != name}
    return found


def _layer(name: str) -> int:
    return max((len(prefix), layer) for prefix, layer in LAYERS
               if name == prefix or name.startswith(prefix + "."))[1]


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    assert all(_layer(name) is not None for name in MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    higher = sorted(t for t in GRAPH[name] if _layer(t) > _layer(name))
    assert not higher, f"{name} (layer {_layer(name)}) imports {higher}"


def test_no_import_cycle():
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """A function-level import of a higher layer is caught like a module-level one."""
    src = tmp_path / "k.py"
    src.write_text("def f():\n    from comet.runtime import layer\n")
    assert "comet.runtime.layer" in _imports("comet.kernels.k", src, MODULES)
