"""The direction of imports: kernels know nothing of tiers, tiers nothing of the engine, and the
engine nothing of the serving layer or the `kvstrata` facade (which imports them all). Checked on
the source of every module, imports inside functions and under TYPE_CHECKING included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = {"engine", "tiers", "kernels", "serving"}
FACADE = "kvstrata (the facade: __init__, cli, __main__)"

# What each inner package must not import: the layers above it, and the facade.
FORBIDDEN = {
    "kernels": {"kvstrata.tiers", "kvstrata.engine", "kvstrata.serving", FACADE},
    "tiers": {"kvstrata.engine", "kvstrata.serving", FACADE},
    "engine": {"kvstrata.serving", FACADE, "fastapi", "starlette", "uvicorn", "prometheus_client"},
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports, as absolute names; `from kvstrata import x` names `kvstrata.x`
    when x is a subpackage, else the facade."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: level 1 is the module's own package, kvstrata.<package>
                parts = ["kvstrata", *package.split(".")]
                base = parts[:len(parts) + 1 - node.level]
                module = ".".join(base + ([module] if module else []))
            if module == "kvstrata":
                names.update(f"kvstrata.{a.name}" if a.name in SUBPACKAGES else "kvstrata" for a in node.names)
            else:
                names.add(module)
    return names


def layer_of(module: str) -> str:
    """The layer a module name belongs to: a subpackage, the facade, or the top-level package name."""
    parts = module.split(".")
    if parts[0] == "kvstrata":
        return f"kvstrata.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else FACADE
    return parts[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_inner_packages_import_nothing_from_the_layers_above_them(package):
    modules = sorted((REPO / package).rglob("*.py"))  # subfolders too (engine/config/)
    assert modules, f"no modules found under {package}/"
    violations = [f"{path.relative_to(REPO)} imports {name}"
                  for path in modules
                  for name in sorted(imported_modules(path, ".".join(path.parent.relative_to(REPO).parts)))
                  if layer_of(name) in FORBIDDEN[package]]
    assert violations == []


def test_the_check_sees_every_way_of_importing_a_forbidden_layer(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("import kvstrata\nfrom kvstrata import __version__\nfrom kvstrata import serving\n"
                      "from kvstrata.serving.app import build_app\nfrom ..serving import metrics\n"
                      "def f():\n    import fastapi\n")
    layers = {layer_of(name) for name in imported_modules(source, "engine")}
    assert layers == {FACADE, "kvstrata.serving", "fastapi"}


def test_a_checkout_imports_its_own_subpackages_without_an_install(tmp_path):
    """On a machine set up by hand (a GPU one: the project's copy installed elsewhere, or none), a command run in the
    checkout imports the checkout's `kvstrata` folder first; its engine, tiers and kernels must come with it, from
    the checkout's top-level folders, as pyproject's package-dir maps them in an install."""
    import subprocess
    import sys

    # -S: no site-packages, so neither an installed nor an editable copy can answer for the checkout
    code = ("import kvstrata.engine.sizes as e, kvstrata.tiers.names as t, kvstrata.kernels.backends as k; "
            "print(e.__file__, t.__file__, k.__file__)")
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    found = [Path(name).resolve() for name in run.stdout.split()]
    assert found == [REPO / "engine" / "sizes.py", REPO / "tiers" / "names.py", REPO / "kernels" / "backends.py"]
