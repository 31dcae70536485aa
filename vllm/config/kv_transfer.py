"""`KVTransferConfig`: which KV connector moves cache blocks in or out (`--kv-transfer-config`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.config.frozen import FrozenConfig

# Connectors this engine implements (their classes: kv_connector/factory.py); any
# other name is rejected rather than silently ignored.
KNOWN_KV_CONNECTORS: tuple[str, ...] = ("OffloadingConnector", "NixlConnector")
# kv_connector_extra_config keys each connector reads; others are rejected.
EXTRA_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "OffloadingConnector": ("cpu_bytes_to_use", "num_cpu_blocks"),
    "NixlConnector": ("side_channel_host", "side_channel_port", "backends", "abort_timeout_s",
                      "transfer_timeout_s", "liveness_timeout_s"),
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig(FrozenConfig):
    """The KV connector and its role (vLLM's `--kv-transfer-config` keys).

    Attributes:
        kv_connector: connector class name, or None for no KV transfer.
        kv_role: "kv_producer" | "kv_consumer" | "kv_both"; required with a connector.
        kv_connector_extra_config: connector-specific settings.

    Raises:
        ValueError: an unknown connector (lists the known ones), a bad role,
            unknown JSON keys, or JSON that does not parse.
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_connector not in KNOWN_KV_CONNECTORS:
            known = ", ".join(KNOWN_KV_CONNECTORS) or "none yet"
            raise ValueError(
                f"kv_connector {self.kv_connector!r} is not implemented by this engine "
                f"(known connectors: {known})"
            )
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_role must be set with kv_connector {self.kv_connector!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_connector_extra_config must be a JSON object, "
                f"got {self.kv_connector_extra_config!r}"
            )
        if self.kv_connector is not None:
            self._check_extra_config()

    def _check_extra_config(self) -> None:
        extra = self.kv_connector_extra_config
        allowed = EXTRA_CONFIG_KEYS[self.kv_connector]
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown keys {unknown} for "
                f"{self.kv_connector}; supported: {list(allowed)}"
            )
        for key in ("cpu_bytes_to_use", "num_cpu_blocks", "side_channel_port"):
            value = extra.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(
                    f"kv_connector_extra_config.{key} must be a positive integer, got {value!r}"
                )
        port = extra.get("side_channel_port")
        if isinstance(port, int) and port > 65535:
            raise ValueError(f"kv_connector_extra_config.side_channel_port must be a TCP port "
                             f"(1-65535), got {port}")
        backends = extra.get("backends")
        if backends is not None and (not isinstance(backends, list) or not backends
                                     or not all(isinstance(b, str) for b in backends)):
            raise ValueError("kv_connector_extra_config.backends must be a non-empty list of "
                             f"NIXL backend names (e.g. [\"UCX\"]), got {backends!r}")
        for key in ("abort_timeout_s", "transfer_timeout_s", "liveness_timeout_s"):
            value = extra.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ValueError(
                    f"kv_connector_extra_config.{key} must be a finite number of seconds > 0, "
                    f"got {value!r}"
                )
        if self.kv_connector == "OffloadingConnector":
            if self.kv_role != "kv_both":
                raise ValueError(
                    f"OffloadingConnector needs kv_role 'kv_both', got {self.kv_role!r}"
                )
            if ("cpu_bytes_to_use" in extra) == ("num_cpu_blocks" in extra):
                raise ValueError(
                    "OffloadingConnector needs exactly one of kv_connector_extra_config."
                    "cpu_bytes_to_use (host bytes for KV blocks) or num_cpu_blocks"
                )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        if not isinstance(values, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {values!r}")
        allowed = [f.name for f in fields(cls)]
        # Check the connector first: its message is the useful one.
        cls._check_connector_name(values.get("kv_connector"))
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; supported: {allowed}")
        return cls(**values)

    @classmethod
    def from_cli(cls, text: str) -> KVTransferConfig:
        """Parse the `--kv-transfer-config` JSON string."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config is not valid JSON ({e}): {text!r}") from e
        return cls.from_dict(values)

    @staticmethod
    def _check_connector_name(name: Any) -> None:
        if name is not None and name not in KNOWN_KV_CONNECTORS:
            KVTransferConfig(kv_connector=name, kv_role="kv_both")  # raises the message

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None
