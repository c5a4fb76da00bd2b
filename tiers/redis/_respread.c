/* The Redis tier's pipelined GET replies, read into their buffers by one foreign call per
 * readiness event (through ctypes, which releases the GIL for the whole call).
 *
 * Each recv from Python hands the GIL over and takes it back: with vLLM's engine thread busy in
 * Python, every take can wait a whole switch interval, and a reply of half a MiB took several
 * (a 64 MiB batch read at 0.2-0.45 GiB/s beside a thread spinning in Python, 1.6-2.4 alone).
 * Here a call drains what the socket has into the replies' buffers, however much accumulated
 * while the caller waited for the GIL, and says where it stopped; the caller waits for the
 * socket to be readable and calls again.
 *
 * It takes only the common reply: `$<n>\r\n`, then an object of n bytes that is a header of
 * n - len(payload) bytes (at most head_max) followed by exactly len(payload) bytes, then CRLF.
 * Anything else (nil, an error reply, an object of another size or too large) stops before that
 * reply with nothing of it consumed, for the Python reader (`RespConnection.value_into`). The
 * socket is never waited on here: recv is always MSG_DONTWAIT.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <Python.h>

/* Every field is 64 bits wide, so that the ctypes mirror (`tiers.redis.resp._ReadState`) is a
 * row of c_uint64; addresses are integers. */
typedef struct {
    uint64_t count;       /* replies to read */
    uint64_t head;        /* address of uint64_t[count]: each item's header buffer */
    uint64_t payload;     /* address of uint64_t[count]: each item's payload buffer */
    uint64_t payload_len; /* address of uint64_t[count] */
    uint64_t limit;       /* address of uint64_t[count]: the longest object accepted */
    uint64_t head_len;    /* address of uint64_t[count], out: each object's header length */
    uint64_t head_max;    /* the size of each header buffer */
    uint64_t item;        /* progress: replies complete */
    uint64_t phase;       /* 0 the bulk line, 1 the header, 2 the payload, 3 the CRLF */
    uint64_t at;          /* bytes done in the phase */
    uint64_t buf;         /* the connection's staging buffer: address, size, unread bytes */
    uint64_t cap;
    uint64_t start;
    uint64_t end;
    uint64_t err; /* errno of a failed recv */
} kvtier_resp_state;

enum { DONE = 0, AGAIN = 1, OTHER = 2, CLOSED = -1, PROTOCOL = -2, FAILED = -3 };

#define LINE_MAX_BYTES 24 /* "$" and 20 digits and CRLF, with room */

/* Receive into the staging buffer's free end (its unread bytes moved to the front when it has
 * none): 1 when bytes came, 0 when the socket has none now, CLOSED or FAILED. */
static int
fill(int fd, kvtier_resp_state *s)
{
    unsigned char *buf = (unsigned char *)(uintptr_t)s->buf;
    if (s->start == s->end) {
        s->start = s->end = 0;
    }
    else if (s->end == s->cap) {
        memmove(buf, buf + s->start, (size_t)(s->end - s->start));
        s->end -= s->start;
        s->start = 0;
    }
    for (;;) {
        ssize_t got = recv(fd, buf + s->end, (size_t)(s->cap - s->end), MSG_DONTWAIT);
        if (got > 0) {
            s->end += (uint64_t)got;
            return 1;
        }
        if (got == 0)
            return CLOSED;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        s->err = (uint64_t)errno;
        return FAILED;
    }
}

/* The bulk line of reply `i` at the staging buffer's front: 1 parsed (consumed, the header's
 * length set), 0 more bytes are needed, OTHER not a reply this reader takes. */
static int
bulk_line(kvtier_resp_state *s, uint64_t i)
{
    const unsigned char *line = (const unsigned char *)(uintptr_t)s->buf + s->start;
    size_t have = (size_t)(s->end - s->start), k;
    uint64_t n = 0, plen = ((const uint64_t *)(uintptr_t)s->payload_len)[i];
    const unsigned char *cr;
    if (have == 0)
        return 0;
    if (line[0] != '$')
        return OTHER;
    cr = memchr(line, '\r', have < LINE_MAX_BYTES ? have : LINE_MAX_BYTES);
    if (cr == NULL)
        return have < LINE_MAX_BYTES ? 0 : OTHER;
    if ((size_t)(cr - line) + 1 >= have)
        return 0; /* the LF is still to come */
    if (cr[1] != '\n' || cr - line < 2 || cr - line > 20)
        return OTHER;
    for (k = 1; line + k < cr; k++) {
        if (line[k] < '0' || line[k] > '9')
            return OTHER; /* "$-1" (nil) too */
        n = n * 10 + (uint64_t)(line[k] - '0');
    }
    if (n > ((const uint64_t *)(uintptr_t)s->limit)[i] || n < plen || n - plen > s->head_max)
        return OTHER;
    ((uint64_t *)(uintptr_t)s->head_len)[i] = n - plen;
    s->start += (uint64_t)(cr + 2 - line);
    return 1;
}

int
kvtier_resp_read(int fd, kvtier_resp_state *s)
{
    unsigned char *buf = (unsigned char *)(uintptr_t)s->buf;
    while (s->item < s->count) {
        uint64_t i = s->item;
        int rc;
        if (s->phase == 0) {
            rc = bulk_line(s, i);
            if (rc == OTHER)
                return OTHER;
            if (rc == 0) {
                rc = fill(fd, s);
                if (rc <= 0)
                    return rc == 0 ? AGAIN : rc;
                continue;
            }
            s->phase = 1;
            s->at = 0;
        }
        if (s->phase == 1) { /* the header, through the staging buffer */
            unsigned char *head = (unsigned char *)(uintptr_t)((const uint64_t *)(uintptr_t)s->head)[i];
            uint64_t need = ((const uint64_t *)(uintptr_t)s->head_len)[i];
            while (s->at < need) {
                uint64_t have = s->end - s->start, take;
                if (have == 0) {
                    rc = fill(fd, s);
                    if (rc <= 0)
                        return rc == 0 ? AGAIN : rc;
                    continue;
                }
                take = have < need - s->at ? have : need - s->at;
                memcpy(head + s->at, buf + s->start, (size_t)take);
                s->start += take;
                s->at += take;
            }
            s->phase = 2;
            s->at = 0;
        }
        if (s->phase == 2) { /* the payload: what is staged, then straight from the socket */
            unsigned char *dst = (unsigned char *)(uintptr_t)((const uint64_t *)(uintptr_t)s->payload)[i];
            uint64_t plen = ((const uint64_t *)(uintptr_t)s->payload_len)[i];
            uint64_t have = s->end - s->start;
            if (have > 0 && s->at < plen) {
                uint64_t take = have < plen - s->at ? have : plen - s->at;
                memcpy(dst + s->at, buf + s->start, (size_t)take);
                s->start += take;
                s->at += take;
            }
            while (s->at < plen) {
                ssize_t got = recv(fd, dst + s->at, (size_t)(plen - s->at), MSG_DONTWAIT);
                if (got > 0) {
                    s->at += (uint64_t)got;
                    continue;
                }
                if (got == 0)
                    return CLOSED;
                if (errno == EINTR)
                    continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK)
                    return AGAIN;
                s->err = (uint64_t)errno;
                return FAILED;
            }
            s->phase = 3;
        }
        if (s->end - s->start < 2) { /* phase 3: the CRLF */
            rc = fill(fd, s);
            if (rc <= 0)
                return rc == 0 ? AGAIN : rc;
            continue;
        }
        if (buf[s->start] != '\r' || buf[s->start + 1] != '\n')
            return PROTOCOL;
        s->start += 2;
        s->phase = 0;
        s->item++;
    }
    return DONE;
}

/* A module object, so that the shared library builds and installs as an ordinary extension;
 * the Redis tier loads it with ctypes. */
static struct PyModuleDef respread_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_respread",
    .m_doc = "kvtier_resp_read, for ctypes.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__respread(void)
{
    return PyModule_Create(&respread_module);
}
