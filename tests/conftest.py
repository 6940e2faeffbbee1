"""Test-wide settings. Triton kernels run through its CPU interpreter in tests (there is no GPU in CI):
the flag must be set before any kernel is defined, hence here, before test modules are imported."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Test processes share the cores (`make test` runs one per core): each torch on one thread, as the engine is on a
# 2-core machine, instead of every process spinning a thread per core against the others'.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run compiled kernels on a GPU: without CUDA they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on one)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model_fp32():
    """The embedded model in float32 on the CPU, loaded once for the tests that run it in-process."""
    from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model

    return load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cpu")


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """An empty build dir for the compiled CPU kernels (kernels/cpu_build.py), every kernel module's loaded library
    (and the backend's answer) forgotten before and after, so that a test builds, or fails to build, afresh."""
    from kvstrata.kernels import cpu_attention, cpu_layer_ops, cpu_linear
    from kvstrata.kernels.backends import cpu_kernel_available

    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    caches = (cpu_attention.library, cpu_linear.library, cpu_layer_ops.library, cpu_kernel_available)
    for cache in caches:
        cache.cache_clear()
    yield tmp_path / "cache" / "kernels"
    for cache in caches:
        cache.cache_clear()


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    """A C compiler that fails as a broken toolchain does ("broken-cc", exit 4), the one the kernels' builds find."""
    from kvstrata.kernels import cpu_build

    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc1: internal compiler error' >&2\nexit 4\n")
    broken.chmod(0o755)
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: str(broken))
    return broken
