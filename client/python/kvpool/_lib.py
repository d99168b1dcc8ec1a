# SPDX-License-Identifier: Apache-2.0
"""Locating and loading libkvpool.so, and ctypes declarations mirroring client/kvpool.h.

The structures below must match kvpool.h field for field. load() checks the library it found
before declaring anything: its kvp_client_version() must be this package's version, its
kvp_client_abi_version() ABI_VERSION, and kvp_client_sizeof() must give every mirrored struct
the size ctypes computes; otherwise it raises LibraryMismatch naming the library, its version
and the expected one. tests/python also checks the page-table round trips.
"""
import ctypes
import ctypes.util
import glob
import os
import re
import threading
from typing import List, Optional

# kvp_client_abi_version() of the libkvpool these declarations mirror (KVP_ABI_VERSION of
# CMakeLists.txt: libkvpool.so.N); raised together with it when a struct or prototype changes.
ABI_VERSION = 1


def _package_version() -> str:
    """This package's version, from the project() line of CMakeLists.txt (the only place it is
    written): kvpool/_version.py, generated into the wheel by scikit-build-core; else, for the
    source tree's copy (PYTHONPATH=client/python), that line itself; else the installed
    distribution's metadata."""
    try:
        from ._version import __version__ as v  # type: ignore[import-not-found]

        return str(v)
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    top = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), "CMakeLists.txt")
    try:
        with open(top, encoding="utf-8") as f:
            m = re.search(r"^project\(kvpool\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)", f.read(),
                          re.MULTILINE)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        from importlib import metadata

        return metadata.version("kvpool")
    except Exception:  # not installed either
        return "0+unknown"


PACKAGE_VERSION = _package_version()


class LibraryMismatch(ImportError):
    """The libkvpool.so found is not the one this package mirrors (another version, another ABI,
    a struct of another size, or a library without kvp_client_version: an older build).
    .path: the library; .found: its version ("unknown" without kvp_client_version);
    .expected: this package's version."""

    def __init__(self, path: str, found: str, reason: str) -> None:
        self.path = path
        self.found = found
        self.expected = PACKAGE_VERSION
        super().__init__(
            "%s (libkvpool version %s) is not the library the kvpool package %s needs "
            "(libkvpool %s, ABI %d): %s. Reinstall the package (pip install --force-reinstall "
            "./client/python: the wheel carries its libkvpool), or set KVPOOL_LIB to a "
            "libkvpool.so of version %s (build/client/libkvpool.so of the same source tree, "
            "rebuilt)"
            % (path, found, PACKAGE_VERSION, PACKAGE_VERSION, ABI_VERSION, reason,
               PACKAGE_VERSION),
            path=path)

KVP_CLIENT_MAX_DEVICES = 16
KVP_LEASE_DEFAULT = 0xFFFFFFFF  # UINT32_MAX: the Hello carries no lease (daemon's default)

_u32 = ctypes.c_uint32
_u64 = ctypes.c_uint64
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_p_i32 = ctypes.POINTER(ctypes.c_int32)
_p_u32 = ctypes.POINTER(ctypes.c_uint32)
_p_u64 = ctypes.POINTER(ctypes.c_uint64)


class kvp_client_opts_t(ctypes.Structure):
    _fields_ = [
        ("socket_path", ctypes.c_char_p),
        ("ns", ctypes.c_char_p),
        ("client_name", ctypes.c_char_p),
        ("lease_ms", _u32),
        ("timeout_ms", _u32),
        ("map_pool", ctypes.c_int),
        ("busy_poll_us", _u32),
        ("observer", ctypes.c_int),
        ("cache_scope", ctypes.c_char_p),
    ]


class kvp_pool_info_t(ctypes.Structure):
    _fields_ = [
        ("num_layers", _u32),
        ("num_pages", _u32),
        ("page_size", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
        ("dtype", _u32),
        ("layout", _u32),
        ("storage", _u32),
        ("num_devices", _u32),
        ("backend", _u32),
        ("elem_bytes", _u32),
        ("heads_per_device", _u32),
        ("pool_bytes", _u64),
        ("layer_bytes", _u64),
        ("v_offset_bytes", _u64),
        ("stride_page", _i64),
        ("stride_n", _i64),
        ("stride_h", _i64),
        ("map_granularity", _u64),
        ("device_ids", _i32 * KVP_CLIENT_MAX_DEVICES),
    ]


class kvp_page_table_t(ctypes.Structure):
    _fields_ = [
        ("kv_indptr", _p_i32),
        ("kv_indices", _p_i32),
        ("kv_last_page_len", _p_i32),
        ("append_indptr", _p_i32),
        ("seq_lens", _p_i32),
        ("copies", _p_u32),
        ("cap_batch", _u32),
        ("cap_indices", _u32),
        ("cap_copies", _u32),
        ("batch_size", _u32),
        ("nnz", _u32),
        ("num_indices", _u32),
        ("num_copies", _u32),
        ("cached_tokens", _p_u32),
    ]


class kvp_source_t(ctypes.Structure):
    _fields_ = [
        ("buffer_id", _u32),
        ("k_offset", _u64),
        ("v_offset", _u64),
        ("k_stride_n", _u64),
        ("k_stride_h", _u64),
        ("v_stride_n", _u64),
        ("v_stride_h", _u64),
        ("layer_stride", _u64),
        ("layer_begin", _u32),
        ("layer_end", _u32),
    ]


class kvp_paged_kv_t(ctypes.Structure):
    """kernels/kvp_kernels.h (strides in elements; device pointers for the CUDA kernels)."""
    _fields_ = [
        ("k_data", ctypes.c_void_p),
        ("v_data", ctypes.c_void_p),
        ("elem_bytes", _u32),
        ("num_pages", _u32),
        ("page_size", _u32),
        ("num_heads", _u32),
        ("head_dim", _u32),
        ("stride_page", _i64),
        ("stride_n", _i64),
        ("stride_h", _i64),
        ("batch_size", _u32),
        ("kv_indptr", ctypes.c_void_p),
        ("kv_indices", ctypes.c_void_p),
        ("kv_last_page_len", ctypes.c_void_p),
    ]


class kvp_append_src_t(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_void_p),
        ("value", ctypes.c_void_p),
        ("k_stride_n", _i64),
        ("k_stride_h", _i64),
        ("v_stride_n", _i64),
        ("v_stride_h", _i64),
    ]


class kvp_stats_summary_t(ctypes.Structure):
    _fields_ = [
        ("num_pages", _u32),
        ("free_pages", _u32),
        ("used_pages", _u32),
        ("shared_pages", _u32),
        ("num_seqs", _u32),
        ("num_clients", _u32),
        ("num_tokens", _u64),
        ("page_refs", _u64),
        ("page_bytes", _u64),
        ("uptime_ms", _u64),
        ("requests_total", _u64),
        ("append_bytes_total", _u64),
    ]


class kvp_cache_opts_t(ctypes.Structure):
    _fields_ = [
        ("token_ids", _p_i32),
        ("salts", ctypes.POINTER(ctypes.c_uint8)),
        ("salt_lens", _p_u32),
        ("reuse", ctypes.c_int),
        ("leave_last", ctypes.c_int),
        ("priority", ctypes.c_int),  # -1: the daemon's default (35)
        ("retention_ms", _u32),
        ("skip_tokens", _u32),
    ]


class kvp_pin_t(ctypes.Structure):
    _fields_ = [
        ("pin_id", _u64),
        ("pinned_tokens", _u32),
        ("pinned_pages", _u32),
        ("expires_in_ms", _u64),
    ]


class kvp_cache_stats_t(ctypes.Structure):
    _fields_ = [
        ("cached_pages", _u32),
        ("pinned_pages", _u32),
        ("indexed_pages", _u32),
        ("pins", _u32),
        ("query_tokens_total", _u64),
        ("hit_tokens_total", _u64),
        ("evictions_pressure_total", _u64),
        ("evictions_flush_total", _u64),
        ("evictions_rewrite_total", _u64),
        ("bytes", _u64),
        # the host tier (issue #28), appended in kvpool.h's order
        ("host_pages", _u32),
        ("host_slots", _u32),
        ("host_bytes_total", _u64),
        ("host_bytes_ready", _u64),
        ("host_hit_tokens_total", _u64),
        ("demotions_total", _u64),
        ("promotions_total", _u64),
        ("host_evictions_total", _u64),
        ("offload_bytes_total", _u64),
        ("restore_bytes_total", _u64),
        ("offload_us_total", _u64),
        ("restore_us_total", _u64),
        ("demoting", _u32),
        ("restoring", _u32),
        ("host_slot_bytes", _u32),
    ]


class kvp_load_t(ctypes.Structure):
    _fields_ = [
        ("loaded_tokens", _u32),
        ("host_tokens", _u32),
        ("completed", ctypes.c_int),
    ]


KVP_CACHE_DUMP_MAX_BYTES = 1 << 20


class kvp_cache_dump_t(ctypes.Structure):
    _fields_ = [
        ("records", ctypes.c_void_p),
        ("records_cap", ctypes.c_size_t),
        ("names", ctypes.c_void_p),
        ("names_cap", ctypes.c_size_t),
        ("num_blocks", _u32),
        ("record_bytes", _u32),
        ("block_size", _u32),
        ("next_cursor", _u32),
        ("next_seq", ctypes.c_int64),
        ("events", ctypes.c_int),
        ("names_len", ctypes.c_size_t),
    ]


KVP_TRANSFER_ID_BYTES = 128
KVP_TRANSFER_MAX_SEQS = 64


class kvp_transfer_ticket_t(ctypes.Structure):
    _fields_ = [
        ("nccl_id", ctypes.c_uint8 * KVP_TRANSFER_ID_BYTES),
        ("transfer_id", _u64),
        ("num_tokens", _u32),
        ("num_layers", _u32),
        ("bytes", _u64),
        ("num_seqs", _u32),
        ("chunk_bytes", _u32),
        ("flags", _u32),
        ("seq_tokens", _u32 * KVP_TRANSFER_MAX_SEQS),
    ]


class kvp_transfer_info_t(ctypes.Structure):
    _fields_ = [
        ("transfer_id", _u64),
        ("seq_id", _u64),
        ("bytes", _u64),
        ("elapsed_ms", _u64),
        ("num_tokens", _u32),
        ("num_seqs", _u32),
        ("direction", ctypes.c_char * 8),
        ("state", ctypes.c_char * 8),
        ("peer", ctypes.c_char * 65),
        ("ns", ctypes.c_char * 65),
        ("message", ctypes.c_char * 128),
    ]


_c = ctypes.c_void_p  # kvp_client_t *
_int = ctypes.c_int

# name: (restype, argtypes), exactly the prototypes of kvpool.h.
_PROTOTYPES = {
    "kvp_client_default_socket": (ctypes.c_char_p, [ctypes.c_char_p, ctypes.c_size_t]),
    "kvp_client_sizeof": (ctypes.c_size_t, [ctypes.c_char_p]),
    "kvp_client_connect": (
        _int,
        [ctypes.POINTER(kvp_client_opts_t), ctypes.POINTER(_c), ctypes.c_char_p, ctypes.c_size_t],
    ),
    "kvp_client_close": (None, [_c]),
    "kvp_client_last_error": (ctypes.c_char_p, [_c]),
    "kvp_client_session_id": (_u64, [_c]),
    "kvp_client_server_version": (ctypes.c_char_p, [_c]),
    "kvp_client_pool_info": (ctypes.POINTER(kvp_pool_info_t), [_c]),
    "kvp_client_pool_base": (ctypes.c_void_p, [_c, _u32]),
    "kvp_client_pool_fd": (_int, [_c, _u32]),
    "kvp_client_ping": (_int, [_c, _p_u64]),
    "kvp_client_alloc_host_buffer": (
        _int, [_c, _u64, ctypes.POINTER(ctypes.c_void_p), _p_u32]),
    "kvp_client_register_fd": (_int, [_c, _int, _u32, _u64, _p_u32]),
    "kvp_client_unregister_buffer": (_int, [_c, _u32]),
    "kvp_client_append": (
        _int,
        [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_source_t),
         ctypes.POINTER(kvp_page_table_t)],
    ),
    "kvp_client_reserve": (
        _int, [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_page_table_t)]),
    "kvp_client_reserve_cached": (
        _int, [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_cache_opts_t),
               ctypes.POINTER(kvp_page_table_t)]),
    "kvp_client_append_cached": (
        _int,
        [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_source_t),
         ctypes.POINTER(kvp_cache_opts_t), ctypes.POINTER(kvp_page_table_t)],
    ),
    "kvp_client_commit": (_int, [_c, _p_u64, _u32, ctypes.c_void_p, _p_u32, _p_u32]),
    "kvp_client_lookup": (
        _int, [_c, _p_i32, _p_u32, _u32, ctypes.POINTER(ctypes.c_uint8), _p_u32, _p_u32]),
    "kvp_client_lookup_tiers": (
        _int, [_c, _p_i32, _p_u32, _u32, ctypes.POINTER(ctypes.c_uint8), _p_u32, _p_u32,
               _p_u32]),
    "kvp_client_load": (
        _int, [_c, _p_i32, _u32, ctypes.c_void_p, _u32, ctypes.POINTER(kvp_source_t), _u32,
               ctypes.POINTER(kvp_load_t)]),
    "kvp_client_pin": (
        _int, [_c, _p_i32, _u32, ctypes.c_void_p, _u32, _u32, ctypes.POINTER(kvp_pin_t)]),
    "kvp_client_unpin": (_int, [_c, _u64, _p_u32]),
    "kvp_client_cache_flush": (_int, [_c, ctypes.c_char_p, _int, _p_u32]),
    "kvp_client_cache_dump": (_int, [_c, _u32, _u32, ctypes.POINTER(kvp_cache_dump_t)]),
    "kvp_client_cache_stats": (_int, [_c, ctypes.POINTER(kvp_cache_stats_t)]),
    "kvp_client_fork": (_int, [_c, _u64, _u64]),
    "kvp_client_truncate": (_int, [_c, _u64, _u32]),
    "kvp_client_release": (_int, [_c, _p_u64, _u32, _p_u32]),
    "kvp_client_page_table": (_int, [_c, _p_u64, _u32, ctypes.POINTER(kvp_page_table_t)]),
    "kvp_client_stats": (_int, [_c, ctypes.POINTER(kvp_stats_summary_t)]),
    "kvp_client_audit": (_int, [_c]),
    "kvp_client_export_begin": (
        _int, [_c, _u64, ctypes.c_char_p, _u32, ctypes.POINTER(kvp_transfer_ticket_t)]),
    "kvp_client_export_begin_set": (
        _int, [_c, _p_u64, _u32, ctypes.c_char_p, _u32, ctypes.POINTER(kvp_transfer_ticket_t)]),
    "kvp_client_import": (
        _int, [_c, ctypes.POINTER(kvp_transfer_ticket_t), _u64, _u32, _p_u32]),
    "kvp_client_import_set": (
        _int, [_c, ctypes.POINTER(kvp_transfer_ticket_t), _p_u64, _u32, _p_u32]),
    "kvp_client_list_transfers": (
        _int, [_c, ctypes.POINTER(kvp_transfer_info_t), _u32, _p_u32]),
    "kvp_strerror": (ctypes.c_char_p, [_int]),
    "kvp_errname": (ctypes.c_char_p, [_int]),
    # the CUDA section (stubs answering KVP_EUNAVAIL in a build without CUDA)
    "kvp_client_cuda_map_pool": (_int, [_c]),
    "kvp_client_cuda_alloc_buffer": (
        _int, [_c, _u64, _int, ctypes.POINTER(ctypes.c_void_p), _p_u32, _int]),
    "kvp_client_cuda_register_ipc": (_int, [_c, ctypes.c_void_p, _u64, _p_u32]),
    "kvp_client_cuda_append_async": (
        _int,
        [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_source_t),
         ctypes.POINTER(kvp_page_table_t), ctypes.c_void_p],
    ),
    "kvp_client_cuda_append_async_cached": (
        _int,
        [_c, _p_u64, _p_u32, _u32, ctypes.POINTER(kvp_source_t),
         ctypes.POINTER(kvp_cache_opts_t), ctypes.POINTER(kvp_page_table_t), ctypes.c_void_p],
    ),
    "kvp_client_cuda_commit": (_int, [_c, _p_u64, _u32, ctypes.c_void_p]),
    "kvp_client_cuda_commit_ex": (_int, [_c, _p_u64, _u32, ctypes.c_void_p, _p_u32, _p_u32]),
    "kvp_client_cuda_copy_pages": (
        _int, [_c, ctypes.POINTER(kvp_page_table_t), ctypes.c_void_p]),
    "kvp_client_cuda_free_buffer": (_int, [_c, _u32]),
    "kvp_last_cuda_error": (ctypes.c_char_p, []),
    "kvp_clear_cuda_error": (None, []),
    # no handle: (kv, src, append_indptr, nnz, err_dev, flags, stream), device pointers
    "kvp_client_cuda_append_fused": (
        _int, [ctypes.POINTER(kvp_paged_kv_t), ctypes.POINTER(kvp_append_src_t), ctypes.c_void_p,
               _u32, ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p]),
}

KVP_CLIENT_CUDA_APPEND_PDL = 1  # kvpool.h: kvp_client_cuda_append_fused's PDL flag

_v = ctypes.c_void_p
# The CUDA kernels (kernels/kvp_kernels_cuda.h), exported only by a libkvpool built with CUDA:
# declared when present.
_OPTIONAL_PROTOTYPES = {
    "kvp_cuda_available": (_int, []),
    "kvp_cuda_kernels_preload": (_int, []),
    "kvp_append_paged_kv_cache_cuda": (
        _int, [ctypes.POINTER(kvp_paged_kv_t), ctypes.POINTER(kvp_append_src_t), _v, _v, _u32,
               _v, _v]),
    "kvp_append_paged_kv_cache_fused_cuda_ex": (
        _int, [ctypes.POINTER(kvp_paged_kv_t), ctypes.POINTER(kvp_append_src_t), _v, _u32, _v,
               ctypes.c_uint, _v]),
    "kvp_get_seq_lens_cuda": (_int, [_v, _v, _u32, _u32, _v, _v]),
    "kvp_get_batch_indices_positions_cuda": (_int, [_v, _v, _u32, _u32, _v, _v, _v]),
}

# The structs checked against kvp_client_sizeof at load time (every one declared above that
# the library knows by name).
_CHECKED_STRUCTS = (
    kvp_client_opts_t, kvp_pool_info_t, kvp_page_table_t, kvp_source_t, kvp_stats_summary_t,
    kvp_transfer_ticket_t, kvp_transfer_info_t, kvp_cache_opts_t, kvp_pin_t, kvp_cache_stats_t,
    kvp_load_t, kvp_cache_dump_t,
)

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def _candidates() -> List[str]:
    """Where libkvpool is looked for: $KVPOOL_LIB alone when set (an explicit choice, also over
    the bundled copy: a bad path is an error, never silently replaced); else the libkvpool.so
    the wheel carries next to this file; the source tree's build/client/ ($BUILD_DIR/client);
    the system's (ctypes.util.find_library)."""
    env = os.environ.get("KVPOOL_LIB")
    if env:
        return [env]  # explicit: only this one
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for d in (here, os.path.dirname(here)):
        out += sorted(glob.glob(os.path.join(d, "libkvpool.so*")), key=len)
    # source tree: client/python/kvpool -> ../../build/client (relative to client/python)
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    build = os.environ.get("BUILD_DIR") or os.path.join(root, "build")
    out.append(os.path.join(build, "client", "libkvpool.so"))
    found = ctypes.util.find_library("kvpool")
    if found:
        out.append(found)
    return out


def _check_abi(lib: ctypes.CDLL, path: str) -> None:
    """Raises LibraryMismatch unless `lib` is the libkvpool this package mirrors."""
    if not hasattr(lib, "kvp_client_version") or not hasattr(lib, "kvp_client_abi_version"):
        raise LibraryMismatch(path, "unknown", "it has no kvp_client_version() (an older "
                              "libkvpool, or not libkvpool at all)")
    lib.kvp_client_version.restype = ctypes.c_char_p
    lib.kvp_client_version.argtypes = []
    lib.kvp_client_abi_version.restype = ctypes.c_uint
    lib.kvp_client_abi_version.argtypes = []
    found = (lib.kvp_client_version() or b"").decode("utf-8", "replace")
    abi = int(lib.kvp_client_abi_version())
    if found != PACKAGE_VERSION:
        raise LibraryMismatch(path, found, "the versions differ")
    if abi != ABI_VERSION:
        raise LibraryMismatch(path, found, "its ABI is %d" % abi)
    sizeof = lib.kvp_client_sizeof
    sizeof.restype = ctypes.c_size_t
    sizeof.argtypes = [ctypes.c_char_p]
    for st in _CHECKED_STRUCTS:
        n = int(sizeof(st.__name__.encode()))
        if n != ctypes.sizeof(st):
            raise LibraryMismatch(path, found, "its %s is %d bytes, the package's %d"
                                  % (st.__name__, n, ctypes.sizeof(st)))


def library_path() -> str:
    """The path of the loaded libkvpool (loads it if needed)."""
    load()
    assert _lib_path is not None
    return _lib_path


def load() -> ctypes.CDLL:
    """Loads libkvpool once, checks it (_check_abi) and declares its functions. Raises OSError
    when none is found, LibraryMismatch (an ImportError) when the one found is not the library
    this package mirrors."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(path + " (missing)")
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                continue
            _check_abi(lib, path)
            for name, (res, args) in _PROTOTYPES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            for name, (res, args) in _OPTIONAL_PROTOTYPES.items():
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = res
                    fn.argtypes = args
            _lib, _lib_path = lib, path
            return lib
        raise OSError(
            "libkvpool.so not found; install the package with pip (pip install ./client/python: "
            "the wheel carries it), build it (cmake --build build) or set KVPOOL_LIB. Tried: "
            + "; ".join(tried))


def has_symbol(name: str) -> bool:
    """Whether the loaded libkvpool exports `name`."""
    try:
        getattr(load(), name)
        return True
    except AttributeError:
        return False
