/*
 * boundedloss._native: the per-datagram data path under the Python protocol core.
 *
 * It moves bytes and decides nothing. What it does:
 *   - validates a datagram's header exactly as wire.parse does (classify);
 *   - takes DATA datagrams for receives the Python core registered: finds the receive,
 *     copies the payload into its destination, marks the chunk delivered, counts, and
 *     builds the ACK the receiver owes every ack_every datagrams (Dispatcher);
 *   - receives batches from a UDP socket (recvmmsg, each message possibly a GRO run)
 *     with the GIL released (Dispatcher.recv);
 *   - with a job's key (Dispatcher.authenticate), verifies the tag every datagram ends in
 *     before anything else reads it, and seals what it sends (the DATA of send_run, its
 *     ACKs): AES-256-GMAC through OpenSSL's EVP AES-GCM with associated data only, over
 *     source address, destination address, header and payload, under a nonce the
 *     datagram carries, as protocol/auth.py does;
 *   - the Walsh-Hadamard transform of Hadamard dispersion, cache-blocked (fwht).
 * A datagram it cannot take without a decision - the first one of a receive, one that
 * would meet the receive's plan, a control datagram, one for an unknown message - is
 * handed back to Python untouched, in order, and Python's core handles it as always.
 * The counters a receive shares with Python live in a Receive object that both read.
 */
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
enum { MAGIC = 0x4C42, VERSION = 1 };
enum { KIND_DATA = 1, KIND_PROBE = 2, KIND_BITMAP = 3, KIND_STOP = 4, KIND_ACK = 5 };
#define MAX_CHUNK_BYTES 65000u
#define MAX_MESSAGE_BYTES (1ull << 40)

/* Drop reasons, in the order of REASONS (their wire.DropReason values). */
enum {
    OK = 0, R_SHORT, R_BAD_MAGIC, R_BAD_VERSION, R_BAD_KIND, R_BAD_LENGTH, R_BAD_GEOMETRY,
    R_FOREIGN_SESSION, R_INJECTED_LOSS, R_BAD_AUTH, N_REASONS
};
static const char *const REASONS[N_REASONS] = {
    NULL, "short", "bad_magic", "bad_version", "bad_kind", "bad_length", "bad_geometry",
    "foreign_session", "injected_loss", "bad_auth",
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
static int parse(const unsigned char *d, size_t n, Header *h) {
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

static PyObject *native_classify(PyObject *self, PyObject *arg) {
    Py_buffer b;
    Header h;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    int r = parse((const unsigned char *)b.buf, (size_t)b.len, &h);
    PyBuffer_Release(&b);
    if (r == OK) Py_RETURN_NONE;
    return PyUnicode_FromString(REASONS[r]);
}

/* -------------------------------------------------------------- Receive */
/* One open receive as the data path sees it: the counters it shares with Python's
 * MessageReceiver (members, read and written by both), its identity and geometry, its
 * destination, delivered flags (one byte per chunk) and critical flags (optional). */
typedef struct ReceiveObject {
    PyObject_HEAD
    long long datagrams, payload_bytes, duplicates, delivered_count, max_tseq, unacked;
    long long critical_missing, need;
    char early_stop;  /* the sender sent everything once, or the acceptance deadline passed */
    char heard;       /* Python has seen the receive's first datagram */
    char geometry;    /* the fields below are set (bind was called) */
    char registered;
    uint32_t ip, round_id, message_id, count, cbytes, ack_every;
    uint16_t port;
    uint64_t mbytes;
    PyObject *peer;
    Py_buffer dest, delivered, critical;
    int has_critical;
    unsigned char ack[HEADER_BYTES + 4 + TRAILER_BYTES];  /* (room for its trailer) */
    struct ReceiveObject *next;  /* hash chain in a Dispatcher */
} ReceiveObject;

static void receive_release(ReceiveObject *r) {
    if (r->geometry) {
        PyBuffer_Release(&r->dest);
        PyBuffer_Release(&r->delivered);
        if (r->has_critical) PyBuffer_Release(&r->critical);
        r->geometry = 0;
        r->has_critical = 0;
    }
    Py_CLEAR(r->peer);
}

static int receive_init(ReceiveObject *r, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    r->max_tseq = -1;
    return 0;
}

static void receive_dealloc(ReceiveObject *r) {
    receive_release(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* bind(peer, ip, port, round, message, count, mbytes, cbytes, ack_every, dest,
 *      delivered, critical_or_None, ack_header): the geometry, once it is known. */
static PyObject *receive_bind(ReceiveObject *r, PyObject *args) {
    PyObject *peer, *dest, *delivered, *critical;
    unsigned int ip, port, round_id, message_id, count, cbytes, ack_every;
    unsigned long long mbytes;
    Py_buffer ack;
    if (r->geometry || r->registered) {
        PyErr_SetString(PyExc_RuntimeError, "receive already bound");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OIIIIIKIIOOOy*", &peer, &ip, &port, &round_id, &message_id,
                          &count, &mbytes, &cbytes, &ack_every, &dest, &delivered, &critical,
                          &ack))
        return NULL;
    int ok = ack.len == HEADER_BYTES + 4 && port <= 0xFFFF && count > 0 && cbytes > 0
        && ack_every > 0;
    if (ok) memcpy(r->ack, ack.buf, HEADER_BYTES + 4);
    PyBuffer_Release(&ack);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "bad receive geometry or ACK template");
        return NULL;
    }
    if (PyObject_GetBuffer(dest, &r->dest, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(delivered, &r->delivered, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&r->dest);
        return NULL;
    }
    r->has_critical = critical != Py_None;
    if (r->has_critical && PyObject_GetBuffer(critical, &r->critical, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&r->dest);
        PyBuffer_Release(&r->delivered);
        r->has_critical = 0;
        return NULL;
    }
    /* every copy lands inside dest: a datagram taken for this receive has its mbytes and
     * cbytes, so parse() has held its index and length to this geometry */
    uint64_t chunks = ((uint64_t)mbytes + cbytes - 1) / cbytes;
    if ((uint64_t)r->dest.len != mbytes || (uint64_t)r->delivered.len != count
        || (r->has_critical && (uint64_t)r->critical.len != count)
        || (uint64_t)count != (chunks ? chunks : 1) || cbytes > MAX_CHUNK_BYTES) {
        PyBuffer_Release(&r->dest);
        PyBuffer_Release(&r->delivered);
        if (r->has_critical) PyBuffer_Release(&r->critical);
        r->has_critical = 0;
        PyErr_SetString(PyExc_ValueError, "buffers disagree with the geometry");
        return NULL;
    }
    Py_INCREF(peer);
    r->peer = peer;
    r->ip = ip; r->port = (uint16_t)port; r->round_id = round_id; r->message_id = message_id;
    r->count = count; r->mbytes = mbytes; r->cbytes = cbytes; r->ack_every = ack_every;
    r->geometry = 1;
    Py_RETURN_NONE;
}

static PyMemberDef receive_members[] = {
    {"datagrams", T_LONGLONG, offsetof(ReceiveObject, datagrams), 0, NULL},
    {"payload_bytes", T_LONGLONG, offsetof(ReceiveObject, payload_bytes), 0, NULL},
    {"duplicates", T_LONGLONG, offsetof(ReceiveObject, duplicates), 0, NULL},
    {"delivered_count", T_LONGLONG, offsetof(ReceiveObject, delivered_count), 0, NULL},
    {"max_tseq", T_LONGLONG, offsetof(ReceiveObject, max_tseq), 0, NULL},
    {"unacked", T_LONGLONG, offsetof(ReceiveObject, unacked), 0, NULL},
    {"critical_missing", T_LONGLONG, offsetof(ReceiveObject, critical_missing), 0, NULL},
    {"need", T_LONGLONG, offsetof(ReceiveObject, need), 0, NULL},
    {"early_stop", T_BOOL, offsetof(ReceiveObject, early_stop), 0, NULL},
    {"heard", T_BOOL, offsetof(ReceiveObject, heard), 0, NULL},
    {"registered", T_BOOL, offsetof(ReceiveObject, registered), READONLY, NULL},
    {NULL},
};

static PyMethodDef receive_methods[] = {
    {"bind", (PyCFunction)receive_bind, METH_VARARGS, "Set the geometry and buffers."},
    {NULL},
};

static PyTypeObject ReceiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boundedloss._native.Receive",
    .tp_basicsize = sizeof(ReceiveObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The counters and buffers of one receive, shared by Python and the data path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)receive_init,
    .tp_dealloc = (destructor)receive_dealloc,
    .tp_members = receive_members,
    .tp_methods = receive_methods,
};

/* ----------------------------------------------------------- Dispatcher */
#define BUCKETS 4096
#define RECV_SLOTS 64
#define SLOT_BYTES 65536

typedef struct {
    PyObject_HEAD
    uint64_t session;
    ReceiveObject *table[BUCKETS];
    long long taken;                 /* datagrams the data path took */
    long long drops[N_REASONS];      /* malformed / foreign datagrams it counted and dropped */
    /* the batch: a buffer of RECV_SLOTS slots, each one message (a datagram or a GRO run) */
    unsigned char *buf;
    uint32_t lens[RECV_SLOTS], segs[RECV_SLOTS], ips[RECV_SLOTS];
    uint16_t ports[RECV_SLOTS];
    int batch, slot;                 /* messages in the batch; the one being read */
    uint32_t offset;                 /* where in that message the next datagram starts */
    Py_ssize_t seq;                  /* datagrams of the batch read so far */
    unsigned char *stage;            /* a segmented send, gathered (GSO_MAX_BYTES) */
    unsigned char *lose;             /* per datagram of the batch: a loss model drops it */
    Py_ssize_t lose_len, lose_cap;
    int auth;                        /* every datagram carries a tag (authenticate) */
    /* the tags of one message of the batch (slot ``verified_slot``; -1: none), checked
     * without the GIL just before step takes its datagrams: VERIFIED or a drop reason */
    unsigned char *verdicts;
    Py_ssize_t verdicts_cap, slot_seq0;  /* (slot_seq0: the batch index of its first) */
    int verified_slot;
    unsigned char ident[IDENT_BYTES];  /* our own address as a tag covers it */
    unsigned char prefix[4];         /* this sealer's nonces: prefix, then a counter */
    uint64_t counter;
#ifdef BL_OPENSSL
    /* GCM under the job's key, driven through OpenSSL's own GCM (the code its EVP
     * AES-GCM runs) rather than the EVP layer: a datagram's fixed cost 0.07 us instead
     * of 0.17 (BENCHMARKS.md, "Authenticated datagrams"). Its block cipher is AES-256
     * through EVP (AES-NI where the CPU has it). */
    GCM128_CONTEXT *gcm;
    EVP_CIPHER_CTX *aes;
    int crypto_failed;               /* the block cipher failed once: tag nothing more */
#endif
} DispatcherObject;

static inline void put_ident(unsigned char *o, uint32_t ip, uint16_t port) {
    o[0] = 4;
    o[1] = (unsigned char)(ip >> 24); o[2] = (unsigned char)(ip >> 16);
    o[3] = (unsigned char)(ip >> 8); o[4] = (unsigned char)ip;
    o[5] = (unsigned char)(port >> 8); o[6] = (unsigned char)port;
}

/* The tag under ``nonce`` of a datagram from ``src`` to ``dst`` whose bytes are a[0:an]
 * then b[0:bn] (header and payload may lie apart). 0, or -1 if OpenSSL failed (no Python
 * error set: the callers may hold no GIL). */
static int mac_tag(DispatcherObject *d, const unsigned char *src, const unsigned char *dst,
                   const unsigned char *a, size_t an, const unsigned char *b, size_t bn,
                   const unsigned char *nonce, unsigned char *tag) {
#ifdef BL_OPENSSL
    unsigned char head[2 * IDENT_BYTES + HEADER_BYTES];
    GCM128_CONTEXT *g = d->gcm;
    /* the addresses and the header in one piece: one call, not three */
    size_t m = an < HEADER_BYTES ? an : HEADER_BYTES;
    memcpy(head, src, IDENT_BYTES);
    memcpy(head + IDENT_BYTES, dst, IDENT_BYTES);
    memcpy(head + 2 * IDENT_BYTES, a, m);
    /* GCM with associated data only: the key stays, the nonce is this datagram's */
    CRYPTO_gcm128_setiv(g, nonce, NONCE_BYTES);
    if (CRYPTO_gcm128_aad(g, head, 2 * IDENT_BYTES + m) != 0
        || (an > m && CRYPTO_gcm128_aad(g, a + m, an - m) != 0)
        || (bn && CRYPTO_gcm128_aad(g, b, bn) != 0))
        return -1;
    CRYPTO_gcm128_tag(g, tag, TAG_BYTES);
    return d->crypto_failed ? -1 : 0;
#else
    (void)d; (void)src; (void)dst; (void)a; (void)an; (void)b; (void)bn; (void)nonce;
    (void)tag;
    return -1;
#endif
}

/* This sealer's next nonce into ``out`` (never one it gave before: see auth.py). */
static inline void next_nonce(DispatcherObject *d, unsigned char *out) {
    uint64_t n = d->counter++;
    memcpy(out, d->prefix, 4);
    for (int i = 0; i < 8; i++) out[4 + i] = (unsigned char)(n >> (56 - 8 * i));
}

/* Seal the datagram a[0:an] b[0:bn] to ``dst``: its trailer (nonce, tag) into ``trailer``. */
static inline int seal(DispatcherObject *d, const unsigned char *dst, const unsigned char *a,
                       size_t an, const unsigned char *b, size_t bn, unsigned char *trailer) {
    next_nonce(d, trailer);
    return mac_tag(d, d->ident, dst, a, an, b, bn, trailer, trailer + NONCE_BYTES);
}

static inline int tags_equal(const unsigned char *x, const unsigned char *y) {
#ifdef BL_OPENSSL
    return CRYPTO_memcmp(x, y, TAG_BYTES) == 0;  /* constant time */
#else
    (void)x; (void)y;
    return 0;
#endif
}

static inline uint32_t bucket_of(uint32_t ip, uint16_t port, uint32_t rnd, uint32_t msg) {
    uint64_t k = ((uint64_t)ip << 16 | port) * 0x9E3779B97F4A7C15ull;
    k ^= ((uint64_t)rnd << 32 | msg) * 0xC2B2AE3D27D4EB4Full;
    return (uint32_t)(k >> 52) & (BUCKETS - 1);
}

static int dispatcher_init(DispatcherObject *d, PyObject *args, PyObject *kw) {
    unsigned long long session;
    if (!PyArg_ParseTuple(args, "K", &session)) return -1;
    d->session = session;
    return 0;
}

static void dispatcher_dealloc(DispatcherObject *d) {
    for (int b = 0; b < BUCKETS; b++) {
        ReceiveObject *r = d->table[b];
        while (r) {
            ReceiveObject *next = r->next;
            r->registered = 0;
            r->next = NULL;
            Py_DECREF(r);
            r = next;
        }
    }
    PyMem_Free(d->buf);
    PyMem_Free(d->lose);
    PyMem_RawFree(d->verdicts);
    PyMem_Free(d->stage);
#ifdef BL_OPENSSL
    if (d->gcm) CRYPTO_gcm128_release(d->gcm);
    EVP_CIPHER_CTX_free(d->aes);
#endif
    Py_TYPE(d)->tp_free((PyObject *)d);
}

#ifdef BL_OPENSSL
/* GCM's block cipher: AES-256 of one block under the job's key (``key`` is the
 * dispatcher). A failure is remembered, and every tag from then on fails. */
static void aes_block(const unsigned char in[16], unsigned char out[16], const void *key) {
    DispatcherObject *d = (DispatcherObject *)key;
    int len = 0;
    if (EVP_EncryptUpdate(d->aes, out, &len, in, 16) != 1 || len != 16) {
        memset(out, 0, 16);
        d->crypto_failed = 1;
    }
}

/* authenticate(key, ip, port, seed): from now on every datagram taken must carry a
 * valid tag, and every one built here is sealed; (ip, port) is this endpoint's own
 * address; seed (12 random bytes) starts this sealer's nonces. */
static PyObject *dispatcher_authenticate(DispatcherObject *d, PyObject *args) {
    Py_buffer key, seed;
    unsigned int ip, port;
    if (!PyArg_ParseTuple(args, "y*IIy*", &key, &ip, &port, &seed)) return NULL;
    PyObject *result = NULL;
    EVP_CIPHER_CTX *ctx = NULL;
    if (key.len != KEY_BYTES || seed.len != NONCE_BYTES || port > 0xFFFF || d->auth) {
        PyErr_SetString(PyExc_ValueError, "authenticate: a 32-byte key, a 12-byte seed, once");
        goto done;
    }
    ctx = EVP_CIPHER_CTX_new();
    if (ctx == NULL || EVP_EncryptInit_ex(ctx, EVP_aes_256_ecb(), NULL, key.buf, NULL) != 1
        || EVP_CIPHER_CTX_set_padding(ctx, 0) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL has no AES-256 here");
        EVP_CIPHER_CTX_free(ctx);
        goto done;
    }
    d->aes = ctx;
    d->crypto_failed = 0;
    d->gcm = CRYPTO_gcm128_new(d, aes_block);  /* (computes GHASH's key: one block) */
    if (d->gcm == NULL || d->crypto_failed) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's GCM could not start");
        if (d->gcm) CRYPTO_gcm128_release(d->gcm);
        d->gcm = NULL;
        EVP_CIPHER_CTX_free(ctx);
        d->aes = NULL;
        goto done;
    }
    put_ident(d->ident, ip, (uint16_t)port);
    const unsigned char *sd = seed.buf;
    memcpy(d->prefix, sd, 4);
    d->counter = 0;
    for (int i = 0; i < 8; i++) d->counter = d->counter << 8 | sd[4 + i];
    d->counter >>= 2;  /* (as NonceSequence: it never wraps) */
    d->auth = 1;
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&seed);
    return result;
}

/* tag(data, nonce, src_ip, src_port, dst_ip, dst_port) -> bytes: the tag protocol/auth.py
 * would put on ``data`` under ``nonce`` (tests hold the two to the same bytes). */
static PyObject *dispatcher_tag(DispatcherObject *d, PyObject *args) {
    Py_buffer b, nonce;
    unsigned int sip, sport, dip, dport;
    if (!PyArg_ParseTuple(args, "y*y*IIII", &b, &nonce, &sip, &sport, &dip, &dport))
        return NULL;
    unsigned char src[IDENT_BYTES], dst[IDENT_BYTES], tag[TAG_BYTES];
    put_ident(src, sip, (uint16_t)sport);
    put_ident(dst, dip, (uint16_t)dport);
    int r = d->auth && nonce.len == NONCE_BYTES
        ? mac_tag(d, src, dst, b.buf, (size_t)b.len, NULL, 0, nonce.buf, tag) : -1;
    PyBuffer_Release(&b);
    PyBuffer_Release(&nonce);
    if (r < 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "tag: not authenticating, a nonce not 12 bytes, or OpenSSL failed");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)tag, TAG_BYTES);
}

/* seal(datagram, dst_ip, dst_port) -> bytes: the trailer (this sealer's next nonce, the
 * tag) of a datagram from us to that peer - a control datagram the Python core built.
 * Holds the GIL: a tag is a fraction of a microsecond. */
static PyObject *dispatcher_seal(DispatcherObject *d, PyObject *args) {
    Py_buffer b;
    unsigned int ip, port;
    if (!PyArg_ParseTuple(args, "y*II", &b, &ip, &port)) return NULL;
    unsigned char dst[IDENT_BYTES], trailer[TRAILER_BYTES];
    put_ident(dst, ip, (uint16_t)port);
    int r = d->auth ? seal(d, dst, b.buf, (size_t)b.len, NULL, 0, trailer) : -1;
    PyBuffer_Release(&b);
    if (r < 0) {
        PyErr_SetString(PyExc_RuntimeError, "seal: not authenticating, or OpenSSL failed");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)trailer, TRAILER_BYTES);
}
#endif

static PyObject *dispatcher_register(DispatcherObject *d, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &ReceiveType)) {
        PyErr_SetString(PyExc_TypeError, "register takes a Receive");
        return NULL;
    }
    ReceiveObject *r = (ReceiveObject *)arg;
    if (!r->geometry || r->registered) {
        PyErr_SetString(PyExc_ValueError, "a Receive must be bound and not registered");
        return NULL;
    }
    uint32_t b = bucket_of(r->ip, r->port, r->round_id, r->message_id);
    Py_INCREF(r);
    r->next = d->table[b];
    d->table[b] = r;
    r->registered = 1;
    Py_RETURN_NONE;
}

static PyObject *dispatcher_unregister(DispatcherObject *d, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &ReceiveType)) {
        PyErr_SetString(PyExc_TypeError, "unregister takes a Receive");
        return NULL;
    }
    ReceiveObject *r = (ReceiveObject *)arg;
    if (!r->registered) Py_RETURN_NONE;
    ReceiveObject **p = &d->table[bucket_of(r->ip, r->port, r->round_id, r->message_id)];
    while (*p && *p != r) p = &(*p)->next;
    if (*p) {
        *p = r->next;
        r->next = NULL;
        r->registered = 0;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static inline ReceiveObject *lookup(DispatcherObject *d, uint32_t ip, uint16_t port,
                                    uint32_t rnd, uint32_t msg) {
    ReceiveObject *r = d->table[bucket_of(ip, port, rnd, msg)];
    while (r && !(r->ip == ip && r->port == port && r->round_id == rnd && r->message_id == msg))
        r = r->next;
    return r;
}

enum { TAKEN = 0, HANDED_BACK = 1, FAILED = -1 };
/* a datagram's tag: not checked yet, or what recv's check found (else a drop reason) */
enum { UNCHECKED = 255, VERIFIED = 0 };

/* Check a datagram's tag: VERIFIED, a drop reason, or FAILED (OpenSSL failed). Needs
 * no GIL. */
static int verify(DispatcherObject *d, const unsigned char *p, size_t n, uint32_t ip,
                  uint16_t port) {
    unsigned char src[IDENT_BYTES], tag[TAG_BYTES];
    if (n < HEADER_BYTES + TRAILER_BYTES) return R_SHORT;
    n -= TRAILER_BYTES;
    put_ident(src, ip, port);
    if (mac_tag(d, src, d->ident, p, n, NULL, 0, p + n, tag) < 0) return FAILED;
    if (!tags_equal(tag, p + n + NONCE_BYTES))
        return ld64(p + OFF_SESSION) != d->session ? R_FOREIGN_SESSION : R_BAD_AUTH;
    return VERIFIED;
}

/* Take one datagram if the data path may: TAKEN (counted, dropped or delivered), or
 * HANDED_BACK (Python's core must handle it, untouched but for its tag: when
 * authenticating, *np is cut to the datagram without it, verified). FAILED: a Python
 * error (appending an ACK to ``out``, OpenSSL failing). Mirrors
 * TransferMux.datagram_received followed by MessageReceiver.data_received for the
 * datagrams it takes. */
static int take(DispatcherObject *d, const unsigned char *p, size_t *np, uint32_t ip,
                uint16_t port, PyObject *out, int verdict) {
    Header h;
    size_t n = *np;
    if (d->auth) {  /* (as TransferMux.datagram_received: the tag before anything else) */
        if (verdict == UNCHECKED) verdict = verify(d, p, n, ip, port);
        if (verdict == FAILED) {
            PyErr_SetString(PyExc_RuntimeError, "boundedloss._native: OpenSSL's AES-GCM failed");
            return FAILED;
        }
        if (verdict != VERIFIED) {
            d->drops[verdict]++;
            d->taken++;
            return TAKEN;
        }
        n -= TRAILER_BYTES;
        *np = n;
    }
    int r = parse(p, n, &h);
    if (r != OK) {
        d->drops[r]++;
        d->taken++;
        return TAKEN;
    }
    if (h.session != d->session) {
        d->drops[R_FOREIGN_SESSION]++;
        d->taken++;
        return TAKEN;
    }
    if (h.kind != KIND_DATA) return HANDED_BACK;
    ReceiveObject *rx = lookup(d, ip, port, h.round_id, h.message_id);
    if (rx == NULL || !rx->heard || h.mbytes != rx->mbytes || h.cbytes != rx->cbytes)
        return HANDED_BACK;
    unsigned char *delivered = (unsigned char *)rx->delivered.buf;
    int fresh = !delivered[h.index];
    if (fresh) {
        /* would this chunk meet the plan? then Python's core closes the receive */
        long long now_delivered = rx->delivered_count + 1;
        long long crit = rx->critical_missing
            - (rx->has_critical && ((const unsigned char *)rx->critical.buf)[h.index] ? 1 : 0);
        if (now_delivered >= rx->need && crit == 0
            && (now_delivered == (long long)rx->count || rx->early_stop || rx->need == 0))
            return HANDED_BACK;
    }
    d->taken++;
    rx->datagrams++;
    rx->payload_bytes += h.plen;
    if ((long long)h.tseq > rx->max_tseq) rx->max_tseq = h.tseq;
    if (++rx->unacked >= (long long)rx->ack_every) {
        rx->unacked = 0;
        unsigned char *a = rx->ack;
        st32(a + OFF_TSEQ, (uint32_t)rx->max_tseq);
        st32(a + HEADER_BYTES, (uint32_t)rx->delivered_count);
        Py_ssize_t alen = HEADER_BYTES + 4;
        if (d->auth) {  /* sealed here: the mux hands the data path's datagrams out as is */
            unsigned char dst[IDENT_BYTES];
            put_ident(dst, rx->ip, rx->port);
            if (seal(d, dst, a, HEADER_BYTES + 4, NULL, 0, a + HEADER_BYTES + 4) < 0) {
                PyErr_SetString(PyExc_RuntimeError, "boundedloss._native: OpenSSL's AES-GCM failed");
                return FAILED;
            }
            alen += TRAILER_BYTES;
        }
        Py_INCREF(rx);  /* (allocating may run finalizers: keep rx alive meanwhile) */
        PyObject *ack = PyBytes_FromStringAndSize((const char *)a, alen);
        /* (sealed: marked so, as TransferMux.outbox says, for the mux not to seal it) */
        PyObject *item = ack == NULL ? NULL
            : d->auth ? Py_BuildValue("((N)OO)", ack, rx->peer, Py_True)
                      : Py_BuildValue("((N)O)", ack, rx->peer);
        int appended = item != NULL && PyList_Append(out, item) == 0;
        Py_XDECREF(item);
        Py_DECREF(rx);
        if (!appended) return FAILED;
    }
    if (!fresh) {
        rx->duplicates++;
        return TAKEN;
    }
    uint64_t off = (uint64_t)h.index * rx->cbytes;
    if (off + h.plen > (uint64_t)rx->dest.len) {  /* cannot happen: parse + bind checked */
        PyErr_SetString(PyExc_SystemError, "boundedloss._native: copy out of bounds");
        return FAILED;
    }
    memcpy((unsigned char *)rx->dest.buf + off, p + HEADER_BYTES, h.plen);
    delivered[h.index] = 1;
    rx->delivered_count++;
    if (rx->has_critical && ((const unsigned char *)rx->critical.buf)[h.index])
        rx->critical_missing--;
    return TAKEN;
}

/* take(datagram, ip, port, out) -> bool: the data path took it (False: Python's turn). */
static PyObject *dispatcher_take(DispatcherObject *d, PyObject *args) {
    Py_buffer b;
    unsigned int ip, port;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*IIO!", &b, &ip, &port, &PyList_Type, &out)) return NULL;
    size_t n = (size_t)b.len;
    int r = take(d, (const unsigned char *)b.buf, &n, ip, (uint16_t)port, out, UNCHECKED);
    PyBuffer_Release(&b);
    if (r == FAILED) return NULL;
    return PyBool_FromLong(r == TAKEN);
}

/* take_rows(rows, stride, lengths, ip, port, out, start) -> index: datagram i is
 * rows[i*stride : i*stride + lengths[i]] (lengths: uint32 array); takes datagrams from
 * ``start`` on and returns the index of the first one handed back (or their count). */
static PyObject *dispatcher_take_rows(DispatcherObject *d, PyObject *args) {
    Py_buffer rows, lengths;
    Py_ssize_t stride, start;
    unsigned int ip, port;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*ny*IIO!n", &rows, &stride, &lengths, &ip, &port,
                          &PyList_Type, &out, &start))
        return NULL;
    Py_ssize_t count = lengths.len / 4, i = start;
    PyObject *result = NULL;
    if (stride <= 0 || start < 0 || lengths.len % 4 || (count && stride > rows.len / count)) {
        PyErr_SetString(PyExc_ValueError, "rows, stride and lengths disagree");
        goto done;
    }
    for (; i < count; i++) {
        uint32_t len;
        memcpy(&len, (const unsigned char *)lengths.buf + 4 * i, sizeof len);
        if ((Py_ssize_t)len > stride) {
            PyErr_SetString(PyExc_ValueError, "a length exceeds the stride");
            goto done;
        }
        size_t n = len;
        int r = take(d, (const unsigned char *)rows.buf + i * stride, &n, ip, (uint16_t)port,
                     out, UNCHECKED);
        if (r == FAILED) goto done;
        if (r == HANDED_BACK) break;
    }
    result = PyLong_FromSsize_t(i);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&lengths);
    return result;
}

/* The tags of slot ``s``'s datagrams into d->verdicts, in order (the same walk as
 * step's). 0, or -1 (out of memory; nothing recorded). Needs no GIL. One message at a
 * time, just before step takes it, so that its bytes are still in the cache when they
 * are copied: checking the whole batch (up to 4 MB) first was slower (BENCHMARKS.md,
 * "Authenticated datagrams": 0.50 -> 0.60 of the unauthenticated goodput, one run). */
static int verify_slot(DispatcherObject *d, int s) {
    uint32_t len = d->lens[s], seg = d->segs[s] ? d->segs[s] : 1, off = 0;
    Py_ssize_t total = len == 0 ? 1 : (len + seg - 1) / seg, i = 0;
    if (total > d->verdicts_cap) {
        unsigned char *v = PyMem_RawRealloc(d->verdicts, (size_t)total);
        if (v == NULL) return -1;
        d->verdicts = v;
        d->verdicts_cap = total;
    }
    do {
        uint32_t n = len - off;
        if (n > seg) n = seg;
        int v = verify(d, d->buf + (size_t)s * SLOT_BYTES + off, n, d->ips[s], d->ports[s]);
        d->verdicts[i++] = v == FAILED ? UNCHECKED : (unsigned char)v;
        off += n;
    } while (off < len);
    return 0;
}

#ifdef __linux__
/* recv(fd) -> messages: one recvmmsg into the batch buffer, with the GIL released. Each
 * message is a datagram or, on a UDP_GRO socket, a run of equal-sized ones. 0 when
 * nothing is waiting. Raises OSError for errors other than EAGAIN. */
static PyObject *dispatcher_recv(DispatcherObject *d, PyObject *arg) {
    int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0) return NULL;
    if (d->buf == NULL) {
        d->buf = PyMem_Malloc((size_t)RECV_SLOTS * SLOT_BYTES);
        if (d->buf == NULL) return PyErr_NoMemory();
    }
    struct mmsghdr msgs[RECV_SLOTS];
    struct iovec iov[RECV_SLOTS];
    struct sockaddr_in addrs[RECV_SLOTS];
    union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(int))]; } ctrl[RECV_SLOTS];
    memset(msgs, 0, sizeof msgs);
    for (int i = 0; i < RECV_SLOTS; i++) {
        iov[i].iov_base = d->buf + (size_t)i * SLOT_BYTES;
        iov[i].iov_len = SLOT_BYTES;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &addrs[i];
        msgs[i].msg_hdr.msg_namelen = sizeof addrs[i];
        msgs[i].msg_hdr.msg_control = ctrl[i].buf;
        msgs[i].msg_hdr.msg_controllen = sizeof ctrl[i].buf;
    }
    int got, saved_errno = 0;
    d->batch = d->slot = 0;
    d->offset = 0;
    d->seq = 0;
    d->lose_len = 0;
    d->verified_slot = -1;
    Py_BEGIN_ALLOW_THREADS
    got = recvmmsg(fd, msgs, RECV_SLOTS, MSG_DONTWAIT, NULL);
    saved_errno = errno;
    for (int i = 0; i < got; i++) {
        uint32_t seg = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msgs[i].msg_hdr); c;
             c = CMSG_NXTHDR(&msgs[i].msg_hdr, c)) {
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                int v;
                memcpy(&v, CMSG_DATA(c), sizeof v);
                seg = v > 0 ? (uint32_t)v : 0;
            }
        }
        d->lens[i] = msgs[i].msg_len;
        d->segs[i] = seg && seg < msgs[i].msg_len ? seg : msgs[i].msg_len;
        d->ips[i] = ntohl(addrs[i].sin_addr.s_addr);
        d->ports[i] = ntohs(addrs[i].sin_port);
    }
    Py_END_ALLOW_THREADS
    if (got < 0) {
        if (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK) return PyLong_FromLong(0);
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    d->batch = got;
    return PyLong_FromLong(got);
}
#endif

#ifdef __linux__
/* Seal k datagrams laid out as (header, payload, trailer) iovecs: each one's trailer
 * into tags[j]. 1 if a tag failed, else 0. */
static int seal_pieces(DispatcherObject *d, const unsigned char *dst, const struct iovec *iov,
                       Py_ssize_t k, unsigned char (*tags)[TRAILER_BYTES]) {
    for (Py_ssize_t j = 0; j < k; j++)
        if (seal(d, dst, iov[3 * j].iov_base, HEADER_BYTES, iov[3 * j + 1].iov_base,
                 iov[3 * j + 1].iov_len, tags[j]) < 0)
            return 1;
    return 0;
}
#endif

/* send_run(sock, ip, port, headers, payload, indices, start, chunk_bytes, nbytes,
 *          segment) -> (next, err, end, calls): the DATA datagrams of one message, chunk
 * indices[start:] (indices: int64), each its header (48 bytes at i * 48 in headers) then its payload (at
 * i * chunk_bytes in payload), gathered straight from those buffers. With ``segment``
 * runs of equal-sized datagrams go out as one UDP_SEGMENT send each (the last may be
 * shorter), else up to 64 datagrams per sendmmsg. Stops at the first error: ``err`` is
 * its errno (0: all sent), ``next`` the first unsent index into indices, ``end`` the end
 * of the call that failed; ``calls``: system calls that sent. The GIL is released
 * around each call. */
#ifdef __linux__
#define SEND_MAX 64
#define GSO_MAX_BYTES 65507
static PyObject *dispatcher_send_run(DispatcherObject *d, PyObject *args) {
    PyObject *sock;
    unsigned int ip, port, cb;
    unsigned long long nbytes;
    Py_ssize_t start;
    int segment;
    Py_buffer hb, pb, ib;
    if (d->stage == NULL && (d->stage = PyMem_Malloc(GSO_MAX_BYTES)) == NULL)
        return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "OIIy*y*y*nIKp", &sock, &ip, &port, &hb, &pb, &ib, &start,
                          &cb, &nbytes, &segment))
        return NULL;
    PyObject *result = NULL;
    const int64_t *idx = ib.buf;
    Py_ssize_t n = ib.len / 8;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) goto done;
    uint64_t count = cb ? (nbytes + cb - 1) / cb : 0;
    if (count == 0) count = 1;
    if (cb == 0 || cb > MAX_CHUNK_BYTES || ib.len % 8 || start < 0 || start > n
        || (uint64_t)hb.len < count * HEADER_BYTES || (uint64_t)pb.len != nbytes) {
        PyErr_SetString(PyExc_ValueError, "send_run: buffers disagree with the geometry");
        goto done;
    }
    for (Py_ssize_t i = start; i < n; i++) {
        if (idx[i] < 0 || (uint64_t)idx[i] >= count) {
            PyErr_SetString(PyExc_ValueError, "send_run: chunk index out of range");
            goto done;
        }
    }
    struct sockaddr_in to;
    memset(&to, 0, sizeof to);
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(ip);
    to.sin_port = htons((uint16_t)port);
    const unsigned char *H = hb.buf, *P = pb.buf;
    uint64_t last_len = nbytes - (uint64_t)cb * (count - 1);
#define CLEN(c) ((c) == count - 1 ? last_len : cb)
    /* authenticating: every datagram ends in its trailer (a third piece, or in the stage) */
    const uint32_t trailer = d->auth ? TRAILER_BYTES : 0;
    const int pieces = trailer ? 3 : 2;
    unsigned char dst[IDENT_BYTES];
    put_ident(dst, ip, (uint16_t)port);
    struct iovec iov[3 * SEND_MAX];
    unsigned char tags[SEND_MAX][TRAILER_BYTES];
    struct mmsghdr msgs[SEND_MAX];
    union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(uint16_t))]; } ctrl;
    Py_ssize_t i = start, end = start;
    long calls = 0;
    int err = 0, mac_failed = 0;
    while (i < n) {
        Py_ssize_t k;  /* datagrams in this call */
        uint32_t size0 = HEADER_BYTES + (uint32_t)CLEN((uint64_t)idx[i]) + trailer;
        if (segment) {
            Py_ssize_t most = GSO_MAX_BYTES / size0;
            if (most > SEND_MAX) most = SEND_MAX;
            if (most < 1) most = 1;
            k = 1;
            while (i + k < n && k < most) {
                uint32_t sz = HEADER_BYTES + (uint32_t)CLEN((uint64_t)idx[i + k]) + trailer;
                if (sz != size0) {
                    if (sz < size0) k++;  /* a short last segment closes the run */
                    break;
                }
                k++;
            }
        } else {
            k = n - i < SEND_MAX ? n - i : SEND_MAX;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            uint64_t c = (uint64_t)idx[i + j];
            iov[pieces * j].iov_base = (void *)(H + (size_t)c * HEADER_BYTES);
            iov[pieces * j].iov_len = HEADER_BYTES;
            iov[pieces * j + 1].iov_base = (void *)(P + (size_t)c * cb);
            iov[pieces * j + 1].iov_len = (size_t)CLEN(c);
            if (trailer) {
                iov[pieces * j + 2].iov_base = tags[j];
                iov[pieces * j + 2].iov_len = TRAILER_BYTES;
            }
        }
        end = i + k;
        int sent;
        /* (the copies, tags and system call run without the GIL: the buffers are held) */
        if (segment) {
            struct msghdr m;
            memset(&m, 0, sizeof m);
            m.msg_name = &to;
            m.msg_namelen = sizeof to;
            m.msg_iov = iov;
            m.msg_iovlen = (size_t)(pieces * k);
            struct iovec whole;
            int staged = k > 1 && d->stage != NULL;
            if (staged) {
                /* one contiguous buffer: the kernel segments it faster than 2k pieces */
                whole.iov_base = d->stage;
                whole.iov_len = 0;
                m.msg_iov = &whole;
                m.msg_iovlen = 1;
            }
            if (k > 1) {
                memset(&ctrl, 0, sizeof ctrl);
                m.msg_control = ctrl.buf;
                m.msg_controllen = sizeof ctrl.buf;
                struct cmsghdr *c = CMSG_FIRSTHDR(&m);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t gso = (uint16_t)size0;
                memcpy(CMSG_DATA(c), &gso, sizeof gso);
            }
            ssize_t r = -1;
            Py_BEGIN_ALLOW_THREADS
            if (staged) {
                size_t at = 0;
                for (Py_ssize_t j = 0; j < k && !mac_failed; j++) {
                    size_t first = at;
                    for (int q = 0; q < 2; q++) {
                        memcpy(d->stage + at, iov[pieces * j + q].iov_base,
                               iov[pieces * j + q].iov_len);
                        at += iov[pieces * j + q].iov_len;
                    }
                    if (trailer) {
                        mac_failed = seal(d, dst, d->stage + first, at - first, NULL, 0,
                                          d->stage + at) < 0;
                        at += TRAILER_BYTES;
                    }
                }
                whole.iov_len = at;
            } else if (trailer) {
                mac_failed = seal_pieces(d, dst, iov, k, tags);
            }
            if (!mac_failed) r = sendmsg(fd, &m, 0);
            Py_END_ALLOW_THREADS
            sent = r < 0 ? -1 : (int)k;
        } else {
            memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)k);
            for (Py_ssize_t j = 0; j < k; j++) {
                msgs[j].msg_hdr.msg_name = &to;
                msgs[j].msg_hdr.msg_namelen = sizeof to;
                msgs[j].msg_hdr.msg_iov = &iov[pieces * j];
                msgs[j].msg_hdr.msg_iovlen = (size_t)pieces;
            }
            sent = -1;
            Py_BEGIN_ALLOW_THREADS
            if (trailer) mac_failed = seal_pieces(d, dst, iov, k, tags);
            if (!mac_failed) sent = sendmmsg(fd, msgs, (unsigned int)k, 0);
            Py_END_ALLOW_THREADS
            if (sent < 0) end = i + 1;  /* the first datagram failed */
        }
        if (mac_failed) break;
        if (sent < 0) {
            err = errno;
            break;
        }
        calls++;
        i += sent;  /* (sendmmsg may stop short: the next call says why) */
    }
    if (mac_failed) {
        PyErr_SetString(PyExc_RuntimeError, "boundedloss._native: OpenSSL's AES-GCM failed");
        goto done;
    }
#undef CLEN
    result = Py_BuildValue("(nini)", i, err, end, (int)calls);
done:
    PyBuffer_Release(&hb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ib);
    return result;
}
#endif

/* step(out) -> None | (datagram, ip, port): takes the batch's datagrams until one is
 * Python's; returns that one (a copy) or None when the batch is done. */
static PyObject *dispatcher_step(DispatcherObject *d, PyObject *out) {
    if (!PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "step takes a list");
        return NULL;
    }
    while (d->slot < d->batch) {
        int s = d->slot;
        if (d->auth && d->offset == 0 && d->verified_slot != s) {
            int ok;
            Py_BEGIN_ALLOW_THREADS
            ok = verify_slot(d, s) == 0;
            Py_END_ALLOW_THREADS
            d->verified_slot = ok ? s : -1;  /* (else take() checks each tag itself) */
            d->slot_seq0 = d->seq;
        }
        uint32_t len = d->lens[s], seg = d->segs[s];
        const unsigned char *p = d->buf + (size_t)s * SLOT_BYTES + d->offset;
        uint32_t n = len - d->offset;  /* (an empty datagram is one datagram too) */
        if (seg && n > seg) n = seg;
        d->offset += n;
        if (d->offset >= len) {
            d->slot++;
            d->offset = 0;
        }
        Py_ssize_t seq = d->seq++;
        if (seq < d->lose_len && d->lose[seq]) {
            d->drops[R_INJECTED_LOSS]++;  /* (as the Python path: not a datagram in) */
            continue;
        }
        size_t len_in = n;
        int verdict = d->verified_slot == s ? d->verdicts[seq - d->slot_seq0] : UNCHECKED;
        int r = take(d, p, &len_in, d->ips[s], d->ports[s], out, verdict);
        if (r == FAILED) return NULL;
        if (r == HANDED_BACK)  /* (verified and without its tag, when authenticating) */
            return Py_BuildValue("(y#II)", (const char *)p, (Py_ssize_t)len_in, d->ips[s],
                                 (unsigned int)d->ports[s]);
    }
    Py_RETURN_NONE;
}

/* load(messages, ip, port) -> count: a batch from Python instead of a socket, for tests:
 * each message a bytes-like datagram, or (bytes, segment) for a run of ``segment``-byte
 * datagrams as UDP GRO hands them over (the last may be shorter). */
static PyObject *dispatcher_load(DispatcherObject *d, PyObject *args) {
    PyObject *messages;
    unsigned int ip, port;
    if (!PyArg_ParseTuple(args, "OII", &messages, &ip, &port)) return NULL;
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > RECV_SLOTS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "at most %d messages a batch", RECV_SLOTS);
        return NULL;
    }
    if (d->buf == NULL && (d->buf = PyMem_Malloc((size_t)RECV_SLOTS * SLOT_BYTES)) == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    d->batch = d->slot = 0;
    d->offset = 0;
    d->seq = 0;
    d->lose_len = 0;
    d->verified_slot = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *data = item;
        unsigned long segment = 0;
        if (PyTuple_Check(item)) {
            if (!PyArg_ParseTuple(item, "Ok", &data, &segment)) goto fail;
        }
        Py_buffer b;
        if (PyObject_GetBuffer(data, &b, PyBUF_SIMPLE) < 0) goto fail;
        if (b.len > SLOT_BYTES) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "a message over 64 KB");
            goto fail;
        }
        memcpy(d->buf + (size_t)i * SLOT_BYTES, b.buf, (size_t)b.len);
        d->lens[i] = (uint32_t)b.len;
        d->segs[i] = segment && segment < (unsigned long)b.len ? (uint32_t)segment
                                                               : (uint32_t)b.len;
        d->ips[i] = ip;
        d->ports[i] = (uint16_t)port;
        PyBuffer_Release(&b);
    }
    Py_DECREF(seq);
    d->batch = (int)n;
    return PyLong_FromSsize_t(n);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* batch_rounds() -> bytes: the round id of every datagram of the batch, in order, as
 * little-endian int64 (-1 for one shorter than a header, as wire.peek_round): what a
 * loss model decides on. */
static PyObject *dispatcher_batch_rounds(DispatcherObject *d, PyObject *unused) {
    (void)unused;
    Py_ssize_t total = 0;
    for (int s = 0; s < d->batch; s++) {
        uint32_t seg = d->segs[s];
        total += d->lens[s] == 0 ? 1 : (d->lens[s] + (seg ? seg : 1) - 1) / (seg ? seg : 1);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total * 8);
    if (out == NULL) return NULL;
    int64_t *r = (int64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t i = 0;
    for (int s = 0; s < d->batch; s++) {
        uint32_t len = d->lens[s], seg = d->segs[s], off = 0;
        do {
            uint32_t n = len - off;
            if (seg && n > seg) n = seg;
            const unsigned char *p = d->buf + (size_t)s * SLOT_BYTES + off;
            r[i++] = n >= HEADER_BYTES ? (int64_t)ld32(p + OFF_ROUND) : -1;
            off += n;
        } while (off < len);
    }
    return out;
}

/* lose(mask): mask[i] true drops the batch's i-th datagram (counted as injected loss). */
static PyObject *dispatcher_lose(DispatcherObject *d, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (b.len > d->lose_cap) {
        unsigned char *p = PyMem_Realloc(d->lose, (size_t)b.len);
        if (p == NULL) {
            PyBuffer_Release(&b);
            return PyErr_NoMemory();
        }
        d->lose = p;
        d->lose_cap = b.len;
    }
    memcpy(d->lose, b.buf, (size_t)b.len);
    d->lose_len = b.len;
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *dispatcher_counters(DispatcherObject *d, PyObject *unused) {
    PyObject *c = PyDict_New();
    if (c == NULL) return NULL;
    for (int r = 1; r < N_REASONS; r++) {
        if (!d->drops[r]) continue;
        PyObject *v = PyLong_FromLongLong(d->drops[r]);
        if (v == NULL || PyDict_SetItemString(c, REASONS[r], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(c);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyObject *v = PyLong_FromLongLong(d->taken);
    if (v == NULL || PyDict_SetItemString(c, "taken", v) < 0) {
        Py_XDECREF(v);
        Py_DECREF(c);
        return NULL;
    }
    Py_DECREF(v);
    return c;
}

static PyMethodDef dispatcher_methods[] = {
    {"register", (PyCFunction)dispatcher_register, METH_O, "Take DATA for this receive."},
    {"unregister", (PyCFunction)dispatcher_unregister, METH_O, "Stop taking its DATA."},
    {"take", (PyCFunction)dispatcher_take, METH_VARARGS, "Take one datagram if it may."},
#ifdef BL_OPENSSL
    {"authenticate", (PyCFunction)dispatcher_authenticate, METH_VARARGS,
     "Verify and seal every datagram under this key from now on."},
    {"tag", (PyCFunction)dispatcher_tag, METH_VARARGS, "The tag of a datagram (tests)."},
    {"seal", (PyCFunction)dispatcher_seal, METH_VARARGS, "A datagram's trailer, to a peer."},
#endif
    {"take_rows", (PyCFunction)dispatcher_take_rows, METH_VARARGS, "Take rows of datagrams."},
#ifdef __linux__
    {"recv", (PyCFunction)dispatcher_recv, METH_O, "Receive a batch from a socket."},
#endif
    {"step", (PyCFunction)dispatcher_step, METH_O, "Take the batch until Python's turn."},
#ifdef __linux__
    {"send_run", (PyCFunction)dispatcher_send_run, METH_VARARGS, "Send a run of DATA."},
#endif
    {"batch_rounds", (PyCFunction)dispatcher_batch_rounds, METH_NOARGS,
     "Round ids of the batch's datagrams."},
    {"lose", (PyCFunction)dispatcher_lose, METH_O, "Drop datagrams of the batch."},
    {"load", (PyCFunction)dispatcher_load, METH_VARARGS, "A batch from Python (tests)."},
    {"counters", (PyCFunction)dispatcher_counters, METH_NOARGS, "Taken and dropped counts."},
    {NULL},
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boundedloss._native.Dispatcher",
    .tp_basicsize = sizeof(DispatcherObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The DATA fast path of one endpoint.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)dispatcher_init,
    .tp_dealloc = (destructor)dispatcher_dealloc,
    .tp_methods = dispatcher_methods,
};

/* --------------------------------------------------------------- ceiling */
#ifdef __linux__
#include <time.h>

/* blast(sock, ip, port, size, count, segment, source) -> calls: ``count`` datagrams of
 * ``size`` bytes and no protocol, the machine's own limit for that kind of send: one
 * sendto each, or (``segment``) as many per UDP_SEGMENT send as 64 KB and 64 segments
 * allow. Their bytes come from ``source`` in order (wrapping around), as a message's
 * would; with None, from one small buffer the cache keeps. A full socket buffer is
 * waited out (poll), never dropped. */
static PyObject *native_blast(PyObject *self, PyObject *args) {
    PyObject *sock, *source;
    unsigned int ip, port, size;
    Py_ssize_t count;
    int segment;
    (void)self;
    if (!PyArg_ParseTuple(args, "OIIInpO", &sock, &ip, &port, &size, &count, &segment,
                          &source))
        return NULL;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) return NULL;
    if (size == 0 || size > GSO_MAX_BYTES || count < 0) {
        PyErr_SetString(PyExc_ValueError, "blast: bad size or count");
        return NULL;
    }
    unsigned int per = segment ? GSO_MAX_BYTES / size : 1;
    if (per > SEND_MAX) per = SEND_MAX;
    if (per < 1) per = 1;
    Py_buffer src = {0};
    int has_source = source != Py_None;
    if (has_source && PyObject_GetBuffer(source, &src, PyBUF_SIMPLE) < 0) return NULL;
    if (has_source && (size_t)src.len < (size_t)per * size) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "blast: source shorter than one send");
        return NULL;
    }
    unsigned char *data = PyMem_Calloc((size_t)per, size);
    if (data == NULL) {
        if (has_source) PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }
    size_t at = 0;
    struct sockaddr_in to;
    memset(&to, 0, sizeof to);
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(ip);
    to.sin_port = htons((uint16_t)port);
    union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(uint16_t))]; } ctrl;
    long long calls = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t left = count;
    while (left > 0) {
        unsigned int k = left < (Py_ssize_t)per ? (unsigned int)left : per;
        struct iovec iov = {data, (size_t)k * size};
        if (has_source) {
            if (at + iov.iov_len > (size_t)src.len) at = 0;
            iov.iov_base = (unsigned char *)src.buf + at;
        }
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_name = &to;
        m.msg_namelen = sizeof to;
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        if (k > 1) {
            memset(&ctrl, 0, sizeof ctrl);
            m.msg_control = ctrl.buf;
            m.msg_controllen = sizeof ctrl.buf;
            struct cmsghdr *c = CMSG_FIRSTHDR(&m);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso = (uint16_t)size;
            memcpy(CMSG_DATA(c), &gso, sizeof gso);
        }
        if (sendmsg(fd, &m, 0) < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
                struct pollfd p = {fd, POLLOUT, 0};
                poll(&p, 1, 10);
                continue;
            }
            err = errno;
            break;
        }
        calls++;
        left -= k;
        at += iov.iov_len;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(data);
    if (has_source) PyBuffer_Release(&src);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(calls);
}

/* drain(sock, dest) -> (datagrams, bytes, last): receive until a 1-byte datagram (the
 * end marker) arrives, counting datagrams (a GRO run counts as its segments) and their
 * bytes, each copied on into ``dest`` in order (wrapping around), as a message's would
 * be (None: not copied); ``last``: CLOCK_MONOTONIC (Python's time.monotonic) when the
 * last one came. Blocking, one recvmsg per call, the GIL released throughout. */
static PyObject *native_drain(PyObject *self, PyObject *args) {
    PyObject *sock, *dest;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO", &sock, &dest)) return NULL;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) return NULL;
    Py_buffer dst = {0};
    int has_dest = dest != Py_None;
    if (has_dest && PyObject_GetBuffer(dest, &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (has_dest && dst.len < SLOT_BYTES) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "drain: dest shorter than 64 KB");
        return NULL;
    }
    size_t at = 0;
    unsigned char *buf = PyMem_Malloc(SLOT_BYTES);
    if (buf == NULL) {
        if (has_dest) PyBuffer_Release(&dst);
        return PyErr_NoMemory();
    }
    long long datagrams = 0, bytes = 0;
    double last = 0.0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(int))]; } ctrl;
        struct iovec iov = {buf, SLOT_BYTES};
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctrl.buf;
        m.msg_controllen = sizeof ctrl.buf;
        ssize_t n = recvmsg(fd, &m, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (n == 1) break;
        int seg = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) memcpy(&seg, CMSG_DATA(c), sizeof seg);
        datagrams += seg > 0 ? (n + seg - 1) / seg : 1;
        bytes += n;
        if (has_dest) {
            if (at + (size_t)n > (size_t)dst.len) at = 0;
            memcpy((unsigned char *)dst.buf + at, buf, (size_t)n);
            at += (size_t)n;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        last = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(buf);
    if (has_dest) PyBuffer_Release(&dst);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(LLd)", datagrams, bytes, last);
}
#endif

/* ------------------------------------------------------------------ fwht */
/* The normalised Walsh-Hadamard transform of every ``width`` block of x, with the same
 * floating-point operations in the same order as aggregate.hadamard's numpy version (so
 * the same bits): the butterfly stages on the high index bits (h = B .. width/2), the
 * 1/sqrt(width) scale, then the low bits (h = 1 .. B/2), B = 2^(floor(log2 width / 2)).
 * Two stages at a time (h and 2h touch the same four elements, so doing both per
 * four-tuple changes no operation), the high stages sweeping the block (it fits in L2),
 * the scale and the low stages one B-run at a time, in L1. */
#define STAGE2(T, x, h, len)                                                            \
    for (size_t g = 0; g < (len); g += 2 * (h))                                         \
        for (size_t i = g; i < g + (h); i++) {                                          \
            T a = (x)[i], b = (x)[i + (h)];                                             \
            (x)[i] = a + b;                                                             \
            (x)[i + (h)] = a - b;                                                       \
        }
#define STAGE4(T, x, h, len)                                                            \
    for (size_t g = 0; g < (len); g += 4 * (h))                                         \
        for (size_t i = g; i < g + (h); i++) {                                          \
            T a = (x)[i], b = (x)[i + (h)], c = (x)[i + 2 * (h)], d = (x)[i + 3 * (h)];   \
            T p = a + b, q = a - b, r = c + d, t = c - d;                               \
            (x)[i] = p + r;                                                             \
            (x)[i + 2 * (h)] = p - r;                                                   \
            (x)[i + (h)] = q + t;                                                       \
            (x)[i + 3 * (h)] = q - t;                                                   \
        }
#define STAGES(T, x, from, to)                                                          \
    {                                                                                   \
        size_t h_ = (from);                                                             \
        for (; 2 * h_ < (to); h_ *= 4) STAGE4(T, x, h_, (to))                           \
        if (h_ < (to)) STAGE2(T, x, h_, (to))                                           \
    }
#if defined(__GNUC__) && !defined(__clang__)
/* float32's scale and low stages on one B-run (B a multiple of 16) four lanes at a time,
 * each lane doing exactly the scalar code's operations: the first two stages (h = 1, 2)
 * on four groups of four at once, transposed so that a lane holds one group's a, b, c
 * or d; the later ones (h >= 4) on four consecutive i at once. */
typedef float v4sf __attribute__((vector_size(16)));
typedef int v4si __attribute__((vector_size(16)));

static inline v4sf ld4(const float *p) { v4sf v; memcpy(&v, p, sizeof v); return v; }
static inline void st4(float *p, v4sf v) { memcpy(p, &v, sizeof v); }

static inline void transpose4(v4sf *r0, v4sf *r1, v4sf *r2, v4sf *r3) {
    v4sf t0 = __builtin_shuffle(*r0, *r1, (v4si){0, 4, 1, 5});
    v4sf t1 = __builtin_shuffle(*r0, *r1, (v4si){2, 6, 3, 7});
    v4sf t2 = __builtin_shuffle(*r2, *r3, (v4si){0, 4, 1, 5});
    v4sf t3 = __builtin_shuffle(*r2, *r3, (v4si){2, 6, 3, 7});
    *r0 = __builtin_shuffle(t0, t2, (v4si){0, 1, 4, 5});
    *r1 = __builtin_shuffle(t0, t2, (v4si){2, 3, 6, 7});
    *r2 = __builtin_shuffle(t1, t3, (v4si){0, 1, 4, 5});
    *r3 = __builtin_shuffle(t1, t3, (v4si){2, 3, 6, 7});
}

static void low_stages_f32(float *y, size_t B, float scale) {
    v4sf s = {scale, scale, scale, scale};
    for (size_t g = 0; g < B; g += 16) {
        v4sf a = ld4(y + g) * s, b = ld4(y + g + 4) * s;
        v4sf c = ld4(y + g + 8) * s, d = ld4(y + g + 12) * s;
        transpose4(&a, &b, &c, &d);  /* a: every group's first element, and so on */
        v4sf p = a + b, q = a - b, r = c + d, t = c - d;
        a = p + r; b = q + t; c = p - r; d = q - t;
        transpose4(&a, &b, &c, &d);
        st4(y + g, a); st4(y + g + 4, b); st4(y + g + 8, c); st4(y + g + 12, d);
    }
    size_t h = 4;
    for (; 2 * h < B; h *= 4)
        for (size_t g = 0; g < B; g += 4 * h)
            for (size_t i = g; i < g + h; i += 4) {
                v4sf a = ld4(y + i), b = ld4(y + i + h), c = ld4(y + i + 2 * h);
                v4sf d = ld4(y + i + 3 * h);
                v4sf p = a + b, q = a - b, r = c + d, t = c - d;
                st4(y + i, p + r); st4(y + i + 2 * h, p - r);
                st4(y + i + h, q + t); st4(y + i + 3 * h, q - t);
            }
    if (h < B)
        for (size_t g = 0; g < B; g += 2 * h)
            for (size_t i = g; i < g + h; i += 4) {
                v4sf a = ld4(y + i), b = ld4(y + i + h);
                st4(y + i, a + b); st4(y + i + h, a - b);
            }
}
#define LOW_STAGES_F32(y, B, scale) ((B) % 16 == 0 ? (low_stages_f32((y), (B), (scale)), 1) : 0)
#else
#define LOW_STAGES_F32(y, B, scale) 0
#endif

#define LOW_STAGES(T, y, B, scale)                                                      \
    {                                                                                   \
        for (size_t i = 0; i < (B); i++) (y)[i] = (y)[i] * (scale);                     \
        STAGES(T, y, 1, B)                                                              \
    }

#define FWHT_BODY(T, FAST_LOW)                                                          \
    for (size_t base = 0; base < n; base += width) {                                    \
        T *x = data + base;                                                             \
        for (size_t h = B; h < width; h *= 4) {                                         \
            if (2 * h < width) {                                                        \
                STAGE4(T, x, h, width)                                                  \
            } else {                                                                    \
                STAGE2(T, x, h, width)                                                  \
            }                                                                           \
        }                                                                               \
        for (size_t g0 = 0; g0 < width; g0 += B) {                                      \
            T *y = x + g0;                                                              \
            if (!FAST_LOW(y, B, scale)) LOW_STAGES(T, y, B, scale)                      \
        }                                                                               \
    }
#define NO_FAST_LOW(y, B, scale) 0

/* fwht(buffer, width, itemsize): in place, float32 (4) or float64 (8). */
static PyObject *native_fwht(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t width_arg, itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*nn", &b, &width_arg, &itemsize)) return NULL;
    size_t width = (size_t)width_arg;
    if (width_arg < 1 || (width & (width - 1)) || (itemsize != 4 && itemsize != 8)
        || width_arg > b.len / itemsize || b.len % (itemsize * width_arg)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "fwht: width must be a power of two dividing the buffer");
        return NULL;
    }
    if (width > 1) {
        int log2 = 0;
        while (((size_t)1 << log2) < width) log2++;
        size_t B = (size_t)1 << (log2 / 2);
        size_t n = (size_t)b.len / (size_t)itemsize;
        double s = 1.0 / sqrt((double)width);
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4) {
            float *data = (float *)b.buf, scale = (float)s;
            FWHT_BODY(float, LOW_STAGES_F32)
        } else {
            double *data = (double *)b.buf, scale = s;
            FWHT_BODY(double, NO_FAST_LOW)
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* flip_signs(buffer, bits, itemsize): negate element i where bit i of ``bits`` is set
 * (most significant bit first, as numpy.unpackbits reads them) - multiplying by D's
 * +/-1, exactly: a sign flip is what x * -1 is. float32 (4) or float64 (8). */
static PyObject *native_flip_signs(PyObject *self, PyObject *args) {
    Py_buffer b, bits;
    Py_ssize_t itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*n", &b, &bits, &itemsize)) return NULL;
    PyObject *result = NULL;
    if ((itemsize != 4 && itemsize != 8) || b.len % itemsize
        || bits.len * 8 < b.len / itemsize) {
        PyErr_SetString(PyExc_ValueError, "flip_signs: need a bit per element");
        goto done;
    }
    size_t n = (size_t)(b.len / itemsize);
    const unsigned char *m = bits.buf;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4) {
        uint32_t *v = (uint32_t *)b.buf;
        for (size_t i = 0; i < n; i++)
            v[i] ^= (uint32_t)((m[i >> 3] >> (7 - (i & 7))) & 1) << 31;
    } else {
        uint64_t *v = (uint64_t *)b.buf;
        for (size_t i = 0; i < n; i++)
            v[i] ^= (uint64_t)((m[i >> 3] >> (7 - (i & 7))) & 1) << 63;
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&bits);
    return result;
}

/* ---------------------------------------------------------------- module */
static PyMethodDef module_methods[] = {
    {"classify", native_classify, METH_O,
     "None for a datagram wire.parse accepts, else the DropReason value it fails with."},
    {"fwht", native_fwht, METH_VARARGS, "Normalised Walsh-Hadamard transform in place."},
    {"flip_signs", native_flip_signs, METH_VARARGS, "Negate the elements a bit marks."},
#ifdef __linux__
    {"blast", native_blast, METH_VARARGS, "Send datagrams with no protocol (the ceiling)."},
    {"drain", native_drain, METH_VARARGS, "Receive until an end marker (the ceiling)."},
#endif
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "boundedloss._native",
    "The per-datagram data path under boundedloss's Python core.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ReceiveType) < 0 || PyType_Ready(&DispatcherType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *layout = Py_BuildValue(
        "{sisisisisisisisisisisisisi}", "magic", OFF_MAGIC, "version", OFF_VERSION, "kind",
        OFF_KIND, "flags", OFF_FLAGS, "plen", OFF_PLEN, "session", OFF_SESSION, "round",
        OFF_ROUND, "message", OFF_MESSAGE, "index", OFF_INDEX, "count", OFF_COUNT, "mbytes",
        OFF_MBYTES, "cbytes", OFF_CBYTES, "tseq", OFF_TSEQ);
    /* (PyModule_AddObjectRef takes its own reference: ours are dropped either way) */
    int failed = layout == NULL || PyModule_AddObjectRef(m, "LAYOUT", layout) < 0
        || PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0
        || PyModule_AddIntConstant(m, "MAGIC", MAGIC) < 0
        || PyModule_AddIntConstant(m, "VERSION", VERSION) < 0
        || PyModule_AddIntConstant(m, "MAX_CHUNK_BYTES", MAX_CHUNK_BYTES) < 0
        || PyModule_AddIntConstant(m, "TRAILER_BYTES", TRAILER_BYTES) < 0
#ifdef BL_OPENSSL
        || PyModule_AddIntConstant(m, "AUTH", 1) < 0
#else
        || PyModule_AddIntConstant(m, "AUTH", 0) < 0
#endif
        || PyModule_AddObjectRef(m, "Receive", (PyObject *)&ReceiveType) < 0
        || PyModule_AddObjectRef(m, "Dispatcher", (PyObject *)&DispatcherType) < 0;
    Py_XDECREF(layout);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
