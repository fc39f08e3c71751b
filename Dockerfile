# gemmd's container image: the wheel with CuPy's CUDA libraries (the cuda12 extra), run as
# the non-root uid/gid 65532 the DaemonSet uses. The NVIDIA driver (libcuda, libnvidia-ml)
# comes from the node through the NVIDIA container runtime, not from the image.
#
#   make image                      # docker build -t gemmd:$(version) .
#   docker build --build-arg CUDA=cuda13 -t gemmd:0.1.0-cuda13 .
#
# Every Python package comes at the version pinned in requirements/image-${CUDA}.txt (the
# build backend too), so a rebuild gives the same image; `make lock` moves the pins.
#
# The base is pinned by digest (python:3.12-slim's multi-platform index), so a rebuild
# starts from the same bytes; `make image-base` resolves the tag's current digest when
# moving it on purpose. No registry is reachable from where this file is tested: a digest
# that no longer resolves fails the build at its first line, never silently.
ARG BASE=python:3.12-slim@sha256:78387bc3881b8273120a12ebe6c1ab22b018ccc2c9adf565ae1ac9b536e184ea

FROM ${BASE} AS wheel
ARG CUDA=cuda12
WORKDIR /src
COPY requirements/image-${CUDA}.txt /tmp/constraints.txt
COPY pyproject.toml README.md LICENSE ./
COPY gemmd ./gemmd
RUN PIP_CONSTRAINT=/tmp/constraints.txt pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${BASE}
ARG CUDA=cuda12
# What the image is, for registries and `docker inspect` (OCI image-spec annotations).
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="gemmd" \
      org.opencontainers.image.description="Scheduled GEMM probes on every GPU, measured vs predicted, as Prometheus metrics (${CUDA})" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.12-slim"
COPY --from=wheel /dist/ /tmp/dist/
COPY requirements/image-${CUDA}.txt /tmp/constraints.txt
RUN set -eu; \
    PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir "$(ls /tmp/dist/gemmd_gpu-*.whl)[${CUDA}]"; \
    rm -rf /tmp/dist /tmp/constraints.txt; \
    mkdir -p /etc/gemmd /var/lib/gemmd /var/cache/gemmd; \
    chown 65532:65532 /var/lib/gemmd /var/cache/gemmd; \
    chmod 0700 /var/lib/gemmd
COPY gemmd.yaml /etc/gemmd/gemmd.yaml
# CuPy's kernel cache; the state directory (store, models) is a volume in production.
ENV CUPY_CACHE_DIR=/var/cache/gemmd/cupy \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
EXPOSE 9477
# /-/healthy answers without rendering metrics or credentials (no curl in the slim image:
# Python's urllib). Plain HTTP, else HTTPS when listen.web_config_file turns TLS on (the
# certificate is not verified: this only asks the process on this host whether it serves).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import ssl, sys, urllib.request as r\nfor s in ('http', 'https'):\n    try:\n        r.urlopen(s + '://127.0.0.1:9477/-/healthy', timeout=2, context=ssl._create_unverified_context() if s == 'https' else None)\n        sys.exit(0)\n    except Exception:\n        pass\nsys.exit(1)"]
ENTRYPOINT ["gemmd"]
CMD ["run", "--config", "/etc/gemmd/gemmd.yaml", "--state-dir", "/var/lib/gemmd"]
