"""Summit: serve large open LLMs with vLLM on Ray Serve."""
