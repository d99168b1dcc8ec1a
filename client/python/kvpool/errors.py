# SPDX-License-Identifier: Apache-2.0
"""Exceptions: one class per KVP_E* code of common/kvp_error.h, all under KvpoolError.

Every exception carries .code (the negative KVP_E* integer, or -errno for a failed connect),
.name (kvp_errname: "KVP_ENOSPC", "ECONNREFUSED") and the message of kvp_client_last_error.
"""
import errno as _errno
from typing import Optional, Type

# The codes of common/kvp_error.h (kept equal by tests/python: every one is checked against
# kvp_errname of the loaded library).
KVP_EINVAL = -1000
KVP_ENOMEM = -1001
KVP_ENOSPC = -1002
KVP_ENOENT = -1003
KVP_EEXIST = -1004
KVP_ELIMIT = -1005
KVP_ERANGE = -1006
KVP_EAUDIT = -1007
KVP_EDUPSEQ = -1008
KVP_EBUSY = -1009
KVP_EPERM = -1010
KVP_EUNAVAIL = -1011
KVP_EPRECOND = -1012
KVP_EINTERNAL = -1013
KVP_ETIMEDOUT = -1014
KVP_EPROTO = -1015
KVP_ECLOSED = -1016
KVP_EGEOM_NUM_LAYERS = -1100
KVP_EGEOM_NUM_PAGES = -1101
KVP_EGEOM_PAGE_SIZE = -1102
KVP_EGEOM_NUM_KV_HEADS = -1103
KVP_EGEOM_HEAD_DIM = -1104
KVP_EGEOM_DTYPE = -1105
KVP_EGEOM_LAYOUT = -1106
KVP_EGEOM_STORAGE = -1107
KVP_EGEOM_NUM_DEVICES = -1108
KVP_EGEOM_TOO_LARGE = -1109
KVP_EGEOM_NULL = -1110

CODES = {k: v for k, v in globals().items() if k.startswith("KVP_E")}
_NAMES = {v: k for k, v in CODES.items()}


class KvpoolError(Exception):
    """A failed libkvpool call. .code: the KVP_E* code (or -errno); .name: its symbolic name."""

    def __init__(self, code: int, message: str = "", name: Optional[str] = None) -> None:
        self.code = int(code)
        self.name = name or errname(self.code)
        self.message = message or ""
        super().__init__(self.code, self.message)

    def __str__(self) -> str:
        return "%s (%d): %s" % (self.name, self.code, self.message or strerror(self.code))


class InvalidArgument(KvpoolError, ValueError):
    """KVP_EINVAL: an argument is malformed (the daemon's INVALID_ARGUMENT)."""


class OutOfMemory(KvpoolError, MemoryError):
    """KVP_ENOMEM: host memory allocation failed."""


class ResourceExhausted(KvpoolError):
    """KVP_ENOSPC: not enough free pages in the pool (or the namespace's page quota)."""


class NotFound(KvpoolError, LookupError):
    """KVP_ENOENT: no such sequence (or buffer)."""


class AlreadyExists(KvpoolError):
    """KVP_EEXIST: the sequence already exists (e.g. a fork's child)."""


class LimitExceeded(KvpoolError):
    """KVP_ELIMIT: a configured limit (sequences, batch, tokens) or an array capacity."""


class OutOfRange(KvpoolError, IndexError):
    """KVP_ERANGE: a position, page id or index lies outside its range."""


class AuditFailed(KvpoolError):
    """KVP_EAUDIT: the daemon's audit found a broken invariant."""


class DuplicateSequence(InvalidArgument):
    """KVP_EDUPSEQ: the same sequence appears twice in one batch."""


class Busy(KvpoolError):
    """KVP_EBUSY: the object is in use."""


class PermissionDenied(KvpoolError, PermissionError):
    """KVP_EPERM: the caller may not do this (credentials, namespace owner)."""


class Unavailable(KvpoolError):
    """KVP_EUNAVAIL: the daemon is draining or unhealthy, or the feature is not built in."""


class FailedPrecondition(KvpoolError):
    """KVP_EPRECOND: the call is valid but the state does not allow it."""


class InternalError(KvpoolError):
    """KVP_EINTERNAL: a bug or a backend failure inside the daemon."""


class Timeout(KvpoolError, TimeoutError):
    """KVP_ETIMEDOUT: no answer within the handle's timeout (the connection is closed)."""


class ProtocolError(KvpoolError):
    """KVP_EPROTO: malformed frame or message, protocol version mismatch."""


class ConnectionClosed(KvpoolError, ConnectionError):
    """KVP_ECLOSED: the connection is closed (the daemon went away)."""


class GeometryError(InvalidArgument):
    """KVP_EGEOM_*: a bad pool geometry field."""


class DaemonUnreachable(KvpoolError, ConnectionError):
    """-errno from connect (ENOENT: no socket, ECONNREFUSED: no daemon listening, ...)."""


_BY_CODE = {
    KVP_EINVAL: InvalidArgument,
    KVP_ENOMEM: OutOfMemory,
    KVP_ENOSPC: ResourceExhausted,
    KVP_ENOENT: NotFound,
    KVP_EEXIST: AlreadyExists,
    KVP_ELIMIT: LimitExceeded,
    KVP_ERANGE: OutOfRange,
    KVP_EAUDIT: AuditFailed,
    KVP_EDUPSEQ: DuplicateSequence,
    KVP_EBUSY: Busy,
    KVP_EPERM: PermissionDenied,
    KVP_EUNAVAIL: Unavailable,
    KVP_EPRECOND: FailedPrecondition,
    KVP_EINTERNAL: InternalError,
    KVP_ETIMEDOUT: Timeout,
    KVP_EPROTO: ProtocolError,
    KVP_ECLOSED: ConnectionClosed,
}


def exception_class(code: int) -> Type[KvpoolError]:
    """The KvpoolError subclass for a code."""
    code = int(code)
    if code in _BY_CODE:
        return _BY_CODE[code]
    if KVP_EGEOM_NULL <= code <= KVP_EGEOM_NUM_LAYERS:
        return GeometryError
    if -4096 < code < 0:
        return DaemonUnreachable
    return KvpoolError


def error(code: int, message: str = "") -> KvpoolError:
    """The exception (not raised) for a code and message."""
    return exception_class(code)(code, message)


def _lib_or_none():
    from . import _lib

    try:
        return _lib.load()
    except (OSError, ImportError):  # none found, or LibraryMismatch: the table's names
        return None


def errname(code: int) -> str:
    """kvp_errname of the library when it is loadable, else the same names from this table."""
    lib = _lib_or_none()
    if lib is not None:
        return lib.kvp_errname(int(code)).decode()
    if code in _NAMES:
        return _NAMES[code]
    if -4096 < code < 0:
        return _errno.errorcode.get(-code, "ERRNO")
    return "UNKNOWN"


def strerror(code: int) -> str:
    lib = _lib_or_none()
    if lib is not None:
        return lib.kvp_strerror(int(code)).decode()
    if -4096 < code < 0 and code not in _NAMES:
        import os

        return os.strerror(-code)
    return _NAMES.get(code, "unknown error")
