"""The import-layer rule of docs/architecture.md: imports point down only, no import cycles.

Every `import agentkv...` in the package counts, at module level or inside a function (a lazy
import is still a dependency). A package may import its own modules, and any package of a lower
layer; never one beside it on the same layer, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "agentkv"

LAYERS = [  # lowest first; docs/architecture.md draws the same
    {"agentkv", "errors", "data"},
    {"units", "terminal"},
    {"kv"},
    {"engine", "trace"},
    {"placement", "events", "metrics", "gate", "scaleout"},
    {"bench", "sim", "cache", "serve", "route", "security"},
    {"calib"},  # an application on top of bench's HTTP client
    {"cli"},
    {"__main__"},  # `python -m agentkv`: runs the CLI
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(module: str) -> str:
    """`agentkv.kv.pool` -> 'kv'; `agentkv` -> 'agentkv'; `agentkv.cli` -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "agentkv"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported agentkv module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path).split(".")
    base = me if path.name == "__init__.py" else me[:-1]
    top = {id(n) for n in tree.body} | {  # module level, but not `if TYPE_CHECKING:` (types only)
        id(c)
        for n in tree.body
        if isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test)
        for c in [*n.body, *n.orelse]
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                target = ".".join(stem + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "agentkv" or name.startswith("agentkv."):
                out.append((name, node.lineno, id(node) in top))
    return out


def violations(files: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Every import that points up or sideways across packages, as 'file:line: a -> b'."""
    bad = []
    for mod, imps in files.items():
        src = package_of(mod)
        for target, line, _ in imps:
            dst = package_of(target)
            if dst == src or dst not in RANK:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{mod}:{line}: {src} (layer {RANK[src]}) imports {dst} (layer {RANK[dst]})")
    return bad


def cycles(files: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """Cycles among module-level imports between modules (what makes an import order fail)."""
    graph = {m: {t for t, _, top in imps if top and t in files and t != m} for m, imps in files.items()}
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def scan() -> dict[str, list[tuple[str, int, bool]]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def test_every_package_has_a_layer() -> None:
    pkgs = {p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith("__")}
    pkgs |= {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert pkgs <= set(RANK), f"packages without a layer in LAYERS: {sorted(pkgs - set(RANK))}"


def test_imports_point_down_only() -> None:
    bad = violations(scan())
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    found = cycles(scan())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("agentkv.kv.pool", "agentkv.trace.model"),  # the core importing a trace (kv/analyze did)
        ("agentkv.engine.engine", "agentkv.trace.plan"),  # sideways: engine and trace
        ("agentkv.sim.command", "agentkv.cli"),  # an application importing the CLI (as sim did)
        ("agentkv.trace.blocks", "agentkv.metrics.records"),
        ("agentkv.bench.runner", "agentkv.serve.app"),  # one application importing another
    ],
)
def test_the_check_catches_a_bad_import(module: str, target: str) -> None:
    assert violations({module: [(target, 1, False)]}), f"{module} -> {target} passed the check"


def test_the_cycle_check_catches_a_cycle() -> None:
    files = {"agentkv.a": [("agentkv.b", 1, True)], "agentkv.b": [("agentkv.a", 1, True)]}
    assert cycles(files)
