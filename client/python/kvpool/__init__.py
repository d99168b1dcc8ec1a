# SPDX-License-Identifier: Apache-2.0
"""kvpool: Python client of the kvpoold KV-cache daemon, over libkvpool (ctypes).

The host backend's pool is exposed as per-layer NumPy views that alias the daemon's memory; the
cuda backend's as PyTorch CUDA tensors over the pool mapped in this process (kvpool._torch,
imported only then: `import kvpool` needs NumPy, never PyTorch). libkvpool.so is loaded on
first use ($KVPOOL_LIB when set; else the copy the wheel carries next to the package, the
source tree's build/client/, or the system's) and checked then (its version and ABI must be
this package's: LibraryMismatch otherwise), so the NumPy helpers work without it.
"""
from ._lib import ABI_VERSION, KVP_LEASE_DEFAULT, PACKAGE_VERSION, LibraryMismatch, library_path
from .client import (
    CachedBlock,
    CacheSnapshot,
    CacheStats,
    Client,
    Commit,
    Load,
    PageTable,
    Pin,
    PoolInfo,
    Stats,
    Ticket,
    TierHit,
    TransferInfo,
    default_socket,
)
from .codes import DTYPES, Backend, BufferKind, DType, Layout, Storage
from .errors import (
    AlreadyExists,
    AuditFailed,
    Busy,
    ConnectionClosed,
    DaemonUnreachable,
    DuplicateSequence,
    FailedPrecondition,
    GeometryError,
    InternalError,
    InvalidArgument,
    KvpoolError,
    LimitExceeded,
    NotFound,
    OutOfMemory,
    OutOfRange,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    Timeout,
    Unavailable,
    exception_class,
)
from .paged import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens

# the project() line of CMakeLists.txt, through the wheel's generated kvpool/_version.py (or,
# for the source tree's copy, that line itself); libkvpool must report the same (load time)
__version__ = PACKAGE_VERSION

__all__ = [
    "Client", "PageTable", "PoolInfo", "Stats", "Ticket", "TransferInfo", "default_socket",
    "CacheStats", "CachedBlock", "CacheSnapshot", "Commit", "Pin", "TierHit", "Load", "Backend", "DType", "Layout", "Storage", "BufferKind",
    "DTYPES",
    "library_path", "LibraryMismatch", "ABI_VERSION",
    "KVP_LEASE_DEFAULT", "append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens",
    "KvpoolError", "InvalidArgument", "OutOfMemory", "ResourceExhausted", "NotFound",
    "AlreadyExists", "LimitExceeded", "OutOfRange", "AuditFailed", "DuplicateSequence", "Busy",
    "PermissionDenied", "Unavailable", "FailedPrecondition", "InternalError", "Timeout",
    "ProtocolError", "ConnectionClosed", "GeometryError", "DaemonUnreachable", "exception_class",
]
