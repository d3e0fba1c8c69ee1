"""Hand-made DLPack capsules (ctypes), to test the consumer against producers we do not have."""

from __future__ import annotations

import ctypes

import numpy as np


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


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


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_KEEP_ALIVE: list[object] = []

_CODES = {"i": 0, "u": 1, "f": 2}


def capsule_claiming_device(
    array: np.ndarray, device_type: int, device_id: int = 0, dtype_code: int | None = None
) -> object:
    """A legacy "dltensor" capsule over `array`'s memory that claims the given device.

    No deleter is set; the structures are kept alive for the test session.
    """
    shape = (ctypes.c_int64 * array.ndim)(*array.shape)
    strides = (ctypes.c_int64 * array.ndim)(*(s // array.itemsize for s in array.strides))
    code = _CODES[array.dtype.kind] if dtype_code is None else dtype_code
    managed = _DLManagedTensor()
    managed.dl_tensor.data = array.ctypes.data
    managed.dl_tensor.device = _DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = array.ndim
    managed.dl_tensor.dtype = _DLDataType(code, array.itemsize * 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.dl_tensor.byte_offset = 0
    managed.deleter = None
    _KEEP_ALIVE.extend([array, shape, strides, managed])
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new_capsule(ctypes.addressof(managed), b"dltensor", None)
