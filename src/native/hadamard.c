#include "native.h"

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
PyObject *native_fwht(PyObject *self, PyObject *args) {
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
PyObject *native_flip_signs(PyObject *self, PyObject *args) {
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
