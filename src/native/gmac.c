#include "native.h"
#include "seal.h"

/* Gmac(key): protocol/auth.py's AES-256-GMAC for the Python core's own datagrams (its
 * control datagrams, and every datagram on the Python path and in the simulator), through
 * seal.c's GCM instead of ctypes' five calls into EVP: a tag is the same bytes either way
 * (tests hold the two to it). It has no nonces of its own: the caller gives each tag's. */
typedef struct {
    PyObject_HEAD
    Sealer sealer;
} GmacObject;

static int gmac_init(GmacObject *g, PyObject *args, PyObject *kwds) {
    static char *names[] = {"key", NULL};
    Py_buffer key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*", names, &key)) return -1;
    if (key.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "a datagram key is %d bytes, not %zd", KEY_BYTES,
                     key.len);
        PyBuffer_Release(&key);
        return -1;
    }
    static const unsigned char no_nonces[NONCE_BYTES];  /* (tag() is given its nonce) */
    sealer_release(&g->sealer);
    int r = sealer_start(&g->sealer, key.buf, 0, 0, no_nonces);
    PyBuffer_Release(&key);
    if (r < 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's AES-256-GCM is not available");
        return -1;
    }
    return 0;
}

static void gmac_dealloc(GmacObject *g) {
    sealer_release(&g->sealer);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* tag(nonce, data) -> bytes: the 12-byte tag of ``data`` under ``nonce``. Holds the GIL
 * (one GCM context; a tag is a fraction of a microsecond). */
static PyObject *gmac_tag_method(GmacObject *g, PyObject *args) {
    Py_buffer nonce, data;
    if (!PyArg_ParseTuple(args, "y*y*", &nonce, &data)) return NULL;
    unsigned char tag[TAG_BYTES];
    int r = !g->sealer.on ? -2 : nonce.len != NONCE_BYTES ? -3
        : gmac_tag(&g->sealer, data.buf, (size_t)data.len, nonce.buf, tag);
    PyBuffer_Release(&nonce);
    PyBuffer_Release(&data);
    if (r == -3) {
        PyErr_Format(PyExc_ValueError, "a nonce is %d bytes", NONCE_BYTES);
        return NULL;
    }
    if (r < 0) {
        PyErr_SetString(PyExc_RuntimeError, r == -2 ? "Gmac was not given a key"
                                                    : "OpenSSL's AES-256-GCM failed");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)tag, TAG_BYTES);
}

static PyMethodDef gmac_methods[] = {
    {"tag", (PyCFunction)gmac_tag_method, METH_VARARGS, "The tag of data under a nonce."},
    {NULL},
};

PyTypeObject GmacType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boundedloss._native.Gmac",
    .tp_basicsize = sizeof(GmacObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AES-256-GMAC under one key, as protocol/auth.py's Gmac.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gmac_init,
    .tp_dealloc = (destructor)gmac_dealloc,
    .tp_methods = gmac_methods,
};
