"""Tensors over raw addresses: a uint8 view of `nbytes` at `va` on a given device.

Built as a DLPack capsule with ctypes (legacy, unversioned DLPack ABI; see
https://dmlc.github.io/dlpack/latest/c_api.html) and handed to
`torch.utils.dlpack.from_dlpack`. DLPack names the device explicitly, so torch
makes no pointer query (`cudaPointerGetAttributes`) on the address, which matters
for a VMM reservation whose pages may not be mapped yet; `__cuda_array_interface__`
would make that query.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.utils.dlpack

_KDL_CPU, _KDL_CUDA, _KDL_ROCM, _KDL_UINT = 1, 2, 10, 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DLDeleter)]


_dlpack_alive: dict[int, tuple[Any, ...]] = {}  # struct address -> what must outlive torch's use


@_DLDeleter
def _dlpack_deleter(address: int) -> None:
    _dlpack_alive.pop(address, None)


_DLTENSOR_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def dlpack_tensor(va: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """uint8 tensor `[nbytes]` at `va` on `device` via a DLPack capsule; no pointer query.

    `owner` stays alive until torch frees the tensor's storage (the DLPack deleter).
    """
    if device.type == "cpu":
        dl_type, dl_id = _KDL_CPU, 0
    else:
        dl_type = _KDL_ROCM if torch.version.hip is not None else _KDL_CUDA
        dl_id = device.index if device.index is not None else torch.cuda.current_device()
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        va, _DLDevice(dl_type, dl_id), 1, _DLDataType(_KDL_UINT, 8, 1),
        ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0,
    )
    managed.deleter = _dlpack_deleter
    address = ctypes.addressof(managed)
    _dlpack_alive[address] = (managed, shape, strides, owner)
    try:
        capsule = _capsule_new(address, _DLTENSOR_NAME, None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _dlpack_alive.pop(address, None)
        raise
