"""`DeviceConfig`: the device the engine runs on, from the current platform."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config.frozen import FrozenConfig


@dataclass
class DeviceConfig(FrozenConfig):
    """The device type the engine runs on.

    Attributes:
        device: "auto" (the platform's device), or the platform's device type
            ("cuda" / "cpu"); resolved to the type string.
        device_type: resolved torch device type (not an argument).

    Raises:
        ValueError: a device other than the platform's.
    """

    device: str = "auto"
    device_type: str = field(init=False, default="")

    def __post_init__(self) -> None:
        from vllm import platforms

        platform_type = platforms.current_platform.device_type
        if self.device not in ("auto", platform_type):
            raise ValueError(
                f"device {self.device!r} is not available: this process runs on the "
                f"{platforms.current_platform.device_name} platform (device 'auto' or "
                f"{platform_type!r})"
            )
        self.device = self.device_type = platform_type
