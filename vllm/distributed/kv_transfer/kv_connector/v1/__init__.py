"""vLLM V1's connector API (`base.py`) and the connectors this engine implements."""
