"""Files for other systems, from the same two files: Kubernetes manifests, peer routers' command lines."""
