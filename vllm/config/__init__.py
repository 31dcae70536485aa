"""Engine configuration: plain dataclasses, built by `EngineArgs` and validated once.

See README.md in this directory for what each config holds.
"""

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.device import DeviceConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.config.vllm import VllmConfig

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "DeviceConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "VllmConfig",
]
