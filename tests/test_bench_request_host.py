"""The request host benchmark end to end, with few requests: each kind is served as it is meant to be (a cold
prompt and a miss computed, the document's questions found on the device, then in the CPU tier once the device's
blocks are dropped; the benchmark raises otherwise), and its phases add up to its time to first token."""
import pytest

from benchmarks.suites.host import request as request_host

pytestmark = pytest.mark.slow


def test_every_kind_of_request_is_served_from_its_tier_and_timed(monkeypatch):
    import torch

    monkeypatch.setattr(request_host, "ASKS", 2)
    threads = torch.get_num_threads()
    try:
        measured = request_host.worker("run")["kinds"]  # (it runs torch on one thread, as the benchmark does)
    finally:
        torch.set_num_threads(threads)
    assert list(measured) == list(request_host.KINDS)
    for kind, figures in measured.items():
        assert figures["ttft_ms"] > 0
        phases = sum(figures[p] for p in request_host.PHASES)
        assert phases == pytest.approx(figures["ttft_ms"], rel=0.05, abs=0.05), kind
    assert measured["cpu"]["load"] > 0 and measured["device"]["load"] == 0
