"""Summit's runtime: what runs inside Ray Serve replicas. Only deployments/engine/ imports vLLM internals."""
