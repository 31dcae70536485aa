from vllm.model_executor.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
