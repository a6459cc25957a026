"""cuDNN-frontend SDPA graphs (forward/backward builders, the graph cache, the backend)."""
