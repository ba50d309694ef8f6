/* kvconductor/c/zmqmsg.h: libzmq's zmq_msg_t, as its zmq.h lays it out (64 bytes,
 * pointer aligned; stable across libzmq 4.x, soname 5), and the signatures of the
 * few libzmq calls kvconductor/_recv.pyx takes from the libzmq pyzmq loaded.
 * No libzmq header or library is needed at build time. */
#ifndef KVC_ZMQMSG_H
#define KVC_ZMQMSG_H

#include <stddef.h>

typedef struct kvc_zmq_msg {
#if defined(_MSC_VER)
    __declspec(align(8)) unsigned char _[64];
#else
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
#endif
} kvc_zmq_msg;

#define KVC_ZMQ_DONTWAIT 1

typedef int (*kvc_zmq_msg_init_fn)(kvc_zmq_msg *msg);
typedef int (*kvc_zmq_msg_close_fn)(kvc_zmq_msg *msg);
typedef int (*kvc_zmq_msg_recv_fn)(kvc_zmq_msg *msg, void *socket, int flags);
typedef void *(*kvc_zmq_msg_data_fn)(kvc_zmq_msg *msg);
typedef size_t (*kvc_zmq_msg_size_fn)(const kvc_zmq_msg *msg);
typedef int (*kvc_zmq_msg_more_fn)(const kvc_zmq_msg *msg);
typedef int (*kvc_zmq_errno_fn)(void);
typedef void (*kvc_zmq_version_fn)(int *major, int *minor, int *patch);

#endif
