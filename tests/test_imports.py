"""No folder of ours shadows an installed package, from any working directory.

`python -c`, `python -m` and `python -m pytest` put the working directory first on `sys.path`. Our top-level
folders `engine/`, `tiers/` and `kernels/` must never answer there for an installed package of the same name
(Hugging Face's `kernels`, which transformers imports while loading any model): they are namespace packages, which
a regular package later on the path beats."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OUR_FOLDERS = ("engine", "tiers", "kernels")


def run_python(*args: str, cwd: Path, extra_path: Path | None = None, timeout: int = 120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def installed_namesakes(tmp_path):
    """A site folder holding regular packages named like each of our folders, as an install would."""
    site = tmp_path / "site"
    for name in OUR_FOLDERS:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
    return site


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_an_installed_package_named_like_our_folders_wins_over_them(installed_namesakes, tmp_path, where):
    cwd = REPO if where == "repo root" else tmp_path
    code = "import engine, tiers, kernels; print(engine.WHO, tiers.WHO, kernels.WHO, sep=',')"
    run = run_python("-c", code, cwd=cwd, extra_path=installed_namesakes)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().split(",") == [f"installed {name}" for name in OUR_FOLDERS]


def test_our_subpackages_still_import_beside_their_namesakes(installed_namesakes):
    code = ("import kernels, kvstrata.kernels.backends as ours; print(kernels.WHO); "
            "print(ours.get_ops('torch').name)")
    run = run_python("-c", code, cwd=REPO, extra_path=installed_namesakes)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["installed", "kernels", "torch"]


def test_hugging_face_kernels_and_the_transformers_hub_integration_import_from_the_repo_root():
    # transformers (5.25 and later) depends on Hugging Face's `kernels` and imports it while loading any model
    assert importlib.util.find_spec("transformers") is not None
    code = ("import importlib.metadata as m, kernels, transformers.integrations.hub_kernels; "
            "print(kernels.__file__); print(m.version('kernels'))")
    run = run_python("-c", code, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    origin = Path(run.stdout.split()[0]).resolve()
    assert not origin.is_relative_to(REPO / "kernels") and "site-packages" in origin.parts, origin


def test_the_cpu_and_torch_backends_never_import_triton():
    """Their ops are the compiled CPU kernels and the torch references beside the Triton kernels: defining those
    kernels must not import Triton (torch itself may, later, to ask whether it is there)."""
    code = ("import sys, torch\n"
            "from kvstrata.kernels.backends import cpu_kernel_available, get_ops\n"
            "for backend in ['cpu', 'torch'] if cpu_kernel_available() else ['torch']:\n"
            "    get_ops(backend, batch_invariant=True).silu_and_mul(torch.randn(3, 16))\n"
            "    get_ops(backend).silu_and_mul(torch.randn(3, 16))\n"
            "print('triton' in sys.modules)\n")
    run = run_python("-c", code, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize("ending, where", [("left open", "elsewhere"), ("deleted", "repo root")])
def test_a_script_answers_from_any_folder_and_exits_cleanly_with_its_blocks_on_disk_unclosed(tmp_path, ending, where):
    """`python -c` puts its folder first on the path: the embedded model answers from the repo root and from
    elsewhere. vLLM's users end scripts without closing the engine, or `del` it: the exit must still write the
    cached blocks down and undo the engine's gc.freeze (frozen objects are never collected at shutdown, and Triton's
    bindings, imported through torch, then printed hundreds of "leaked" lines; a CPU run builds no Triton object)."""
    from kvstrata.tiers.lmdb_store import read_store_stats

    config, disk = str(REPO / "configs" / "default.yaml"), tmp_path / "kv"
    code = ("from kvstrata import LLM, SamplingParams, load_config\n"
            f"llm = LLM(load_config({config!r}, {{'cache.tiers.disk.path': {str(disk)!r}}}))\n"
            "out = llm.generate('word ' * 100, SamplingParams(max_tokens=2, temperature=0.0))\n"
            "print(len(out[0].token_ids))\n"
            + ("del llm\n" if ending == "deleted" else ""))
    run = run_python("-c", code, cwd=REPO if where == "repo root" else tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "2"
    assert "leaked" not in run.stderr, run.stderr[-1500:]
    assert read_store_stats(str(disk))["entries"] >= 6  # the prompt's full blocks (16 tokens each), on disk


@pytest.mark.slow
def test_the_embedded_model_answers_through_python_m_kvstrata_from_the_repo_root(tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("The Eiffel Tower is in Paris. It was finished in 1889.")
    run = run_python("-m", "kvstrata", "ask", "--config", "configs/default.yaml", "--set",
                     f"cache.tiers.disk.path={tmp_path / 'kv'}", "--doc", str(document), "--max-tokens", "4",
                     "Where is the tower?", cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]


SUITES = sorted(path.name for path in (REPO / "benchmarks").glob("*.py")
                if 'if __name__ == "__main__"' in path.read_text() and path.name != "__init__.py")


@pytest.mark.parametrize("suite", SUITES)
def test_a_benchmark_run_as_a_script_imports_the_installed_namesakes(installed_namesakes, suite):
    """`python benchmarks/SUITE.py` puts benchmarks/ first on the path, where kernels.py would answer for the
    installed `kernels` (transformers imports it while loading any model)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['benchmarks/{suite}', '--help']; sys.path[0] = {str(REPO / 'benchmarks')!r}\n"
            "try:\n"
            f"    runpy.run_path({str(REPO / 'benchmarks' / suite)!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "import kernels; print(kernels.WHO)\n")
    run = run_python("-c", code, cwd=REPO, extra_path=installed_namesakes)
    assert run.stdout.strip().splitlines()[-1:] == ["installed kernels"], run.stdout[-1000:] + run.stderr[-2000:]
