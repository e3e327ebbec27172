#include "native.h"

/* -------------------------------------------------------------- Receive */
static void receive_release(ReceiveObject *r) {
    release_buffers_of(r);
    r->geometry = 0;
    Py_CLEAR(r->stop);
    Py_CLEAR(r->peer);
}

static int receive_init(ReceiveObject *r, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    r->max_tseq = -1;
    r->answered_seq = -1;
    r->granted = -1;
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
    if (r->geometry || r->registered || r->closed) {
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

/* close(stop_or_None, now, min_rto): the receive closed at ``now``. Its buffers are let go
 * (nothing is written any more); while it stays registered, a PROBE for it is answered
 * with ``stop`` at once and its DATA at most once per ``min_rto`` (TransferMux's
 * closed receives), and both are counted stale. */
static PyObject *receive_close(ReceiveObject *r, PyObject *args) {
    PyObject *stop;
    double now, min_rto;
    if (!PyArg_ParseTuple(args, "Odd", &stop, &now, &min_rto)) return NULL;
    if (stop != Py_None && !PyBytes_Check(stop)) {
        PyErr_SetString(PyExc_TypeError, "a STOP is bytes or None");
        return NULL;
    }
    if (!r->geometry || r->closed) {
        PyErr_SetString(PyExc_RuntimeError, "only a bound, open receive closes");
        return NULL;
    }
    release_buffers_of(r);  /* (its identity stays: it is still found by its key) */
    Py_XSETREF(r->stop, stop == Py_None ? NULL : Py_NewRef(stop));
    r->last_sent = now;
    r->min_rto = min_rto;
    r->closed = 1;
    Py_RETURN_NONE;
}

/* close_here(min_rto): the core lets this bound, open receive close here when a DATA the
 * data path takes meets its plan (MessageReceiver.close_is_routine: closing it decides
 * nothing): the data path then says its STOP, answers what still comes for it as for a
 * receive the core closed (``min_rto``: close's), and lists it for the core's results
 * (Dispatcher.closed). */
static PyObject *receive_close_here(ReceiveObject *r, PyObject *arg) {
    double min_rto = PyFloat_AsDouble(arg);
    if (min_rto == -1.0 && PyErr_Occurred()) return NULL;
    if (!r->geometry || r->closed) {
        PyErr_SetString(PyExc_RuntimeError, "only a bound, open receive closes here");
        return NULL;
    }
    r->min_rto = min_rto;
    r->closes_here = 1;
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
    {"probes", T_LONGLONG, offsetof(ReceiveObject, probes), 0, NULL},
    {"retransmit_rounds", T_LONGLONG, offsetof(ReceiveObject, retransmit_rounds), 0, NULL},
    {"answered_seq", T_LONGLONG, offsetof(ReceiveObject, answered_seq), 0, NULL},
    {"final_seen", T_BOOL, offsetof(ReceiveObject, final_seen), 0, NULL},
    {"early_stop", T_BOOL, offsetof(ReceiveObject, early_stop), 0, NULL},
    {"heard", T_BOOL, offsetof(ReceiveObject, heard), 0, NULL},
    {"first_heard", T_DOUBLE, offsetof(ReceiveObject, first_heard), 0, NULL},
    {"clock_on_first", T_BOOL, offsetof(ReceiveObject, clock_on_first), 0, NULL},
    {"parked", T_BOOL, offsetof(ReceiveObject, parked), 0, NULL},
    {"granted", T_LONGLONG, offsetof(ReceiveObject, granted), 0, NULL},
    {"accepting", T_BOOL, offsetof(ReceiveObject, accepting), 0, NULL},
    {"registered", T_BOOL, offsetof(ReceiveObject, registered), READONLY, NULL},
    {"closes_here", T_BOOL, offsetof(ReceiveObject, closes_here), READONLY, NULL},
    {"closed", T_BOOL, offsetof(ReceiveObject, closed), READONLY, NULL},
    {NULL},
};

static PyMethodDef receive_methods[] = {
    {"bind", (PyCFunction)receive_bind, METH_VARARGS, "Set the geometry and buffers."},
    {"close", (PyCFunction)receive_close, METH_VARARGS, "Closed: answer with its STOP."},
    {"close_here", (PyCFunction)receive_close_here, METH_O,
     "Met by a DATA the data path takes, it closes there."},
    {NULL},
};

PyTypeObject ReceiveType = {
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
