/*
 * boundedloss._native: the per-datagram data path under the Python protocol core.
 * What every part of it shares: the header's layout and its parser (as wire.parse), the
 * drop reasons, the Receive and Send objects' layout, and each part's entry points. One concern
 * per file:
 *   wire.c      classify: a datagram's header checked exactly as wire.parse checks it
 *   receive.c   Receive: the counters and buffers of one receive, shared with Python
 *   send.c      Send: what the ACKs of one send move, shared with Python
 *   seal.c      Sealer: AES-256-GMAC tags and nonces, as protocol/auth.py makes them
 *   gmac.c      Gmac: the Python core's AES-256-GMAC (auth.py's Gmac) through seal.c
 *   datapath.c  Dispatcher: batched receive and send, taking DATA into its receive
 *   hadamard.c  fwht, flip_signs: Hadamard dispersion's transform
 *   bare.c      blast, drain: the bare loops that measure the machine's own limit
 *   module.c    the module, its constants and types
 */
#ifndef BL_NATIVE_H
#define BL_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef BL_OPENSSL
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/modes.h>
#endif

#ifdef __linux__
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#endif

/* ----------------------------------------------------------------- the header */
/* The layout is wire.HEADER_FIELDS; boundedloss.native refuses this module unless
 * LAYOUT below equals wire.OFFSET field for field. */
enum {
    OFF_MAGIC = 0, OFF_VERSION = 2, OFF_KIND = 3, OFF_FLAGS = 4, OFF_PLEN = 6,
    OFF_SESSION = 8, OFF_ROUND = 16, OFF_MESSAGE = 20, OFF_INDEX = 24, OFF_COUNT = 28,
    OFF_MBYTES = 32, OFF_CBYTES = 40, OFF_TSEQ = 44, HEADER_BYTES = 48,
};
enum { MAGIC = 0x4C42, VERSION = 2 };
enum { KIND_DATA = 1, KIND_PROBE = 2, KIND_BITMAP = 3, KIND_STOP = 4, KIND_ACK = 5 };
enum { FLAG_PROBE_CARRIED = 2, FLAG_FINAL = 4, FLAG_CREDIT = 8 };
/* why a receive closed, as a STOP's index carries it (wire.CloseReason): those a data
 * path that closes a receive itself (Receive.close_here) can find */
enum { CLOSE_COMPLETE = 1, CLOSE_BOUND_MET = 2, CLOSE_ACCEPT_DEADLINE = 3 };
/* a BITMAP's payload: the PROBE's seq and the chunks delivered (wire.BITMAP_PREFIX), then
 * the delivered bits */
enum { BITMAP_PREFIX_BYTES = 8 };
#define MAX_CHUNK_BYTES 65000u
#define MAX_MESSAGE_BYTES (1ull << 40)

/* Drop reasons, in the order of REASONS (their wire.DropReason values). */
enum {
    OK = 0, R_SHORT, R_BAD_MAGIC, R_BAD_VERSION, R_BAD_KIND, R_BAD_LENGTH, R_BAD_GEOMETRY,
    R_FOREIGN_SESSION, R_INJECTED_LOSS, R_BAD_AUTH, R_STALE, N_REASONS
};
static const char *const REASONS[N_REASONS] = {
    NULL, "short", "bad_magic", "bad_version", "bad_kind", "bad_length", "bad_geometry",
    "foreign_session", "injected_loss", "bad_auth", "stale",
};
/* protocol/auth.py: a datagram's trailer (nonce, tag), an address's bytes in the tag's
 * input (4, address, port), the key */
enum { NONCE_BYTES = 12, TAG_BYTES = 12, TRAILER_BYTES = NONCE_BYTES + TAG_BYTES,
       IDENT_BYTES = 7, KEY_BYTES = 32 };

/* Little-endian loads and stores that never assume alignment. */
static inline uint16_t ld16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t ld32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t ld64(const unsigned char *p) {
    return (uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32;
}
static inline void st32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}

typedef struct {
    uint8_t kind;
    uint16_t flags, plen;
    uint64_t session, mbytes;
    uint32_t round_id, message_id, index, count, cbytes, tseq;
} Header;

/* wire.parse, check for check and in the same order: OK or the first reason it fails. */
static inline int parse(const unsigned char *d, size_t n, Header *h) {
    if (n < HEADER_BYTES) return R_SHORT;
    if (ld16(d + OFF_MAGIC) != MAGIC) return R_BAD_MAGIC;
    if (d[OFF_VERSION] != VERSION) return R_BAD_VERSION;
    h->kind = d[OFF_KIND];
    h->flags = ld16(d + OFF_FLAGS);
    h->plen = ld16(d + OFF_PLEN);
    h->session = ld64(d + OFF_SESSION);
    h->round_id = ld32(d + OFF_ROUND);
    h->message_id = ld32(d + OFF_MESSAGE);
    h->index = ld32(d + OFF_INDEX);
    h->count = ld32(d + OFF_COUNT);
    h->mbytes = ld64(d + OFF_MBYTES);
    h->cbytes = ld32(d + OFF_CBYTES);
    h->tseq = ld32(d + OFF_TSEQ);
    if ((size_t)h->plen != n - HEADER_BYTES) return R_BAD_LENGTH;
    if (h->cbytes == 0 || h->cbytes > MAX_CHUNK_BYTES || h->mbytes > MAX_MESSAGE_BYTES)
        return R_BAD_GEOMETRY;
    uint64_t chunks = (h->mbytes + h->cbytes - 1) / h->cbytes;
    if ((uint64_t)h->count != (chunks ? chunks : 1)) return R_BAD_GEOMETRY;
    switch (h->kind) {
    case KIND_DATA: {
        if (h->index >= h->count) return R_BAD_GEOMETRY;
        uint64_t expect = h->index < h->count - 1
            ? h->cbytes : h->mbytes - (uint64_t)h->cbytes * (h->count - 1);
        if (h->plen != expect) return R_BAD_LENGTH;
        return OK;
    }
    case KIND_PROBE:
        return h->plen ? R_BAD_LENGTH : OK;
    case KIND_BITMAP:
        if (h->index >= h->count || (h->index & 7)) return R_BAD_GEOMETRY;
        if (h->plen < 8 || (uint64_t)(h->plen - 8) > (((uint64_t)h->count - h->index + 7) >> 3))
            return R_BAD_LENGTH;
        return OK;
    case KIND_STOP:
    case KIND_ACK:
        return h->plen != 4 ? R_BAD_LENGTH : OK;
    default:
        return R_BAD_KIND;
    }
}


/* One open receive as the data path sees it: the counters it shares with Python's
 * MessageReceiver (members, read and written by both), its identity and geometry, its
 * destination, delivered flags (one byte per chunk) and critical flags (optional). */
typedef struct ReceiveObject {
    PyObject_HEAD
    long long datagrams, payload_bytes, duplicates, delivered_count, max_tseq, unacked;
    long long critical_missing, need;
    long long probes, retransmit_rounds, answered_seq;
    char final_seen;  /* a FINAL PROBE has come (the core recorded the first pass) */
    char early_stop;  /* the sender sent everything once, or the acceptance deadline passed */
    char heard;       /* the receive's first datagram has arrived (at first_heard) */
    char clock_on_first;  /* that first datagram starts a clock of the plan's: Python's */
    char parked;      /* under credit: its ACKs grant nothing (protocol/credit.py) */
    char accepting;   /* the acceptance deadline passed (a met plan closes ACCEPT_DEADLINE) */
    char closes_here; /* its plan met by a DATA, the data path closes it (close_here) */
    long long granted;  /* under credit: what its latest ACK granted (-1: none yet) */
    double first_heard;
    char geometry;    /* the fields below are set (bind was called) */
    char registered;
    char closed;      /* closed (close): its buffers let go, its STOP kept to say again */
    PyObject *stop;   /* closed: the STOP datagram, or NULL (a cancelled receive has none) */
    double last_sent, min_rto;  /* closed: when the STOP went last; how often DATA gets it */
    uint32_t ip, round_id, message_id, count, cbytes, ack_every;
    uint16_t port;
    uint64_t mbytes;
    PyObject *peer;
    Py_buffer dest, delivered, critical;
    int has_critical;
    unsigned char ack[HEADER_BYTES + 4 + TRAILER_BYTES];  /* (room for its trailer) */
    struct ReceiveObject *next;  /* hash chain in a Dispatcher */
} ReceiveObject;

/* (a bound receive holds its buffers until it closes: here, or as the core says) */
static inline void release_buffers_of(ReceiveObject *r) {
    if (r->geometry && !r->closed) {
        PyBuffer_Release(&r->dest);
        PyBuffer_Release(&r->delivered);
        if (r->has_critical) PyBuffer_Release(&r->critical);
        r->has_critical = 0;
    }
}

/* One open send as the data path sees it: what its ACKs move, shared with Python's
 * MessageSender (protocol/acks.py's AckState, field for field), its identity and
 * geometry, and what says which ACKs the Python core must see (in_python, check_loss). */
typedef struct SendObject {
    PyObject_HEAD
    double last_heard;
    long long reported_delivered, acks_heard, ack_tseq, ack_delivered, acked, next_tseq;
    PyObject *blocked_since;  /* None, or since when the window has been shut */
    long long ack_every;
    double reverse_hint, loss_limit;
    char in_python, check_loss;
    long long credit, granted_least;  /* the receiver's latest grant, the least one (-1) */
    char geometry, registered;
    char closed;  /* the send has finished: what still comes for it is stale */
    uint32_t ip, round_id, message_id, count, cbytes;
    uint16_t port;
    uint64_t mbytes;
    struct SendObject *next;  /* hash chain in a Dispatcher */
} SendObject;

/* the most one received message (a datagram or a GRO run) holds */
#define SLOT_BYTES 65536
/* a send: at most SEND_MAX datagrams a sendmmsg, GSO_MAX_BYTES a UDP_SEGMENT send */
#define SEND_MAX 64
#define GSO_MAX_BYTES 65507

#ifdef __linux__
/* A UDP_SEGMENT send's control message, and setting it on ``m``: the kernel cuts the
 * send into ``size``-byte datagrams (the data path's runs and the bare loop alike). */
typedef union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(uint16_t))]; } GsoControl;

static inline void set_gso(struct msghdr *m, GsoControl *ctrl, uint16_t size) {
    memset(ctrl, 0, sizeof *ctrl);
    m->msg_control = ctrl->buf;
    m->msg_controllen = sizeof ctrl->buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(m);
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    memcpy(CMSG_DATA(c), &size, sizeof size);
}
#endif

extern PyTypeObject ReceiveType;
extern PyTypeObject SendType;
extern PyTypeObject DispatcherType;
#ifdef BL_OPENSSL
extern PyTypeObject GmacType;
#endif

PyObject *native_classify(PyObject *self, PyObject *arg);
PyObject *native_fwht(PyObject *self, PyObject *args);
PyObject *native_flip_signs(PyObject *self, PyObject *args);
#ifdef __linux__
PyObject *native_blast(PyObject *self, PyObject *args);
PyObject *native_drain(PyObject *self, PyObject *args);
#endif

#endif
