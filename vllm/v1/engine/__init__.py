"""Types that cross from the engine core to the frontends (torch-free).

`FinishReason` and `EngineCoreOutput` live in `vllm/v1/outputs.py`, where the
core (scheduler, request) can import them without reaching up into the
engine; they are re-exported here under vLLM's import path.
"""

from vllm.v1.outputs import EngineCoreOutput, FinishReason

__all__ = ["EngineCoreOutput", "FinishReason"]
