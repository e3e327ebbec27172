/*
 * Dispatcher: the per-datagram data path under the Python protocol core.
 *
 * It moves bytes and keeps counts; what to do with a message is the Python core's. What
 * it does:
 *   - takes DATA datagrams for receives the Python core registered: finds the receive,
 *     copies the payload into its destination, marks the chunk delivered, counts, and
 *     builds the ACK the receiver owes every ack_every datagrams;
 *   - receives batches from a UDP socket (recvmmsg, each message possibly a GRO run)
 *     with the GIL released (Dispatcher.recv), and sends runs (UDP_SEGMENT);
 *   - with a job's key (Dispatcher.authenticate), verifies the tag every datagram ends in
 *     before anything else reads it, and seals what it sends (the DATA of send_run, its
 *     ACKs) through its Sealer (seal.c);
 *   - takes the ACKs for sends the Python core registered: the bookkeeping an ACK is
 *     (the peer heard, what it reported, recovery's ACK counters, the flow-control
 *     window) in the Send object the send shares with Python;
 *   - answers a PROBE for an open receive with its BITMAP, as the core would, but for
 *     the first FINAL one (the receive's state changes) and one that meets its plan
 *     (under credit, the core answers every PROBE: it grants with its answer); a DATA
 *     that carries its send's first PROBE (FLAG_PROBE_CARRIED) is taken as DATA, and the
 *     PROBE handed to the core as an event;
 *   - under credit, stamps the share the core set (Dispatcher.credit) on each ACK it
 *     builds, as often as that share calls for (credit.ack_cadence);
 *   - answers for messages that closed, as the core would: a closed receive the core
 *     still remembers has its late DATA and PROBEs counted stale and its STOP said again
 *     (to a PROBE at once, to DATA at most once per min_rto); a finished send (the
 *     latest CLOSED_SENDS) has its late ACKs, STOPs and BITMAPs counted stale.
 *   - closes a receive the core lets close here (Receive.close_here: its close decides
 *     nothing) when a DATA it takes meets the plan: its STOP said, the receive kept as
 *     a closed one, and listed for the core (Dispatcher.closed), which records its
 *     result before the next datagram.
 * A datagram it cannot take without a decision - the first one of a receive whose plan
 * starts a clock on it or, under credit, whose sender starts to share the budget, a
 * PROBE that would meet the receive's plan, the first FINAL PROBE, an ACK the send says
 * needs the core, a BITMAP for an open send, one for an unknown message - is handed back
 * to Python untouched, in order, and Python's core handles it as always; a DATA that
 * meets the plan of a receive the core closes, or a STOP for an open send, it takes and
 * hands the core the decision of (an event) before the next datagram. The counters a
 * receive shares with Python live in a Receive object that both read; what a send's ACKs
 * move, in a Send.
 */
#include "native.h"
#include "seal.h"

#define BUCKETS 4096
#define RECV_SLOTS 64
/* closed sends kept, the oldest let go first, so that their late answers count stale here */
#define CLOSED_SENDS 1024

typedef struct {
    PyObject_HEAD
    uint64_t session;
    ReceiveObject *table[BUCKETS];
    SendObject *sends[BUCKETS];
    SendObject *closed_sends[CLOSED_SENDS];  /* a ring of the sends closed lately */
    int closed_next;
    double now;                      /* the time of the take or step (an ACK: heard then) */
    /* under credit (protocol/credit.py), the share the core grants each receive that is
     * not parked; 0: no credit */
    long long credit;
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
    /* the tags of one message of the batch (slot ``verified_slot``; -1: none), checked
     * without the GIL just before step takes its datagrams: VERIFIED or a drop reason */
    unsigned char *verdicts;
    Py_ssize_t verdicts_cap, slot_seq0;  /* (slot_seq0: the batch index of its first) */
    int verified_slot;
    Sealer sealer;                   /* on: every datagram carries a tag (authenticate) */
    /* the event take() returned EVENT for (see EVENT): a receive's plan met (KIND_DATA,
     * ``event_rx``), a first PROBE a DATA for it carried (KIND_PROBE), or a STOP for an
     * open send (KIND_STOP, its key, index and count) */
    int event_kind;
    ReceiveObject *event_rx;
    /* the receives closed here (close_here) whose results the core has not made yet: a
     * list of (peer, round, message, reason, stop), or NULL */
    PyObject *closed;
    uint32_t event_ip, event_round, event_message, event_index, event_delivered;
    uint16_t event_port;
} DispatcherObject;

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
    for (int i = 0; i < CLOSED_SENDS; i++) Py_CLEAR(d->closed_sends[i]);
    for (int b = 0; b < BUCKETS; b++) {
        SendObject *s = d->sends[b];
        while (s) {
            SendObject *next = s->next;
            s->registered = 0;
            s->next = NULL;
            Py_DECREF(s);
            s = next;
        }
    }
    Py_CLEAR(d->closed);
    PyMem_Free(d->buf);
    PyMem_Free(d->lose);
    PyMem_RawFree(d->verdicts);
    PyMem_Free(d->stage);
    sealer_release(&d->sealer);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

#ifdef BL_OPENSSL
/* authenticate(key, ip, port, seed): from now on every datagram taken must carry a
 * valid tag, and every one built here is sealed; (ip, port) is this endpoint's own
 * address; seed (12 random bytes) starts this sealer's nonces. */
static PyObject *dispatcher_authenticate(DispatcherObject *d, PyObject *args) {
    Py_buffer key, seed;
    unsigned int ip, port;
    if (!PyArg_ParseTuple(args, "y*IIy*", &key, &ip, &port, &seed)) return NULL;
    PyObject *result = NULL;
    if (key.len != KEY_BYTES || seed.len != NONCE_BYTES || port > 0xFFFF || d->sealer.on)
        PyErr_SetString(PyExc_ValueError, "authenticate: a 32-byte key, a 12-byte seed, once");
    else if (sealer_start(&d->sealer, key.buf, ip, (uint16_t)port, seed.buf) < 0)
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL has no AES-256 here, or its GCM could "
                                            "not start");
    else
        result = Py_NewRef(Py_None);
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
    int r = d->sealer.on && nonce.len == NONCE_BYTES
        ? sealer_tag(&d->sealer, src, dst, b.buf, (size_t)b.len, NULL, 0, nonce.buf, tag)
        : -1;
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
    int r = d->sealer.on
        ? sealer_seal(&d->sealer, dst, b.buf, (size_t)b.len, NULL, 0, trailer) : -1;
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

/* What take() did with a datagram. EVENT: taken, and the Python core must decide
 * something about it before the next datagram - a receive whose plan this DATA met
 * closes (one the core closes), a send that a STOP ends - with what the data path parsed
 * already (d->event_*): the same decisions as for the datagram handed back, without the
 * core parsing and routing it again. */
enum { TAKEN = 0, HANDED_BACK = 1, EVENT = 2, FAILED = -1 };
/* (and CLOSED_HERE: taken, and the receive it met the plan of closed here - listed in
 * d->closed for the core, which makes its result before it handles anything else) */
enum { CLOSED_HERE = 3 };

static PyObject *dispatcher_register_send(DispatcherObject *d, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &SendType)) {
        PyErr_SetString(PyExc_TypeError, "register_send takes a Send");
        return NULL;
    }
    SendObject *s = (SendObject *)arg;
    if (!s->geometry || s->registered) {
        PyErr_SetString(PyExc_ValueError, "a Send must be bound and not registered");
        return NULL;
    }
    uint32_t b = bucket_of(s->ip, s->port, s->round_id, s->message_id);
    Py_INCREF(s);
    s->next = d->sends[b];
    d->sends[b] = s;
    s->registered = 1;
    Py_RETURN_NONE;
}

static PyObject *dispatcher_unregister_send(DispatcherObject *d, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &SendType)) {
        PyErr_SetString(PyExc_TypeError, "unregister_send takes a Send");
        return NULL;
    }
    SendObject *s = (SendObject *)arg;
    if (!s->registered) Py_RETURN_NONE;
    SendObject **p = &d->sends[bucket_of(s->ip, s->port, s->round_id, s->message_id)];
    while (*p && *p != s) p = &(*p)->next;
    if (*p) {
        *p = s->next;
        s->next = NULL;
        s->registered = 0;
        Py_DECREF(s);
    }
    Py_RETURN_NONE;
}

/* close_send(send): it finished. It stays registered for a while (the last
 * CLOSED_SENDS closed), so that an ACK, STOP or BITMAP that still comes for it is counted
 * stale here - as TransferMux counts one for a send it no longer has. */
static PyObject *dispatcher_close_send(DispatcherObject *d, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &SendType)) {
        PyErr_SetString(PyExc_TypeError, "close_send takes a Send");
        return NULL;
    }
    SendObject *s = (SendObject *)arg;
    if (!s->registered || s->closed) Py_RETURN_NONE;
    s->closed = 1;
    SendObject *oldest = d->closed_sends[d->closed_next];
    d->closed_sends[d->closed_next] = (SendObject *)Py_NewRef(arg);
    d->closed_next = (d->closed_next + 1) % CLOSED_SENDS;
    if (oldest != NULL) {
        PyObject *r = dispatcher_unregister_send(d, (PyObject *)oldest);
        Py_DECREF(oldest);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static inline SendObject *lookup_send(DispatcherObject *d, uint32_t ip, uint16_t port,
                                      uint32_t rnd, uint32_t msg) {
    SendObject *s = d->sends[bucket_of(ip, port, rnd, msg)];
    while (s && !(s->ip == ip && s->port == port && s->round_id == rnd && s->message_id == msg))
        s = s->next;
    return s;
}

/* A datagram for a message that has closed here: counted and dropped. */
static inline int stale(DispatcherObject *d) {
    d->drops[R_STALE]++;
    d->taken++;
    return TAKEN;
}

/* A DATA or PROBE datagram for a receive that has closed (TransferMux._answer_closed):
 * stale; and the receive's STOP said again - to a PROBE at once, to DATA still streaming
 * in at most once per min_rto - appended to ``out`` as the core appends it (unsealed:
 * the core seals what it polls). */
static int answer_closed(DispatcherObject *d, ReceiveObject *rx, int kind, PyObject *out) {
    stale(d);
    if (rx->stop == NULL || !(kind == KIND_PROBE || d->now - rx->last_sent >= rx->min_rto))
        return TAKEN;
    rx->last_sent = d->now;
    PyObject *item = Py_BuildValue("((O)O)", rx->stop, rx->peer);
    int appended = item != NULL && PyList_Append(out, item) == 0;
    Py_XDECREF(item);
    return appended ? TAKEN : FAILED;
}

/* A PROBE for an open receive, answered as MessageReceiver.probe_received answers it: the
 * BITMAP segments that still hold missing chunks (the last one FINAL), appended to
 * ``out`` unsealed as the core appends them. HANDED_BACK where the core must see it:
 * the message's first datagram, the first FINAL PROBE (the receive's state changes), or
 * a FINAL PROBE that meets the plan (the receive closes). */
static int answer_probe(DispatcherObject *d, ReceiveObject *rx, const Header *h,
                        PyObject *out) {
    if (!rx->heard) return HANDED_BACK;
    if (h->flags & FLAG_FINAL) {
        /* (a FINAL PROBE after the first one leaves the state as it is: SENDER_DONE or
         * ACCEPTING, both early_stop; the plan is then met exactly so) */
        if (!rx->final_seen || !rx->early_stop) return HANDED_BACK;
        if (rx->delivered_count >= rx->need && rx->critical_missing == 0) return HANDED_BACK;
    }
    const unsigned char *delivered = (const unsigned char *)rx->delivered.buf;
    uint32_t count = rx->count;
    size_t packed_len = ((size_t)count + 7) / 8;
    unsigned char *packed = PyMem_Malloc(packed_len ? packed_len : 1);
    if (packed == NULL) {
        PyErr_NoMemory();
        return FAILED;
    }
    memset(packed, 0, packed_len);
    for (uint32_t i = 0; i < count; i++)  /* (np.packbits, little bit order) */
        if (delivered[i]) packed[i >> 3] |= (unsigned char)(1u << (i & 7));
    if (count & 7)  /* bits past the last chunk read as delivered */
        packed[packed_len - 1] |= (unsigned char)((0xFFu << (count & 7)) & 0xFF);
    size_t seg = rx->cbytes > BITMAP_PREFIX_BYTES + 8 ? rx->cbytes - BITMAP_PREFIX_BYTES : 8;
    size_t n_seg = (packed_len + seg - 1) / seg;
    long long last = -1, missing = 0;
    for (size_t s = 0; s < n_seg; s++) {
        size_t lo = s * seg, hi = lo + seg < packed_len ? lo + seg : packed_len;
        for (size_t j = lo; j < hi; j++)
            if (packed[j] != 0xFF) {
                last = (long long)s;
                missing++;
                break;
            }
    }
    uint32_t seq = h->index;
    rx->probes++;
    if ((long long)seq != rx->answered_seq && missing) rx->retransmit_rounds++;
    rx->answered_seq = seq;
    d->taken++;
    int failed = 0;
    Py_INCREF(rx);  /* (allocating may run finalizers: keep rx alive meanwhile) */
    for (size_t s = 0; s < n_seg && !failed && last >= 0; s++) {
        size_t lo = s * seg, hi = lo + seg < packed_len ? lo + seg : packed_len, j = lo;
        while (j < hi && packed[j] == 0xFF) j++;
        if (j == hi) continue;  /* (nothing missing in this segment) */
        size_t plen = BITMAP_PREFIX_BYTES + (hi - lo);
        PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(HEADER_BYTES + plen));
        if (bytes == NULL) {
            failed = 1;
            break;
        }
        unsigned char *b = (unsigned char *)PyBytes_AS_STRING(bytes);
        memcpy(b, rx->ack, HEADER_BYTES);  /* (the message's header fields) */
        b[OFF_KIND] = KIND_BITMAP;
        uint16_t flags = (long long)s == last ? FLAG_FINAL : 0;
        b[OFF_FLAGS] = (unsigned char)flags;
        b[OFF_FLAGS + 1] = (unsigned char)(flags >> 8);
        b[OFF_PLEN] = (unsigned char)plen;
        b[OFF_PLEN + 1] = (unsigned char)(plen >> 8);
        st32(b + OFF_INDEX, (uint32_t)(s * seg * 8));
        st32(b + OFF_TSEQ, 0);
        st32(b + HEADER_BYTES, seq);
        st32(b + HEADER_BYTES + 4, (uint32_t)rx->delivered_count);
        memcpy(b + HEADER_BYTES + BITMAP_PREFIX_BYTES, packed + lo, hi - lo);
        PyObject *item = Py_BuildValue("((N)O)", bytes, rx->peer);
        failed = item == NULL || PyList_Append(out, item) < 0;
        Py_XDECREF(item);
    }
    Py_DECREF(rx);
    PyMem_Free(packed);
    return failed ? FAILED : TAKEN;
}

/* The loss a PROBE and its answer would meet, read from ACK counters as AckState.loss_with
 * reads it (operation for operation: the same double). */
static double loss_with(const SendObject *s, long long heard, long long tseq,
                        long long delivered) {
    double fwd = (double)(delivered + 1) / (double)(tseq + 1);
    double q_fwd = 1.0 - (fwd < 1.0 ? fwd : 1.0);
    double reverse = s->reverse_hint;
    if (heard) {
        long long owed = (delivered + 1) / s->ack_every;  /* (both >= 0: floor division) */
        if (owed < 1) owed = 1;
        double got = (double)heard / (double)owed;
        double missed = 1.0 - (got < 1.0 ? got : 1.0);
        if (missed > reverse) reverse = missed;
    }
    return 1.0 - (1.0 - q_fwd) * (1.0 - reverse);
}

/* An ACK for one of the registered sends: its bookkeeping (MessageSender.ack_received
 * with recovery's and the window's parts), TAKEN; HANDED_BACK where the core must see it
 * (no such send, another geometry, or the send says it may call for a decision). */
static int take_ack(DispatcherObject *d, const unsigned char *p, const Header *h,
                    uint32_t ip, uint16_t port) {
    SendObject *s = lookup_send(d, ip, port, h->round_id, h->message_id);
    if (s != NULL && s->closed) return stale(d);
    /* (an ack_every below 1, which no sender sets, leaves the loss to the core) */
    if (s == NULL || s->in_python || h->mbytes != s->mbytes || h->cbytes != s->cbytes
        || (s->check_loss && s->ack_every < 1))
        return HANDED_BACK;
    long long tseq_seen = h->tseq, delivered = ld32(p + HEADER_BYTES);
    long long heard = s->acks_heard + 1, tseq = s->ack_tseq, got = s->ack_delivered;
    if (tseq_seen > tseq) {
        tseq = tseq_seen;
        got = delivered;
    }
    /* (recovery's answer is "no more copies" exactly where this loss is within the
     * limit the copies already sent cover: Recovery.loss_limit) */
    if (s->check_loss && !(loss_with(s, heard, tseq, got) <= s->loss_limit))
        return HANDED_BACK;
    if (h->flags & FLAG_CREDIT) {  /* (MessageSender._credited) */
        s->credit = h->index;
        if (s->granted_least < 0 || s->credit < s->granted_least) s->granted_least = s->credit;
    }
    s->last_heard = d->now;
    if (delivered > s->reported_delivered) s->reported_delivered = delivered;
    s->acks_heard = heard;
    s->ack_tseq = tseq;
    s->ack_delivered = got;
    if (tseq_seen + 1 > s->acked) {
        s->acked = tseq_seen + 1 < s->next_tseq ? tseq_seen + 1 : s->next_tseq;
        Py_XSETREF(s->blocked_since, Py_NewRef(Py_None));
    }
    d->taken++;
    return TAKEN;
}

static inline ReceiveObject *lookup(DispatcherObject *d, uint32_t ip, uint16_t port,
                                    uint32_t rnd, uint32_t msg) {
    ReceiveObject *r = d->table[bucket_of(ip, port, rnd, msg)];
    while (r && !(r->ip == ip && r->port == port && r->round_id == rnd && r->message_id == msg))
        r = r->next;
    return r;
}

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
    if (sealer_tag(&d->sealer, src, d->sealer.ident, p, n, NULL, 0, p + n, tag) < 0)
        return FAILED;
    if (!sealer_tags_equal(tag, p + n + NONCE_BYTES))
        return ld64(p + OFF_SESSION) != d->session ? R_FOREIGN_SESSION : R_BAD_AUTH;
    return VERIFIED;
}

/* A control datagram to ``rx``'s peer in ``c`` (its header and 4-byte payload; room for
 * a trailer after them), sealed when authenticating: its length, or -1 (OpenSSL failed,
 * the error set). */
static Py_ssize_t seal_control(DispatcherObject *d, const ReceiveObject *rx, unsigned char *c) {
    if (!d->sealer.on) return HEADER_BYTES + 4;
    unsigned char dst[IDENT_BYTES];
    put_ident(dst, rx->ip, rx->port);
    if (sealer_seal(&d->sealer, dst, c, HEADER_BYTES + 4, NULL, 0, c + HEADER_BYTES + 4) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "boundedloss._native: OpenSSL's AES-GCM failed");
        return -1;
    }
    return HEADER_BYTES + 4 + TRAILER_BYTES;
}

/* The DATA just taken met the plan of ``rx``, which the core lets close here: closed as
 * MessageReceiver._close closes it - its reason, its STOP (its ACK's header with the
 * STOP's kind, reason and count) appended to ``out`` (sealed here when authenticating,
 * and marked so, as its ACKs), its buffers let go, and kept to answer what still comes
 * as a receive the core closed (receive_close) - and listed for the core's results.
 * CLOSED_HERE, or FAILED. */
static int close_here(DispatcherObject *d, ReceiveObject *rx, PyObject *out) {
    int reason = rx->delivered_count == (long long)rx->count ? CLOSE_COMPLETE
        : rx->accepting ? CLOSE_ACCEPT_DEADLINE : CLOSE_BOUND_MET;
    unsigned char stop[HEADER_BYTES + 4 + TRAILER_BYTES];
    memcpy(stop, rx->ack, HEADER_BYTES + 4);
    stop[OFF_KIND] = KIND_STOP;
    stop[OFF_FLAGS] = stop[OFF_FLAGS + 1] = 0;
    st32(stop + OFF_INDEX, (uint32_t)reason);
    st32(stop + OFF_TSEQ, 0);
    st32(stop + HEADER_BYTES, (uint32_t)rx->delivered_count);
    Py_ssize_t slen = seal_control(d, rx, stop);
    if (slen < 0) return FAILED;
    Py_INCREF(rx);  /* (allocating may run finalizers: keep rx alive meanwhile) */
    int ok = 0;
    PyObject *said = NULL, *item = NULL, *entry = NULL;
    PyObject *bare = PyBytes_FromStringAndSize((const char *)stop, HEADER_BYTES + 4);
    if (bare == NULL) goto done;
    said = d->sealer.on ? PyBytes_FromStringAndSize((const char *)stop, slen) : Py_NewRef(bare);
    if (said == NULL) goto done;
    item = d->sealer.on ? Py_BuildValue("((O)OO)", said, rx->peer, Py_True)
                        : Py_BuildValue("((O)O)", said, rx->peer);
    entry = Py_BuildValue("(OIIiO)", rx->peer, rx->round_id, rx->message_id, reason, bare);
    if (item == NULL || entry == NULL) goto done;
    /* (listed, then said: both or neither - the list fetched last, as a finalizer run by
     * the allocations above may have taken it) */
    if (d->closed == NULL && (d->closed = PyList_New(0)) == NULL) goto done;
    if (PyList_Append(d->closed, entry) < 0) goto done;
    if (PyList_Append(out, item) < 0) {
        Py_ssize_t n = PyList_GET_SIZE(d->closed);
        PyList_SetSlice(d->closed, n - 1, n, NULL);
        goto done;
    }
    release_buffers_of(rx);
    Py_XSETREF(rx->stop, Py_NewRef(bare));
    rx->last_sent = d->now;
    rx->closed = 1;
    ok = 1;
done:
    Py_XDECREF(entry);
    Py_XDECREF(item);
    Py_XDECREF(said);
    Py_XDECREF(bare);
    Py_DECREF(rx);
    return ok ? CLOSED_HERE : FAILED;
}

/* A DATA for the open receive ``rx``, taken, that carries its send's first PROBE (a
 * FINAL one: the receive's state changes, so the Python core answers it): an EVENT. */
static inline int carried_probe(DispatcherObject *d, ReceiveObject *rx) {
    d->event_kind = KIND_PROBE;
    d->event_rx = rx;
    return EVENT;
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
    if (d->sealer.on) {  /* (as TransferMux.datagram_received: the tag before anything else) */
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
    if (h.kind == KIND_ACK) return take_ack(d, p, &h, ip, port);
    if (h.kind == KIND_STOP || h.kind == KIND_BITMAP) {
        SendObject *s = lookup_send(d, ip, port, h.round_id, h.message_id);
        if (s != NULL && s->closed) return stale(d);
        if (h.kind != KIND_STOP || s == NULL || h.mbytes != s->mbytes || h.cbytes != s->cbytes)
            return HANDED_BACK;
        /* (TransferMux.stop_arrived: parse() held a STOP's payload to its 4 bytes) */
        d->taken++;
        d->event_kind = KIND_STOP;
        d->event_ip = ip;
        d->event_port = port;
        d->event_round = h.round_id;
        d->event_message = h.message_id;
        d->event_index = h.index;
        d->event_delivered = ld32(p + HEADER_BYTES);
        return EVENT;
    }
    ReceiveObject *rx = lookup(d, ip, port, h.round_id, h.message_id);
    /* (a DATA that carries its send's first PROBE is answered as that PROBE) */
    int carries = h.kind == KIND_DATA && (h.flags & FLAG_PROBE_CARRIED);
    if (rx != NULL && rx->closed)
        return answer_closed(d, rx, carries ? KIND_PROBE : h.kind, out);
    if (h.kind == KIND_PROBE)
        return rx == NULL || h.mbytes != rx->mbytes || h.cbytes != rx->cbytes || d->credit
            ? HANDED_BACK : answer_probe(d, rx, &h, out);
    if (h.kind != KIND_DATA) return HANDED_BACK;
    if (rx == NULL || (!rx->heard && (rx->clock_on_first || d->credit)) || h.mbytes != rx->mbytes
        || h.cbytes != rx->cbytes)
        return HANDED_BACK;
    unsigned char *delivered = (unsigned char *)rx->delivered.buf;
    int fresh = !delivered[h.index], met = 0;
    if (fresh) {
        /* would this chunk meet the plan? then the receive closes: taken here as any
         * other, then closed here (close_here) or an EVENT for the core to close it */
        long long now_delivered = rx->delivered_count + 1;
        long long crit = rx->critical_missing
            - (rx->has_critical && ((const unsigned char *)rx->critical.buf)[h.index] ? 1 : 0);
        met = now_delivered >= rx->need && crit == 0
            && (now_delivered == (long long)rx->count || rx->early_stop || rx->need == 0);
    }
    d->taken++;
    if (!rx->heard) {  /* (MessageReceiver._heard, with no clock to start) */
        rx->heard = 1;
        rx->first_heard = d->now;
    }
    rx->datagrams++;
    rx->payload_bytes += h.plen;
    if ((long long)h.tseq > rx->max_tseq) rx->max_tseq = h.tseq;
    long long every = rx->ack_every;
    if (d->credit) {  /* (credit.ack_cadence: as the sender's latest grant calls for) */
        if (rx->granted / 4 < every) every = rx->granted / 4;
        if (every < 1) every = 1;
    }
    if (++rx->unacked >= every) {
        rx->unacked = 0;
        unsigned char *a = rx->ack;
        st32(a + OFF_TSEQ, (uint32_t)rx->max_tseq);
        if (d->credit) {
            rx->granted = rx->parked ? 0 : d->credit;
            st32(a + OFF_INDEX, (uint32_t)rx->granted);
        }
        st32(a + HEADER_BYTES, (uint32_t)rx->delivered_count);
        /* (sealed here: the mux hands the data path's datagrams out as is) */
        Py_ssize_t alen = seal_control(d, rx, a);
        if (alen < 0) return FAILED;
        Py_INCREF(rx);  /* (allocating may run finalizers: keep rx alive meanwhile) */
        PyObject *ack = PyBytes_FromStringAndSize((const char *)a, alen);
        /* (sealed: marked so, as TransferMux.outbox says, for the mux not to seal it) */
        PyObject *item = ack == NULL ? NULL
            : d->sealer.on ? Py_BuildValue("((N)OO)", ack, rx->peer, Py_True)
                      : Py_BuildValue("((N)O)", ack, rx->peer);
        int appended = item != NULL && PyList_Append(out, item) == 0;
        Py_XDECREF(item);
        Py_DECREF(rx);
        if (!appended) return FAILED;
    }
    if (!fresh) {
        rx->duplicates++;
        return carries ? carried_probe(d, rx) : TAKEN;
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
    if (!met) return carries ? carried_probe(d, rx) : TAKEN;
    /* (met: the receive closes, and its STOP answers a PROBE the DATA carried) */
    if (rx->closes_here) return close_here(d, rx, out);
    d->event_kind = KIND_DATA;
    d->event_rx = rx;
    return EVENT;
}

/* The event take() found, as step() and take() give it to Python: ``(KIND_DATA, peer,
 * round, message)`` (the receive's plan is met), ``(KIND_PROBE, peer, round, message)``
 * (a DATA it took carried its send's first PROBE, the plan not met) or ``(KIND_STOP, ip,
 * port, round, message, index, delivered)``. Built at once, while the receive is surely registered. */
static PyObject *event_tuple(DispatcherObject *d) {
    if (d->event_kind == KIND_DATA || d->event_kind == KIND_PROBE) {
        ReceiveObject *rx = d->event_rx;
        return Py_BuildValue("(iOII)", d->event_kind, rx->peer, rx->round_id,
                             rx->message_id);
    }
    return Py_BuildValue("(iIIIIII)", KIND_STOP, d->event_ip, (unsigned int)d->event_port,
                         d->event_round, d->event_message, d->event_index,
                         d->event_delivered);
}

/* take(datagram, ip, port, out, now) -> True (the data path took it), False (Python's
 * turn: the datagram is the core's), None (taken, and it closed a receive here: see
 * closed()) or an event tuple (taken, and the core must decide: event_tuple); ``now``:
 * when it arrived, as the core reads the time. */
static PyObject *dispatcher_take(DispatcherObject *d, PyObject *args) {
    Py_buffer b;
    unsigned int ip, port;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*IIO!d", &b, &ip, &port, &PyList_Type, &out, &d->now))
        return NULL;
    size_t n = (size_t)b.len;
    int r = take(d, (const unsigned char *)b.buf, &n, ip, (uint16_t)port, out, UNCHECKED);
    PyBuffer_Release(&b);
    if (r == FAILED) return NULL;
    if (r == EVENT) return event_tuple(d);
    if (r == CLOSED_HERE) Py_RETURN_NONE;
    return PyBool_FromLong(r == TAKEN);
}

/* take_rows(rows, stride, lengths, ip, port, out, start) -> index: datagram i is
 * rows[i*stride : i*stride + lengths[i]] (lengths: uint32 array); takes datagrams from
 * ``start`` on and returns the index of the first one handed back or taken with an event
 * (or their count). For
 * the fuzz tests: it takes no time, and what it takes is heard at the last take's or
 * step's. */
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
        if (r != TAKEN && r != CLOSED_HERE) break;  /* (an EVENT: the core's to decide) */
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
        if (sealer_seal(&d->sealer, dst, iov[3 * j].iov_base, HEADER_BYTES,
                        iov[3 * j + 1].iov_base, iov[3 * j + 1].iov_len, tags[j]) < 0)
            return 1;
    return 0;
}
#endif

/* send_run(sock, ip, port, headers, payload, indices, start, chunk_bytes, nbytes,
 *          segment, last_flags) -> (next, err, end, calls): the DATA datagrams of one
 * message, chunk indices[start:] (indices: int64), each its header (48 bytes at i * 48 in
 * headers) then its payload (at i * chunk_bytes in payload), gathered straight from those
 * buffers - but for the run's last datagram, whose header goes as a copy with
 * ``last_flags`` set in its flags (the first PROBE it carries: DataRun.last_flags).
 * With ``segment`` runs of equal-sized datagrams go out as one UDP_SEGMENT send each
 * (the last may be shorter), else up to 64 datagrams per sendmmsg. Stops at the first
 * error: ``err`` is its errno (0: all sent), ``next`` the first unsent index into
 * indices, ``end`` the end of the call that failed; ``calls``: system calls that sent.
 * The GIL is released around each call. */
#ifdef __linux__
static PyObject *dispatcher_send_run(DispatcherObject *d, PyObject *args) {
    PyObject *sock;
    unsigned int ip, port, cb;
    unsigned long long nbytes;
    Py_ssize_t start;
    int segment;
    unsigned int last_flags;
    Py_buffer hb, pb, ib;
    if (d->stage == NULL && (d->stage = PyMem_Malloc(GSO_MAX_BYTES)) == NULL)
        return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "OIIy*y*y*nIKpI", &sock, &ip, &port, &hb, &pb, &ib, &start,
                          &cb, &nbytes, &segment, &last_flags))
        return NULL;
    PyObject *result = NULL;
    const int64_t *idx = ib.buf;
    Py_ssize_t n = ib.len / 8;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) goto done;
    uint64_t count = cb ? (nbytes + cb - 1) / cb : 0;
    if (count == 0) count = 1;
    if (cb == 0 || cb > MAX_CHUNK_BYTES || ib.len % 8 || start < 0 || start > n
        || (uint64_t)hb.len < count * HEADER_BYTES || (uint64_t)pb.len != nbytes
        || last_flags > 0xFFFF) {
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
    unsigned char last_header[HEADER_BYTES];  /* (the last datagram's, flagged) */
    if (last_flags && n > start) {  /* (idx[n - 1] checked above) */
        memcpy(last_header, H + (size_t)idx[n - 1] * HEADER_BYTES, HEADER_BYTES);
        uint16_t flags = (uint16_t)(ld16(last_header + OFF_FLAGS) | last_flags);
        last_header[OFF_FLAGS] = (unsigned char)flags;
        last_header[OFF_FLAGS + 1] = (unsigned char)(flags >> 8);
    }
    uint64_t last_len = nbytes - (uint64_t)cb * (count - 1);
#define CLEN(c) ((c) == count - 1 ? last_len : cb)
    /* authenticating: every datagram ends in its trailer (a third piece, or in the stage) */
    const uint32_t trailer = d->sealer.on ? TRAILER_BYTES : 0;
    const int pieces = trailer ? 3 : 2;
    unsigned char dst[IDENT_BYTES];
    put_ident(dst, ip, (uint16_t)port);
    struct iovec iov[3 * SEND_MAX];
    unsigned char tags[SEND_MAX][TRAILER_BYTES];
    struct mmsghdr msgs[SEND_MAX];
    GsoControl ctrl;
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
            iov[pieces * j].iov_base = last_flags && i + j == n - 1
                ? (void *)last_header : (void *)(H + (size_t)c * HEADER_BYTES);
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
            if (k > 1) set_gso(&m, &ctrl, (uint16_t)size0);
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
                        mac_failed = sealer_seal(&d->sealer, dst, d->stage + first,
                                                 at - first, NULL, 0, d->stage + at) < 0;
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

#ifdef __linux__
/* the most buffers one datagram of send_datagrams gathers (a core's control datagram is
 * one or two: its bytes, and the trailer a seal added) */
#define MAX_PARTS 4

/* One item of a poll's batch as a datagram to send: ``(parts, (host, port))`` with parts a
 * tuple of at most MAX_PARTS buffers (held in ``held``, released by the caller) and host
 * an IPv4 address, or ``(parts, (host, port), True)``: one this path sealed already (an
 * ACK it built). With ``seal`` (authenticating), a 2-tuple comes unsealed, as the core
 * built it, and is sealed here - its parts (at most two: the tag covers them as one)
 * then the trailer, into ``trailer``. 1; 0 if it is none (not such a tuple, another
 * address family, more parts than it seals: Python's to send); -1 with an exception
 * set. */
static int control_datagram(DispatcherObject *d, PyObject *item, int seal, struct msghdr *m,
                            struct iovec *iov, Py_buffer *held, int *n_held,
                            struct sockaddr_in *to, unsigned char *trailer) {
    if (!PyTuple_Check(item)) return 0;
    Py_ssize_t size = PyTuple_GET_SIZE(item);
    if (size == 3) {
        if (PyTuple_GET_ITEM(item, 2) != Py_True) return 0;
        seal = 0;  /* (sealed already) */
    } else if (size != 2) {
        return 0;
    }
    PyObject *parts = PyTuple_GET_ITEM(item, 0), *peer = PyTuple_GET_ITEM(item, 1);
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) < 1
        || PyTuple_GET_SIZE(parts) > (seal ? 2 : MAX_PARTS) || !PyTuple_Check(peer)
        || PyTuple_GET_SIZE(peer) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(peer, 0))
        || !PyLong_Check(PyTuple_GET_ITEM(peer, 1)))
        return 0;
    const char *host = PyUnicode_AsUTF8(PyTuple_GET_ITEM(peer, 0));
    if (host == NULL) return -1;
    long port = PyLong_AsLong(PyTuple_GET_ITEM(peer, 1));
    if (port == -1 && PyErr_Occurred()) return -1;
    memset(to, 0, sizeof *to);
    to->sin_family = AF_INET;
    if (port < 0 || port > 0xFFFF || inet_pton(AF_INET, host, &to->sin_addr) != 1) return 0;
    to->sin_port = htons((uint16_t)port);
    Py_ssize_t k = PyTuple_GET_SIZE(parts);
    for (Py_ssize_t j = 0; j < k; j++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(parts, j), &held[*n_held], PyBUF_SIMPLE) < 0)
            return -1;
        iov[j].iov_base = held[*n_held].buf;
        iov[j].iov_len = (size_t)held[*n_held].len;
        (*n_held)++;
    }
#ifdef BL_OPENSSL
    if (seal) {
        unsigned char dst[IDENT_BYTES];
        put_ident(dst, ntohl(to->sin_addr.s_addr), (uint16_t)port);
        if (sealer_seal(&d->sealer, dst, iov[0].iov_base, iov[0].iov_len,
                        k > 1 ? iov[1].iov_base : NULL, k > 1 ? iov[1].iov_len : 0,
                        trailer) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "boundedloss._native: OpenSSL's AES-GCM failed");
            return -1;
        }
        iov[k].iov_base = trailer;
        iov[k].iov_len = TRAILER_BYTES;
        k++;
    }
#else
    (void)d;
    (void)trailer;
#endif
    memset(m, 0, sizeof *m);
    m->msg_name = to;
    m->msg_namelen = sizeof *to;
    m->msg_iov = iov;
    m->msg_iovlen = (size_t)k;
    return 1;
}

/* send_datagrams(sock, items, start, seal=False) -> (end, err, calls): the datagrams of a
 * poll's batch from items[start] on - each ``(parts, (host, port))``, as the core hands
 * them out - up to SEND_MAX a sendmmsg, until one that is not such a datagram (a DataRun,
 * a peer not IPv4: Python's turn). Where the job authenticates they come sealed already
 * (``poll``'s default), or with ``seal`` as the core built them, to be sealed here
 * (``poll(sealed=False)``: an ACK this path built, marked ``(parts, peer, True)``, is
 * sealed already). ``end``: the first not sent; ``err``: the errno of the call that
 * stopped (0: none; EAGAIN when the socket is full); ``calls``: system calls that sent.
 * The GIL is released around each. */
static PyObject *dispatcher_send_datagrams(DispatcherObject *d, PyObject *args) {
    PyObject *sock, *items;
    Py_ssize_t start;
    int seal = 0;
    if (!PyArg_ParseTuple(args, "OO!n|p", &sock, &PyList_Type, &items, &start, &seal))
        return NULL;
    if (seal && !d->sealer.on) {
        PyErr_SetString(PyExc_ValueError, "send_datagrams: seal without a key (authenticate)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) return NULL;
    if (start < 0 || start > PyList_GET_SIZE(items)) {
        PyErr_SetString(PyExc_ValueError, "send_datagrams: start out of range");
        return NULL;
    }
    struct mmsghdr msgs[SEND_MAX];
    struct iovec iov[SEND_MAX][MAX_PARTS + 1];
    struct sockaddr_in to[SEND_MAX];
    unsigned char trailers[SEND_MAX][TRAILER_BYTES];
    Py_buffer held[SEND_MAX * MAX_PARTS];
    PyObject *owned[SEND_MAX];  /* (each item held: a buffer's export may run Python code) */
    Py_ssize_t i = start;
    long calls = 0;
    int err = 0;
    while (!err && i < PyList_GET_SIZE(items)) {
        int k = 0, n_held = 0, n_owned = 0, r = 0;  /* (control_datagram clears each header) */
        while (k < SEND_MAX && i + k < PyList_GET_SIZE(items)) {
            PyObject *item = owned[n_owned++] = Py_NewRef(PyList_GET_ITEM(items, i + k));
            r = control_datagram(d, item, seal, &msgs[k].msg_hdr, iov[k], held, &n_held,
                                 &to[k], trailers[k]);
            if (r <= 0) break;
            k++;
        }
        int sent = 0;
        if (r >= 0 && k > 0) {
            Py_BEGIN_ALLOW_THREADS
            sent = sendmmsg(fd, msgs, (unsigned int)k, 0);
            if (sent < 0) err = errno;
            Py_END_ALLOW_THREADS
        }
        for (int b = 0; b < n_held; b++) PyBuffer_Release(&held[b]);
        for (int b = 0; b < n_owned; b++) Py_DECREF(owned[b]);
        if (r < 0) return NULL;
        if (k == 0) break;  /* (not a datagram this path sends) */
        if (sent > 0) {
            calls++;
            i += sent;
            if (sent < k) break;  /* (the next call says why it stopped) */
        }
        if (r == 0) break;
    }
    return Py_BuildValue("(nil)", i, err, calls);
}
#endif

/* step(out, now) -> None | (datagram, ip, port) | event | True: takes the batch's
 * datagrams until one is Python's; returns that one (a copy, or the event it calls for),
 * True when the one it took closed a receive here (see closed()), or None when the batch
 * is done. */
static PyObject *dispatcher_step(DispatcherObject *d, PyObject *args) {
    PyObject *out;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &out, &d->now)) return NULL;
    while (d->slot < d->batch) {
        int s = d->slot;
        if (d->sealer.on && d->offset == 0 && d->verified_slot != s) {
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
        if (r == EVENT) return event_tuple(d);
        if (r == CLOSED_HERE) Py_RETURN_TRUE;  /* (the core records it before the next) */
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

/* closed() -> list: the receives closed here since the last call, in the order they
 * closed, each (peer, round, message, reason, stop) - ``stop`` as the core's close would
 * have built it, unsealed. */
static PyObject *dispatcher_closed(DispatcherObject *d, PyObject *unused) {
    PyObject *closed = d->closed;
    d->closed = NULL;
    return closed != NULL ? closed : PyList_New(0);
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
    {"register_send", (PyCFunction)dispatcher_register_send, METH_O, "Take this send's ACKs."},
    {"close_send", (PyCFunction)dispatcher_close_send, METH_O,
     "It finished: count what still comes for it stale, for a while."},
    {"unregister_send", (PyCFunction)dispatcher_unregister_send, METH_O,
     "Stop taking its ACKs."},
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
    {"step", (PyCFunction)dispatcher_step, METH_VARARGS, "Take the batch until Python's turn."},
#ifdef __linux__
    {"send_run", (PyCFunction)dispatcher_send_run, METH_VARARGS, "Send a run of DATA."},
    {"send_datagrams", (PyCFunction)dispatcher_send_datagrams, METH_VARARGS,
     "Send a poll's datagrams, a sendmmsg at a time."},
#endif
    {"batch_rounds", (PyCFunction)dispatcher_batch_rounds, METH_NOARGS,
     "Round ids of the batch's datagrams."},
    {"lose", (PyCFunction)dispatcher_lose, METH_O, "Drop datagrams of the batch."},
    {"load", (PyCFunction)dispatcher_load, METH_VARARGS, "A batch from Python (tests)."},
    {"counters", (PyCFunction)dispatcher_counters, METH_NOARGS, "Taken and dropped counts."},
    {"closed", (PyCFunction)dispatcher_closed, METH_NOARGS,
     "The receives closed here since the last call."},
    {NULL},
};

static PyMemberDef dispatcher_members[] = {
    {"credit", T_LONGLONG, offsetof(DispatcherObject, credit), 0,
     "Under credit, the share stamped on the ACKs it builds (0: no credit)."},
    {NULL},
};

PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boundedloss._native.Dispatcher",
    .tp_basicsize = sizeof(DispatcherObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The DATA fast path of one endpoint.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)dispatcher_init,
    .tp_dealloc = (destructor)dispatcher_dealloc,
    .tp_methods = dispatcher_methods,
    .tp_members = dispatcher_members,
};
