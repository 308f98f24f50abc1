# The pdctl image: the gateway, `pdctl verify` and simulated workers (`engine = "sim"`) in Kubernetes.
# vLLM workers run the official vllm/vllm-openai image instead; this one holds no vLLM.
#
#   docker build -t pdctl:0.1.0 .
#   docker tag pdctl:0.1.0 REGISTRY/pdctl:0.1.0 && docker push REGISTRY/pdctl:0.1.0
#   pdctl render k8s --pdctl-image REGISTRY/pdctl:0.1.0 ...
#
# See docs/multi-node.md ("Kubernetes").
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdctl ./pdctl
RUN pip install . && rm -rf /src

# Any UID works (OpenShift); HOME must be writable for caches.
ENV HOME=/tmp
USER 65532
WORKDIR /tmp
ENTRYPOINT []
CMD ["pdctl", "--help"]
