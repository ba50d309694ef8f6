/* kvconductor/c/readers.h: helpers of the msgpack readers.
 * Declared for Cython in kvconductor/_readers.pxd (cdef extern from "kvconductor/c/readers.h"). */
#ifndef KVC_READERS_H
#define KVC_READERS_H

#include <stddef.h>
#include <stdint.h>

#define KVR_X16(x) x,x,x,x,x,x,x,x,x,x,x,x,x,x,x,x
#define KVR_X32(x) KVR_X16(x),KVR_X16(x)
#define KVR_X128(x) KVR_X32(x),KVR_X32(x),KVR_X32(x),KVR_X32(x)
#define KVR_S 0xFFFFFFFFu
/* by tag: 0x00-0x7f, 0x80-0xbf, 0xc0-0xcf (uint8/16/32 at 0xcc-0xce),
   0xd0-0xdf (int8/16/32 at 0xd0-0xd2), 0xe0-0xff */
static const uint8_t kvr_mp_len[256] = {KVR_X128(1), KVR_X32(0), KVR_X32(0),
    0,0,0,0, 0,0,0,0, 0,0,0,0, 2,3,5,0,  2,3,5,0, 0,0,0,0, 0,0,0,0, 0,0,0,0,  KVR_X32(1)};
static const uint8_t kvr_mp_off[256] = {KVR_X128(0), KVR_X32(1), KVR_X32(1),
    KVR_X32(1), KVR_X32(0)};
static const uint8_t kvr_mp_sh[256] = {KVR_X128(24), KVR_X32(0), KVR_X32(0),
    0,0,0,0, 0,0,0,0, 0,0,0,0, 24,16,0,0,  24,16,0,0, 0,0,0,0, 0,0,0,0, 0,0,0,0,  KVR_X32(24)};
static const uint32_t kvr_mp_sgn[256] = {KVR_X128(0), KVR_X32(0), KVR_X32(0),
    0,0,0,0, 0,0,0,0, 0,0,0,0, 0,0,0,0,  KVR_S,KVR_S,KVR_S,0, 0,0,0,0, 0,0,0,0, 0,0,0,0,
    KVR_X32(KVR_S)};

#endif /* KVC_READERS_H */
