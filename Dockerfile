# gemmd's container image: the wheel with CuPy's CUDA libraries (the cuda12 extra), run as
# the non-root uid/gid 65532 the DaemonSet uses. The NVIDIA driver (libcuda, libnvidia-ml)
# comes from the node through the NVIDIA container runtime, not from the image.
#
#   make image                      # docker build -t gemmd:$(version) .
#   docker build --build-arg CUDA=cuda13 -t gemmd:0.1.0-cuda13 .
#
# Every Python package comes at the version pinned in requirements/image-${CUDA}.txt (the
# build backend too), so a rebuild gives the same image; `make lock` moves the pins.
ARG PYTHON=3.12

FROM python:${PYTHON}-slim AS wheel
ARG CUDA=cuda12
WORKDIR /src
COPY requirements/image-${CUDA}.txt /tmp/constraints.txt
COPY pyproject.toml README.md LICENSE ./
COPY gemmd ./gemmd
RUN PIP_CONSTRAINT=/tmp/constraints.txt pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:${PYTHON}-slim
ARG CUDA=cuda12
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
