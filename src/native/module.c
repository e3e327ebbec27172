#include "native.h"

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
    if (PyType_Ready(&ReceiveType) < 0 || PyType_Ready(&SendType) < 0
        || PyType_Ready(&DispatcherType) < 0)
        return NULL;
#ifdef BL_OPENSSL
    if (PyType_Ready(&GmacType) < 0) return NULL;
#endif
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
        || PyModule_AddIntConstant(m, "FLAG_PROBE_CARRIED", FLAG_PROBE_CARRIED) < 0
        || PyModule_AddIntConstant(m, "MAX_CHUNK_BYTES", MAX_CHUNK_BYTES) < 0
        || PyModule_AddIntConstant(m, "CLOSE_COMPLETE", CLOSE_COMPLETE) < 0
        || PyModule_AddIntConstant(m, "CLOSE_BOUND_MET", CLOSE_BOUND_MET) < 0
        || PyModule_AddIntConstant(m, "CLOSE_ACCEPT_DEADLINE", CLOSE_ACCEPT_DEADLINE) < 0
        || PyModule_AddIntConstant(m, "TRAILER_BYTES", TRAILER_BYTES) < 0
#ifdef BL_OPENSSL
        || PyModule_AddIntConstant(m, "AUTH", 1) < 0
        || PyModule_AddObjectRef(m, "Gmac", (PyObject *)&GmacType) < 0
#else
        || PyModule_AddIntConstant(m, "AUTH", 0) < 0
#endif
        || PyModule_AddObjectRef(m, "Receive", (PyObject *)&ReceiveType) < 0
        || PyModule_AddObjectRef(m, "Send", (PyObject *)&SendType) < 0
        || PyModule_AddObjectRef(m, "Dispatcher", (PyObject *)&DispatcherType) < 0;
    Py_XDECREF(layout);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
