"""Creating a NIXL agent (which wheel provides NIXL, a progress thread that sleeps) and
the descriptor lists NixlConnector prepares once per agent (`strided_rows`, `block_indices`).

NIXL's Python wrapper (`nixl_agent`, 1.5) builds its C++ agent config with
`pthrDelay = 0`: the UCX progress thread then polls its workers without
waiting, and an idle engine burns about half a CPU core (0.49-0.53 measured on
the 2-core CI machine, 2026-12-06; with a 1 ms delay 0.016, and a 32-layer
READ as fast). With a 1 ms delay an idle agent still used 0.021-0.024 of a
core on that machine while other processes loaded it (each wake-up costs more
then); 2 ms measured 0.011 (0.024 once under the full suite's load), with the
CPU load/READ tests of test_nixl_async_load.py as fast
(tests/distributed/kv_transfer/test_nixl_idle.py bounds it at 0.1: the spin's
0.5 with a margin, not the load's noise). `make_agent` creates the agent with the same
settings but a 2 ms poll timeout (`PROGRESS_DELAY_US`): the thread still wakes
at once on UCX events (it polls the workers' event descriptors) and at least every 2 ms for
transports that need periodic progress (TCP emulation of one-sided reads on
the CPU). Where the wrapper's internals differ (another NIXL release), the
wrapper's own constructor is used and a warning says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

if TYPE_CHECKING:
    import numpy as np

logger = init_logger(__name__)

PROGRESS_DELAY_US = 2000


def import_nixl():
    """The `nixl._api` module of whichever NIXL wheel is installed.

    Raises:
        ImportError: none is; the message names the PyPI packages.
    """
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise ImportError(
        "NixlConnector needs NIXL: pip install nixl-cu13 (or nixl-cu12 / nixl)"
    )


def make_agent(name: str, backends: list[str]) -> Any:
    """A `nixl_agent` named `name` with `backends` created, its progress thread
    polling with a `PROGRESS_DELAY_US` timeout instead of spinning."""
    api = import_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    try:
        config = api.nixlBind.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
        config.pthrDelay = PROGRESS_DELAY_US
        config.lthrDelay = 100_000
        config.captureTelemetry = False
        agent.agent = api.nixlBind.nixlAgent(name, config)
    except AttributeError as e:
        logger.warning("NIXL %s: cannot set the progress thread's poll timeout (%s); its "
                       "progress thread may keep a CPU core busy", name, e)
        return api.nixl_agent(name, api.nixl_agent_config(backends=backends))
    for backend in backends:
        agent.create_backend(backend, {})
    return agent


def strided_rows(layers: dict[str, tuple[int, int, int, int]], device_id: int) -> np.ndarray:
    """Nx5 rows (address, block bytes, device, stride, num_blocks), one per layer in
    name order: the prepared list whose index `layer * num_blocks + block` is that block."""
    import numpy as np

    return np.array([(base, page, device_id, stride, n)
                     for _, (base, stride, page, n) in sorted(layers.items())], dtype=np.uint64)


def block_indices(num_layers: int, num_blocks: int, block_ids: list[int]) -> np.ndarray:
    """Indices into a `strided_rows` list for `block_ids` of every layer, layer-major
    (int32, num_layers * len(block_ids))."""
    import numpy as np

    ids = np.asarray(block_ids, dtype=np.int64)
    rows = np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks + ids[None, :]
    return rows.ravel().astype(np.int32)
