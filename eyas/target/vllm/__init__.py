"""vLLM as a target backend (target.backend=vllm): an engine that extracts hidden states, and capture through it.

vLLM is optional: nothing here imports it at import time; eyas.target.vllm.engine.require_vllm names the
install command when it is missing. eyas.target.vllm.connector is imported by vLLM's workers only.
"""
