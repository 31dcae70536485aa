"""Parallel groups over torch.distributed (NCCL on GPUs, gloo on the CPU); see parallel_state.py."""

from vllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.distributed.utils import get_distributed_init_method, get_open_port

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_distributed_init_method",
    "get_open_port",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
