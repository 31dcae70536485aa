"""`UniProcExecutor`: the one worker of a single-rank engine, in the engine's own process."""

from __future__ import annotations

from typing import Any

from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.worker_wrapper import WorkerCall, WorkerWrapper


class UniProcExecutor(Executor):
    """Calls the worker directly; a worker exception propagates unchanged (its own type).

    No process, no torch.distributed group: with one rank the parallel layers
    run no collective. `timeout` is not enforced (the call runs in this thread).
    """

    def _init_executor(self) -> None:
        if self.world_size != 1:
            raise ValueError(
                f"the 'uni' executor runs one rank; world size {self.world_size} needs "
                "distributed_executor_backend 'mp' or 'ray'"
            )
        self.driver = WorkerWrapper(rank=0)
        self.driver.init_worker(
            self.worker_cls,
            {
                "vllm_config": self.vllm_config,
                "local_rank": 0,
                "rank": 0,
                "distributed_init_method": None,
                "is_driver_worker": True,
            },
        )

    def _collective_rpc(self, call: WorkerCall) -> list[Any]:
        return [call.run(self.driver)]

    def shutdown(self) -> None:
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.shutdown()
