"""`KVConnectorFactory`: a connector class by the name in `KVTransferConfig.kv_connector`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

# name -> (module, class); imported lazily (NIXL is only loaded when asked for).
_REGISTRY: dict[str, tuple[str, str]] = {
    "OffloadingConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"
    ),
    "NixlConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlConnector"
    ),
}


class KVConnectorFactory:
    @staticmethod
    def registered_names() -> tuple[str, ...]:
        return tuple(_REGISTRY)

    @staticmethod
    def get_connector_class(name: str) -> type[KVConnectorBase_V1]:
        """Raises ValueError for a name that is not registered (lists the known ones)."""
        if name not in _REGISTRY:
            raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(_REGISTRY)}")
        module, cls = _REGISTRY[name]
        return getattr(importlib.import_module(module), cls)

    @staticmethod
    def create_connector(vllm_config: VllmConfig, role: KVConnectorRole) -> KVConnectorBase_V1:
        """The configured connector for `role`.

        Raises:
            ValueError: no connector configured, or an unknown name.
        """
        kv = vllm_config.kv_transfer_config
        if kv is None or kv.kv_connector is None:
            raise ValueError("no kv_transfer_config with a kv_connector is set")
        return KVConnectorFactory.get_connector_class(kv.kv_connector)(vllm_config, role)
