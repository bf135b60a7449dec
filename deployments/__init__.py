"""Ray Serve deployments of Summit. Only vllm_adapter.py imports vLLM internals."""
