"""deploy/grafana/kvstrata.json queries only series a server exports: every metric name in its queries is in a
scrape of the server's metrics over a real engine's stats (a small engine with random weights and a disk tier)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.async_engine import EngineSnapshot
from kvstrata.serving.metrics import ServingMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "kvstrata.json"
METRIC_NAME = re.compile(r"\b(vllm:[a-z0-9_:]+|kvstrata_[a-z0-9_]+)")


def queries(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return exprs + [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]


def exported_sample_names(tmp_path: Path) -> set[str]:
    config = load_config({"model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "threads": 1},
                          "cache": {"tiers": {"device": {"size": 64}, "cpu": {"size": "8MiB"},
                                              "disk": {"path": str(tmp_path / "kv"), "size": "16MiB"}}}})
    with LLM(config) as llm:
        llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2, temperature=0.0))
        stats = llm.stats()
    metrics = ServingMetrics(lambda: EngineSnapshot(stats=stats, num_running=0, num_waiting=0), model_name="m",
                             max_model_len=stats["max_model_len"])
    return {line.split("{")[0].split(" ")[0] for line in metrics.render().decode().splitlines()
            if line and not line.startswith("#")}


@pytest.mark.slow
def test_every_series_the_dashboard_queries_is_one_the_server_exports(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    named = {name for expr in queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert any(n.startswith("vllm:") for n in named) and any(n.startswith("kvstrata_") for n in named)
    missing = named - exported_sample_names(tmp_path)
    assert not missing, f"the dashboard queries series the server does not export: {sorted(missing)}"


def test_every_panel_has_a_query_and_a_place():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(panel["targets"] for panel in dashboard["panels"])
    assert all(target["expr"].strip() for panel in dashboard["panels"] for target in panel["targets"])
