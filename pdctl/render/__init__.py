"""Files for other systems, from the same two files: Kubernetes manifests, Prometheus and Grafana files, peer
routers' command lines."""
