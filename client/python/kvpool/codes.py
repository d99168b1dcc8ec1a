# SPDX-License-Identifier: Apache-2.0
"""The integer codes of kvpool.h as IntEnums, and the one table of the pool's element types.

PoolInfo's backend, dtype, layout and storage are these enums (an IntEnum equals its integer,
so code written against the raw numbers still compares true). DTYPES is the only place that
says what a dtype code is in NumPy and in PyTorch; every view, append and integration reads it.
Nothing here imports torch: a torch dtype is looked up by name, on use (torch_dtype()).
"""
import enum
from typing import Dict, NamedTuple, Type, TypeVar, Union

import numpy as np

__all__ = ["Backend", "DType", "Layout", "Storage", "BufferKind", "DTypeInfo", "DTYPES",
           "torch_dtype", "code"]


class Backend(enum.IntEnum):
    """kvp_pool_info_t.backend: where the daemon keeps the pool."""

    HOST = 0  # a memfd in host memory: NumPy views
    CUDA = 1  # GPU memory (CUDA VMM): PyTorch CUDA tensors


class DType(enum.IntEnum):
    """kvp_pool_info_t.dtype (kvcache/kvp_geom.h)."""

    FP8_E4M3 = 1
    FP8_E5M2 = 2
    FP16 = 3
    BF16 = 4
    FP32 = 5


class Layout(enum.IntEnum):
    """kvp_pool_info_t.layout: the order of a page's axes."""

    NHD = 0  # [page_size, H, D]
    HND = 1  # [H, page_size, D]


class Storage(enum.IntEnum):
    """kvp_pool_info_t.storage: K and V of a page side by side, or in two tensors."""

    COMBINED = 0
    SPLIT = 1


class BufferKind(enum.IntEnum):
    """kvp_client_register_fd's kind."""

    MEMFD = 0  # sealed against shrinking
    CUDA_VMM_FD = 1


class DTypeInfo(NamedTuple):
    """One element type: its name (the daemon's --dtype), size, the NumPy dtype of a host view
    (NumPy has no bf16 or fp8: those are shown raw, as unsigned integers of the element size)
    and the name of its torch dtype (the cuda views' dtype, and what a transformers model
    computes in)."""

    name: str
    elem_bytes: int
    numpy: Type[np.generic]
    torch_name: str


DTYPES: Dict[DType, DTypeInfo] = {
    DType.FP8_E4M3: DTypeInfo("fp8_e4m3", 1, np.uint8, "float8_e4m3fn"),
    DType.FP8_E5M2: DTypeInfo("fp8_e5m2", 1, np.uint8, "float8_e5m2"),
    DType.FP16: DTypeInfo("fp16", 2, np.float16, "float16"),
    DType.BF16: DTypeInfo("bf16", 2, np.uint16, "bfloat16"),
    DType.FP32: DTypeInfo("fp32", 4, np.float32, "float32"),
}


def torch_dtype(dtype: int):
    """The torch dtype of a dtype code (imports torch)."""
    import torch

    return getattr(torch, DTYPES[DType(dtype)].torch_name)


E = TypeVar("E", bound=enum.IntEnum)


def code(enum_type: Type[E], value: int) -> Union[E, int]:
    """value as a member of enum_type, or the plain int when the enum has no such member (a
    newer daemon's code: shown, never refused)."""
    try:
        return enum_type(int(value))
    except ValueError:
        return int(value)
