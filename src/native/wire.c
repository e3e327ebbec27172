/* classify: a datagram's header checked as wire.parse checks it (the parser itself is
 * native.h's, inlined where the data path reads every datagram). */
#include "native.h"

PyObject *native_classify(PyObject *self, PyObject *arg) {
    Py_buffer b;
    Header h;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    int r = parse((const unsigned char *)b.buf, (size_t)b.len, &h);
    PyBuffer_Release(&b);
    if (r == OK) Py_RETURN_NONE;
    return PyUnicode_FromString(REASONS[r]);
}
