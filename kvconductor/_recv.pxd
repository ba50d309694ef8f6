# cython: language_level=3
"""libzmq's message type and calls (kvconductor/c/zmqmsg.h) for ``_recv.pyx``."""

cdef extern from "kvconductor/c/zmqmsg.h" nogil:
    ctypedef struct kvc_zmq_msg:
        pass
    int KVC_ZMQ_DONTWAIT
    ctypedef int (*kvc_zmq_msg_init_fn)(kvc_zmq_msg* msg) noexcept nogil
    ctypedef int (*kvc_zmq_msg_close_fn)(kvc_zmq_msg* msg) noexcept nogil
    ctypedef int (*kvc_zmq_msg_recv_fn)(kvc_zmq_msg* msg, void* socket, int flags) noexcept nogil
    ctypedef void* (*kvc_zmq_msg_data_fn)(kvc_zmq_msg* msg) noexcept nogil
    ctypedef size_t (*kvc_zmq_msg_size_fn)(const kvc_zmq_msg* msg) noexcept nogil
    ctypedef int (*kvc_zmq_msg_more_fn)(const kvc_zmq_msg* msg) noexcept nogil
    ctypedef int (*kvc_zmq_errno_fn)() noexcept nogil
    ctypedef void (*kvc_zmq_version_fn)(int* major, int* minor, int* patch) noexcept nogil
