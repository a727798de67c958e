# The gateway image: aiohttp + the tokenizer stack, no torch (a few hundred MB, starts in ~2 s).
#   docker build -f deploy/docker/gateway.Dockerfile -t jitney-gateway .      (from the repo root)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
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
# The project's own dependencies, read from pyproject.toml (one list), minus the model side:
# the gateway only tokenizes, so torch and the GGUF/plotting stack stay out.
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; skip = ('torch', 'accelerate', 'gguf', 'matplotlib'); print('\n'.join(d for d in deps if not d.startswith(skip)))" > /tmp/gateway-requirements.txt \
 && pip install -r /tmp/gateway-requirements.txt \
 && pip install --no-deps .

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 jitney \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/jitney --create-home jitney
COPY --from=builder /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /usr/local/bin/jitney-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    JITNEY_HOST=0.0.0.0 \
    JITNEY_PORT=8000
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "/usr/local/bin/jitney-healthcheck", "JITNEY_PORT", "8000", "/health"]
ENTRYPOINT ["jitney"]
CMD ["gateway"]
