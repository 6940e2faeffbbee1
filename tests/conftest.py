"""Test-wide settings. Triton kernels run through its CPU interpreter in tests (there is no GPU in CI):
the flag must be set before any kernel is defined, hence here, before test modules are imported."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
