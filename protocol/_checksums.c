/* Payload checks in one native loop, without the GIL (see protocol/checksums.py).
 *
 *   verify(views, checksums) -> bytes, one per payload: 1 where xxh3_64(views[i]) == checksums[i]
 *   digests(views) -> bytes, 8 per payload: xxh3_64(views[i]), little-endian
 *
 * The same digest as xxhash.xxh3_64_intdigest (seed 0). Why a loop of its own: python-xxhash
 * keeps the GIL while it hashes 64 KiB or less, so a thread checking a batch of 64 KiB KV
 * blocks beside a NIXL READ kept the event loop's thread out for the interpreter's whole
 * switch interval (5 ms) at a time. Here every buffer is taken first, then all of them are
 * hashed with the GIL released, once per batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
/* xxHash's own dispatcher (protocol/_vendor/xxh_x86dispatch.c, built with this module on x86-64):
 * AVX2 or AVX-512 where the CPU has them, as python-xxhash does; the SSE2 build alone hashed a
 * 64 MiB batch 10-15% slower than python-xxhash here. */
#include "_vendor/xxh_x86dispatch.h"
#else
#define XXH_INLINE_ALL
#include "_vendor/xxhash.h"
#endif

static PyObject *verify(PyObject *self, PyObject *args) {
    PyObject *views, *checksums;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &views, &PyList_Type, &checksums)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(views);
    if (PyList_GET_SIZE(checksums) != n) {
        PyErr_SetString(PyExc_ValueError, "verify: one checksum per view");
        return NULL;
    }
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    uint64_t *want = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    Py_ssize_t taken = 0;
    if (bufs == NULL || want == NULL || out == NULL) {
        if (out != NULL) PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    for (; taken < n; taken++) {
        PyObject *c = PyList_GET_ITEM(checksums, taken);
        if (!PyLong_Check(c)) {
            PyErr_Format(PyExc_TypeError, "verify: checksums[%zd] is not an int", taken);
            Py_CLEAR(out);
            goto done;
        }
        want[taken] = PyLong_AsUnsignedLongLong(c);
        if (PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(views, taken), &bufs[taken], PyBUF_SIMPLE) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    {
        char *ok = PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) ok[i] = XXH3_64bits(bufs[i].buf, (size_t)bufs[i].len) == want[i];
        Py_END_ALLOW_THREADS
    }
done:
    for (Py_ssize_t i = 0; i < taken; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(want);
    return out;
}

/* digests(views) -> bytes: n little-endian uint64, xxh3_64 of each view, hashed with the GIL released
 * (a client checksums a put's payloads off its event loop: client/node.py). */
static PyObject *digests(PyObject *self, PyObject *args) {
    PyObject *views;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &views)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(views);
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    Py_ssize_t taken = 0;
    if (bufs == NULL || out == NULL) {
        if (out != NULL) PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    for (; taken < n; taken++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(views, taken), &bufs[taken], PyBUF_SIMPLE) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    {
        unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t h = XXH3_64bits(bufs[i].buf, (size_t)bufs[i].len);
            for (int b = 0; b < 8; b++) o[i * 8 + b] = (unsigned char)(h >> (8 * b));
        }
        Py_END_ALLOW_THREADS
    }
done:
    for (Py_ssize_t i = 0; i < taken; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    return out;
}

static PyMethodDef methods[] = {
    {"digests", digests, METH_VARARGS,
     "digests(views) -> bytes: per view, its xxh3_64 as 8 little-endian bytes (hashed with the GIL released)"},
    {"verify", verify, METH_VARARGS,
     "verify(views, checksums) -> bytes: per view, 1 if its xxh3_64 equals its checksum, else 0 "
     "(hashed with the GIL released)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_checksums", "Native batch xxh3 checks.", -1, methods};

PyMODINIT_FUNC PyInit__checksums(void) { return PyModule_Create(&module); }
