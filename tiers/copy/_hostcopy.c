/* Batched host memory copies for the CPU copy engine.
 *
 * One call copies every piece of a job, so the Python thread that calls it (through ctypes,
 * which releases the GIL) gives the GIL up once per job instead of once per piece: with the
 * engine's main thread busy in Python, each hand-back of the GIL can wait a whole switch
 * interval (5 ms), which made a 32-piece job take several intervals (BENCHMARKS.md, "CPU copy
 * engine vs numpy copies of the same bytes", second figure).
 *
 * Contiguous neighbours (on both sides) are merged into one memcpy. The caller guarantees that
 * every range is valid and that sources and destinations do not overlap.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <Python.h>

void kvtier_copy_batch(const uint64_t *src, const uint64_t *dst, const uint64_t *nbytes,
                       size_t count) {
    size_t i = 0;
    while (i < count) {
        uint64_t s = src[i], d = dst[i], n = nbytes[i];
        size_t j = i + 1;
        while (j < count && src[j] == s + n && dst[j] == d + n) {
            n += nbytes[j];
            j++;
        }
        memcpy((void *)(uintptr_t)d, (const void *)(uintptr_t)s, (size_t)n);
        i = j;
    }
}

/* A module object, so that the shared library builds and installs as an ordinary extension;
 * the engine loads it with ctypes. */
static struct PyModuleDef hostcopy_module = {PyModuleDef_HEAD_INIT, "_hostcopy",
                                             "kvtier_copy_batch, for ctypes.", -1, NULL};

PyMODINIT_FUNC PyInit__hostcopy(void) { return PyModule_Create(&hostcopy_module); }
