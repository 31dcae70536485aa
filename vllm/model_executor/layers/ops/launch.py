"""Launch a Triton kernel on its compiled handle once its specialisation is known.

`kernel[grid](*args)` goes through Triton's JIT dispatch on every call: it
binds the arguments, rebuilds the specialisation key (each integer's value 1 /
divisibility by 16, each pointer's alignment), formats the options into a
string and looks the kernel up. On the H200's host that costs ~27 us a launch
(2026-12-04: `greedy_argmax`'s two launches 75 us against 15 us through their
compiled handles, the device busy, Triton 3.6), more than the device time of
the small kernels an eager decode step launches. `CompiledLaunches` keeps the
`CompiledKernel` that the first call of each specialisation returns and calls
it directly afterwards (`CompiledKernel[grid](*args, stream=...)`, the launch
Triton's own dispatch ends with), so the dispatch runs once per key.

The caller names the specialisation: its key must change whenever Triton's
would (dtypes, the integer arguments Triton specialises on, a pointer that may
be misaligned), or a call would run a kernel compiled for other arguments.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime import driver


class CompiledLaunches:
    """One kernel's compiled variants by the caller's specialisation key.

    Args:
        kernel: a `@triton.jit` function.
    """

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        self._compiled: dict[Hashable, CompiledKernel] = {}

    def __call__(self, key: Hashable, grid: tuple[int, ...], args: Sequence[object],
                 device: torch.device, num_warps: int) -> None:
        """Launch `kernel[grid](*args, num_warps=num_warps)` on the current stream.

        Args:
            key: determines Triton's specialisation for `args` (see the module).
            grid: 1 to 3 program counts.
            args: every kernel argument in order, constexprs included.
            device: the device the tensors are on (part of the caller's key; the
                launch goes to the current device's current stream, as Triton's does).
            num_warps: the launch option of the first call; part of the variant.
        """
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)
            if isinstance(compiled, CompiledKernel):  # None under TRITON_INTERPRET
                self._compiled[key] = compiled
            return
        grid3 = (*grid, 1, 1)[:3]
        # The stream of the current device, as Triton's dispatch uses (the first call
        # loaded the kernel there); tensors on another device would fail the same way.
        current = driver.active.get_current_device()
        compiled[grid3](*args, stream=driver.active.get_current_stream(current))
