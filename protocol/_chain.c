/* The block hash chain in one native loop (see protocol/hashing.py).
 *
 *   h_j = xxh3_128(h_{j-1} || tokens[(j-1)B : jB] || extra_j)
 *
 * Same bytes as the pure-Python loop (canonical big-endian digests, as
 * xxhash.xxh3_128_digest returns them); hashing.py falls back to that loop
 * when this module is not built. The Python loop costs ~0.25 us per block in
 * interpreter overhead; this one ~0.03 us, which is what keeps hashing a
 * 131,072-token prompt at B=16 well inside a lookup's budget. ``joined``
 * returns the chain as one bytes, as a lookup sends it: making 8,192 bytes
 * objects and joining them again cost more than the hashing (0.17 + 0.06 ms
 * against about 0.03 ms for the digests of a 131,072-token prompt). ``copy``
 * also returns the token bytes themselves, copied in the same pass: a prompt
 * given as a uint32 array is then read once, not once to copy and once to hash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "_vendor/xxhash.h"

#define HASH_BYTES 16

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, packed;
    Py_ssize_t stride;
    PyObject *extras = Py_None;
    int joined = 0; /* one bytes of n * 16 (h_1 || h_2 || ...) instead of a list of n bytes */
    int copy = 0;   /* also return a copy of the token bytes, made in the same pass (joined only) */
    if (!PyArg_ParseTuple(args, "y*y*n|Opp", &parent, &packed, &stride, &extras, &joined, &copy)) return NULL;
    PyObject *out = NULL, *tokens_copy = NULL;
    unsigned char *buf = NULL;
    if (parent.len != HASH_BYTES || stride <= 0 || (copy && !joined)) {
        PyErr_SetString(PyExc_ValueError, "chain: parent must be 16 bytes, stride positive, copy only joined");
        goto done;
    }
    if (extras != Py_None && !PyList_Check(extras)) {
        PyErr_SetString(PyExc_TypeError, "chain: extras must be a list of bytes or None");
        goto done;
    }
    Py_ssize_t n = packed.len / stride;
    Py_ssize_t num_extras = extras == Py_None ? 0 : PyList_GET_SIZE(extras);
    Py_ssize_t max_extra = 0;
    for (Py_ssize_t j = 0; j < num_extras && j < n; j++) {
        PyObject *x = PyList_GET_ITEM(extras, j);
        if (!PyBytes_Check(x)) {
            PyErr_SetString(PyExc_TypeError, "chain: extras must be bytes");
            goto done;
        }
        if (PyBytes_GET_SIZE(x) > max_extra) max_extra = PyBytes_GET_SIZE(x);
    }
    buf = PyMem_Malloc(HASH_BYTES + stride + max_extra);
    out = joined ? PyBytes_FromStringAndSize(NULL, n * HASH_BYTES) : PyList_New(n);
    if (copy) tokens_copy = PyBytes_FromStringAndSize(NULL, packed.len);
    if (buf == NULL || out == NULL || (copy && tokens_copy == NULL)) {
        Py_CLEAR(out);
        Py_CLEAR(tokens_copy);
        if (buf == NULL) PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, parent.buf, HASH_BYTES);
    const unsigned char *tokens = packed.buf;
    unsigned char *to = copy ? (unsigned char *)PyBytes_AS_STRING(tokens_copy) : NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        size_t len = HASH_BYTES + (size_t)stride;
        memcpy(buf + HASH_BYTES, tokens + j * stride, (size_t)stride);
        if (to != NULL) memcpy(to + j * stride, buf + HASH_BYTES, (size_t)stride);
        if (j < num_extras) {
            PyObject *x = PyList_GET_ITEM(extras, j);
            memcpy(buf + len, PyBytes_AS_STRING(x), (size_t)PyBytes_GET_SIZE(x));
            len += (size_t)PyBytes_GET_SIZE(x);
        }
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, len));
        if (joined) {
            memcpy(PyBytes_AS_STRING(out) + j * HASH_BYTES, c.digest, HASH_BYTES);
        } else {
            PyObject *h = PyBytes_FromStringAndSize((const char *)c.digest, HASH_BYTES);
            if (h == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(out, j, h);
        }
        memcpy(buf, c.digest, HASH_BYTES);  /* the next link's parent */
    }
    if (to != NULL) {  /* the tokens after the last full block (a partial block) */
        memcpy(to + n * stride, tokens + n * stride, (size_t)(packed.len - n * stride));
        PyObject *pair = PyTuple_Pack(2, tokens_copy, out);
        Py_CLEAR(tokens_copy);
        Py_SETREF(out, pair);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&packed);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(parent, packed_tokens, stride_bytes, extras=None, joined=False) -> list of 16-byte hashes h_1..h_n "
     "(joined: one bytes, h_1 || ... || h_n; copy: (bytes(packed_tokens), the joined chain), the copy made "
     "while hashing, which reads the tokens once)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", "Native block hash chain.", -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
