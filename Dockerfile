# The pdctl image: the gateway, `pdctl verify` and simulated workers (`engine = "sim"`), for Kubernetes
# (`pdctl render k8s`) and Docker Compose (`pdctl render compose`). vLLM workers run the official
# vllm/vllm-openai image instead; this one holds no vLLM.
#
#   docker build -t pdctl:0.1.0 .
#   docker tag pdctl:0.1.0 REGISTRY/pdctl:0.1.0 && docker push REGISTRY/pdctl:0.1.0
#   pdctl render k8s --pdctl-image REGISTRY/pdctl:0.1.0 ...
#
# BASE_IMAGE: any Debian-like image with python3 (>= 3.11) and its venv module. Without a registry,
# scripts/build-image.sh makes one with debootstrap and builds from a wheelhouse (a `wheels/` folder in the
# build context is installed from, offline). See docs/multi-node.md ("The pdctl image").
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/pdctl/bin:$PATH
COPY . /src
# `python` and `pdctl` on PATH are the venv's, on any base (Debian's own python3 has no `python` and no pip).
RUN python3 -m venv /opt/pdctl \
    && if [ -d /src/wheels ]; then pip install --no-index --find-links /src/wheels pdctl; else pip install /src; fi \
    && rm -rf /src

# Any UID works (OpenShift); HOME must be writable for caches, and /tmp is the only place pdctl writes
# (mount a tmpfs there under a read-only root filesystem).
ENV HOME=/tmp
USER 65532
WORKDIR /tmp
ENTRYPOINT []
CMD ["pdctl", "--help"]
