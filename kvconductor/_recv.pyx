# cython: language_level=3
"""Queued ZeroMQ messages received in C, with the GIL held throughout.

pyzmq's ``recv_multipart`` releases and re-takes the GIL around every frame it
receives (three frames per vLLM batch). A non-blocking receive of a frame already
queued takes about a microsecond, but each release hands the GIL to a waiting thread
(the event loop answering queries) and each re-take waits for it back: on a loaded
server most of the ingest thread's time went into those handoffs (futex waits and
wakes), and the event loop's queries waited on the ingest thread's in turn.

:func:`recv_messages` drains whole multipart messages already queued on a socket with
``zmq_msg_recv(ZMQ_DONTWAIT)`` and never releases the GIL: it never blocks, and
holding the GIL is what the caller (the ingest thread's Python) needs next anyway.

libzmq is the one pyzmq already loaded: its path is read from the process's memory
map and opened with ``RTLD_NOLOAD`` (the same instance, never a second copy), and the
functions are taken from it with ``dlsym``; its ``zmq_version`` must equal pyzmq's.
Nothing of libzmq is vendored or needed at build time. Where that fails (a pyzmq
built with libzmq linked in statically, a system without ``/proc``), :data:`AVAILABLE`
is False, :data:`WHY` says why and callers use ``recv_multipart`` (its Python twin).
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, EINTR
from libc.stdint cimport uintptr_t
from posix.dlfcn cimport RTLD_NOW, dlopen, dlsym

import os as _os

import zmq as _zmq

cdef extern from "<dlfcn.h>" nogil:
    int RTLD_NOLOAD

cdef kvc_zmq_msg_init_fn _init = NULL
cdef kvc_zmq_msg_close_fn _close = NULL
cdef kvc_zmq_msg_recv_fn _recv = NULL
cdef kvc_zmq_msg_data_fn _data = NULL
cdef kvc_zmq_msg_size_fn _size = NULL
cdef kvc_zmq_msg_more_fn _more = NULL
cdef kvc_zmq_errno_fn _errno = NULL

#: The libzmq functions were found (else callers use pyzmq's ``recv_multipart``).
AVAILABLE = False
#: Why not, when not AVAILABLE; else the path of the libzmq in use.
WHY = ""


def _loaded_libzmq_paths():
    """The files of the shared objects named ``libzmq*`` this process has mapped."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if _os.path.basename(path).startswith("libzmq") and path not in out:
                        out.append(path)
    except OSError:
        pass
    return out


cdef bint _take(void* h) noexcept:
    """Take the functions from ``h``; True when all are there."""
    global _init, _close, _recv, _data, _size, _more, _errno
    _init = <kvc_zmq_msg_init_fn>dlsym(h, b"zmq_msg_init")
    _close = <kvc_zmq_msg_close_fn>dlsym(h, b"zmq_msg_close")
    _recv = <kvc_zmq_msg_recv_fn>dlsym(h, b"zmq_msg_recv")
    _data = <kvc_zmq_msg_data_fn>dlsym(h, b"zmq_msg_data")
    _size = <kvc_zmq_msg_size_fn>dlsym(h, b"zmq_msg_size")
    _more = <kvc_zmq_msg_more_fn>dlsym(h, b"zmq_msg_more")
    _errno = <kvc_zmq_errno_fn>dlsym(h, b"zmq_errno")
    return (_init != NULL and _close != NULL and _recv != NULL and _data != NULL
            and _size != NULL and _more != NULL and _errno != NULL)


cdef object _version(void* h):
    cdef int a = 0, b = 0, c = 0
    cdef kvc_zmq_version_fn fn = <kvc_zmq_version_fn>dlsym(h, b"zmq_version")
    if fn == NULL:
        return None
    fn(&a, &b, &c)
    return (a, b, c)


def _load():
    global AVAILABLE, WHY
    want = tuple(_zmq.zmq_version_info()[:3])
    cdef void* h
    tried = []
    for path in _loaded_libzmq_paths():
        h = dlopen(path.encode(), RTLD_NOW | RTLD_NOLOAD)
        if h == NULL:
            tried.append(f"{path}: not loaded")
            continue
        got = _version(h)
        if got != want:
            tried.append(f"{path}: version {got}, pyzmq's is {want}")
            continue
        if _take(h):
            AVAILABLE, WHY = True, path
            return
        tried.append(f"{path}: zmq_msg_* not exported")
    # a libzmq whose symbols are global (a pyzmq linked to it without its own copy)
    h = dlopen(NULL, RTLD_NOW)
    if h != NULL and _version(h) == want and _take(h):
        AVAILABLE, WHY = True, "(global symbols)"
        return
    AVAILABLE = False
    WHY = "pyzmq's libzmq not found as a shared object" + (
        f" ({'; '.join(tried)})" if tried else "")


_load()


def recv_messages(uintptr_t socket, size_t limit, list out):
    """Receive at most ``limit`` whole multipart messages already queued on the libzmq
    socket at address ``socket`` (``zmq.Socket.underlying``, open, used by this thread
    only), without blocking and without releasing the GIL; each is appended to ``out``
    as a list of ``bytes`` frames, as ``recv_multipart`` returns it.

    Returns 0 when the queue is empty or ``limit`` messages were received, else the
    ``errno`` of the receive that failed (``ETERM``, ``ENOTSOCK``, ...; the messages
    received before it are in ``out``)."""
    cdef kvc_zmq_msg msg
    cdef size_t _k
    cdef int rc, err = 0
    cdef list frames
    if not AVAILABLE:
        raise RuntimeError(f"kvconductor._recv is not available: {WHY}")
    if socket == 0:
        raise ValueError("no socket (closed)")
    _init(&msg)
    try:
        for _k in range(limit):
            frames = []
            while True:
                rc = _recv(&msg, <void*>socket, KVC_ZMQ_DONTWAIT)
                if rc < 0:
                    err = _errno()
                    if err == EINTR:
                        continue
                    if err == EAGAIN and not frames:
                        return 0
                    return err
                frames.append(
                    PyBytes_FromStringAndSize(<char*>_data(&msg), <Py_ssize_t>_size(&msg)))
                if not _more(&msg):
                    break
            out.append(frames)
        return 0
    finally:
        _close(&msg)
