"""WeightArena: the model's parameters in one VMM reservation, so sleep keeps their addresses.

    arena (one ExtensibleTensor segment, committed in one call)
    | p0 | pad | p1 | pad | p2 | ...              each parameter 256-byte aligned
      ^ param.data views the arena: CUDA graphs and kernels see these addresses

Sleep level 1 copies the arena to host memory (pinned on CUDA) and releases
its pages; level 2 releases them without a copy, and from then on the arena's
bytes are not the model's weights (`needs_load`) until the caller loads them
and says so (`mark_loaded`): a wake that fails part-way (the weights mapped,
the KV cache not) and is retried must still reload them, so the flag follows
the bytes, not the one wake call that mapped them. Wake maps fresh pages at the
same addresses (and, after level 1, copies the bytes back), so CUDA graphs
captured before the sleep replay unchanged. Buffers (rope tables) are small
and deterministic; they stay where they are.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.device_allocator.vmm import VmmDriver
from vllm.utils.extensible_tensor import ExtensibleTensor

_ALIGN = 256  # bytes; covers every dtype's alignment and vectorised loads


class WeightArena:
    """Moves a model's parameters into one reservation and sleeps/wakes them.

    Args:
        model: its parameters are moved (param.data rebound); tied parameters
            (one Parameter object in two modules) are moved once.
        driver: the platform's VMM driver (probe passed).

    Raises:
        VmmError: the arena could not be reserved or committed.
    """

    def __init__(self, model: nn.Module, driver: VmmDriver) -> None:
        params = list(dict.fromkeys(model.parameters()))  # unique, in order
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        self.nbytes = total
        self.tensor = ExtensibleTensor([max(total, 1)], driver)
        self.tensor.grow_segments_([total], zero_new=False)
        arena = self.tensor.full_view()
        for p, off in zip(params, offsets, strict=True):
            nbytes = p.numel() * p.element_size()
            view = arena[off : off + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
        self._host: torch.Tensor | None = None
        self.needs_load = False  # True from a level-2 sleep until mark_loaded()

    @property
    def physical_bytes(self) -> int:
        return self.tensor.physical_bytes

    @property
    def released_bytes(self) -> int:
        """Bytes a wake maps (0 while awake)."""
        return self.tensor.released_bytes

    @property
    def is_sleeping(self) -> bool:
        return self.tensor.is_released

    def sleep(self, keep_on_host: bool) -> None:
        """Release the device pages; with `keep_on_host` copy the bytes to host first."""
        if self.is_sleeping:
            return
        if keep_on_host:
            device = self.tensor.device
            pin = device.type == "cuda"
            if self._host is None:
                self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
            self._host.copy_(self.tensor.full_view()[: self.nbytes])
        else:
            self._host = None
            self.needs_load = True
        self.tensor.release_physical()

    def wake_up(self) -> bool:
        """Map fresh pages at the same addresses; returns True if the weights must be loaded.

        After a level-1 sleep the host copy is written back (returns False).
        After a level-2 sleep nothing was kept: the pages are zero and the
        caller must load weights, then call `mark_loaded` (returns True, on
        every call until then, awake already or not).

        Raises:
            VmmError: the device has no room (nothing stays mapped; call again later).
        """
        if not self.is_sleeping:
            return self.needs_load
        self.tensor.recommit_(zero_new=self._host is None)
        if self._host is None:
            return self.needs_load
        self.tensor.full_view()[: self.nbytes].copy_(self._host)
        if not self._host.is_pinned():
            # A plain host copy (CPU platform) is freed; a pinned one is kept for
            # the next sleep, since pinning gigabytes takes seconds.
            self._host = None
        return False

    def mark_loaded(self) -> None:
        """The caller has written the model's weights into the (awake) arena."""
        self.needs_load = False

    def free(self) -> None:
        self.tensor.free()
        self._host = None
