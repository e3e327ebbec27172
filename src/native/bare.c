#include "native.h"

/* --------------------------------------------------------------- ceiling */
#ifdef __linux__
#include <time.h>

/* blast(sock, ip, port, size, count, segment, source) -> calls: ``count`` datagrams of
 * ``size`` bytes and no protocol, the machine's own limit for that kind of send: one
 * sendto each, or (``segment``) as many per UDP_SEGMENT send as 64 KB and 64 segments
 * allow. Their bytes come from ``source`` in order (wrapping around), as a message's
 * would; with None, from one small buffer the cache keeps. A full socket buffer is
 * waited out (poll), never dropped. */
PyObject *native_blast(PyObject *self, PyObject *args) {
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
    GsoControl ctrl;
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
        if (k > 1) set_gso(&m, &ctrl, (uint16_t)size);
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
PyObject *native_drain(PyObject *self, PyObject *args) {
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
