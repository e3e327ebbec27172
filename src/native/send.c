#include "native.h"

/* ----------------------------------------------------------------- Send */
static int send_init(SendObject *s, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    s->ack_tseq = -1;
    s->granted_least = -1;
    Py_XSETREF(s->blocked_since, Py_NewRef(Py_None));
    return 0;
}

static void send_dealloc(SendObject *s) {
    Py_CLEAR(s->blocked_since);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* bind(ip, port, round, message, count, mbytes, cbytes): which send it is, once. */
static PyObject *send_bind(SendObject *s, PyObject *args) {
    unsigned int ip, port, round_id, message_id, count, cbytes;
    unsigned long long mbytes;
    if (s->geometry || s->registered) {
        PyErr_SetString(PyExc_RuntimeError, "send already bound");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "IIIIIKI", &ip, &port, &round_id, &message_id, &count,
                          &mbytes, &cbytes))
        return NULL;
    if (port > 0xFFFF || count == 0 || cbytes == 0) {
        PyErr_SetString(PyExc_ValueError, "bad send geometry");
        return NULL;
    }
    s->ip = ip; s->port = (uint16_t)port; s->round_id = round_id; s->message_id = message_id;
    s->count = count; s->mbytes = mbytes; s->cbytes = cbytes;
    s->geometry = 1;
    Py_RETURN_NONE;
}

/* blocked_since: None or a float (what the Python core keeps there) */
static PyObject *send_get_blocked(SendObject *s, void *closure) {
    return Py_NewRef(s->blocked_since ? s->blocked_since : Py_None);
}

static int send_set_blocked(SendObject *s, PyObject *v, void *closure) {
    if (v == NULL || (v != Py_None && !PyFloat_Check(v) && !PyLong_Check(v))) {
        PyErr_SetString(PyExc_TypeError, "blocked_since is None or a time");
        return -1;
    }
    PyObject *t = v == Py_None ? Py_NewRef(v) : PyNumber_Float(v);
    if (t == NULL) return -1;
    Py_XSETREF(s->blocked_since, t);
    return 0;
}

static PyGetSetDef send_getset[] = {
    {"blocked_since", (getter)send_get_blocked, (setter)send_set_blocked, NULL, NULL},
    {NULL},
};

static PyMemberDef send_members[] = {
    {"last_heard", T_DOUBLE, offsetof(SendObject, last_heard), 0, NULL},
    {"reported_delivered", T_LONGLONG, offsetof(SendObject, reported_delivered), 0, NULL},
    {"acks_heard", T_LONGLONG, offsetof(SendObject, acks_heard), 0, NULL},
    {"ack_tseq", T_LONGLONG, offsetof(SendObject, ack_tseq), 0, NULL},
    {"ack_delivered", T_LONGLONG, offsetof(SendObject, ack_delivered), 0, NULL},
    {"acked", T_LONGLONG, offsetof(SendObject, acked), 0, NULL},
    {"next_tseq", T_LONGLONG, offsetof(SendObject, next_tseq), 0, NULL},
    {"ack_every", T_LONGLONG, offsetof(SendObject, ack_every), 0, NULL},
    {"reverse_hint", T_DOUBLE, offsetof(SendObject, reverse_hint), 0, NULL},
    {"loss_limit", T_DOUBLE, offsetof(SendObject, loss_limit), 0, NULL},
    {"in_python", T_BOOL, offsetof(SendObject, in_python), 0, NULL},
    {"check_loss", T_BOOL, offsetof(SendObject, check_loss), 0, NULL},
    {"credit", T_LONGLONG, offsetof(SendObject, credit), 0, NULL},
    {"granted_least", T_LONGLONG, offsetof(SendObject, granted_least), 0, NULL},
    {"registered", T_BOOL, offsetof(SendObject, registered), READONLY, NULL},
    {NULL},
};

static PyMethodDef send_methods[] = {
    {"bind", (PyCFunction)send_bind, METH_VARARGS, "Set which send it is."},
    {NULL},
};

PyTypeObject SendType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boundedloss._native.Send",
    .tp_basicsize = sizeof(SendObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What the ACKs of one send move, shared by Python and the data path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)send_init,
    .tp_dealloc = (destructor)send_dealloc,
    .tp_members = send_members,
    .tp_getset = send_getset,
    .tp_methods = send_methods,
};
