"""KV transfer: connectors that move KV cache blocks in and out of the engine (vLLM V1 API)."""
