/* snapstore._stream: a copy fused with its crc32c, one pass, streaming stores.
 *
 * copy_crc32c(crc, src, *dsts) copies the bytes of src into every buffer of
 * dsts and returns their crc32c (CRC-32C, as the crc32c package computes it),
 * continued from crc. Each 8 bytes are loaded once into a register, added to
 * the crc32c from that register and stored from it: the bytes checked are the
 * bytes written, whatever another process does to src meanwhile. The stores
 * are non-temporal (streaming): they write whole lines past the cache, where
 * an ordinary store first reads the line (glibc's memcpy streams only copies
 * above its non-temporal threshold, typically far above a piece's size). So a checked copy
 * reads memory once and writes it once: about memcpy's time, where numpy's
 * copy followed by a crc32c of each cache-sized part reads and writes each
 * line more (`python -m benchmarks.capture` compares them with memcpy).
 *
 * The crc32c runs as three independent streams over the three thirds of a
 * buffer (the crc32 instruction has a latency of three cycles and a
 * throughput of one), joined with zlib's crc32_combine (multiplication
 * modulo the polynomial). With two or more destinations (a piece and its
 * twins) each word goes from the register into a bounce buffer in L1 and
 * is streamed from there to every destination (see three_n: 4K aliasing).
 *
 * x86-64 with SSE4.2 only (FUSED == 1); elsewhere snapstore copies with numpy
 * and checksums with the crc32c package (the same bytes and the same crc).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SNAPSTORE_X86 1
#define TARGET __attribute__((target("sse4.2")))
#else
#define SNAPSTORE_X86 0
#define TARGET
#endif

#define MAX_DSTS 8
/* Below this many bytes a copy keeps the GIL (handing it over costs more). */
#define RELEASE_MIN (16 << 10)
/* Below this many bytes one crc stream and ordinary stores. */
#define THREE_MIN 256

#if SNAPSTORE_X86

/* ---- zlib's crc32_combine, for CRC-32C (reflected polynomial) ---------- */
#define POLY 0x82f63b78u

static uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = (uint32_t)1 << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) {
        break;
      }
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
  }
  return p;
}

/* x^(2^k) mod p for every k a length can reach (no wrap: unlike CRC-32's,
 * CRC-32C's powers repeat every 31, so zlib's `k & 31` would be wrong). */
static uint32_t x2n_table[64];

static void init_x2n(void) {
  uint32_t p = (uint32_t)1 << 30; /* x^1 */
  int n;
  x2n_table[0] = p;
  for (n = 1; n < 64; n++) {
    x2n_table[n] = p = multmodp(p, p);
  }
}

static uint32_t x2nmodp(uint64_t n, unsigned k) {
  uint32_t p = (uint32_t)1 << 31; /* x^0 == 1 */
  while (n) {
    if (n & 1) {
      p = multmodp(x2n_table[k], p); /* k < 3 + 61: lengths below 2**61 */
    }
    n >>= 1;
    k++;
  }
  return p;
}

/* The crc32c of A||B from crc32c(A), crc32c(B) and len(B). */
static uint32_t combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

/* ---- the copy --------------------------------------------------------- */

/* One load a word: the compiler may not read src again for the store. */
#define LOAD(q, p)                  \
  do {                              \
    memcpy(&(q), (p), 8);           \
    __asm__ volatile("" : "+r"(q)); \
  } while (0)

/* Internal (unconditioned) crc state over n bytes, ordinary stores. */
TARGET static uint32_t serial(uint32_t st, const char *src, char *const *dsts, int nd,
                              size_t n) {
  size_t i = 0;
  int d;
  for (; i + 8 <= n; i += 8) {
    uint64_t q;
    LOAD(q, src + i);
    st = (uint32_t)_mm_crc32_u64(st, q);
    for (d = 0; d < nd; d++) {
      memcpy(dsts[d] + i, &q, 8);
    }
  }
  for (; i < n; i++) {
    unsigned char b = (unsigned char)src[i];
    __asm__ volatile("" : "+r"(b));
    st = _mm_crc32_u8(st, b);
    for (d = 0; d < nd; d++) {
      dsts[d][i] = (char)b;
    }
  }
  return st;
}

/* Three streams over three runs of len bytes (a multiple of 8) from src;
 * returns the crc32c of src[0:3*len] continued from crc. STORE(d, at, q)
 * streams word q to each destination. */
#define THREE(NAME, PARAMS, STORE)                                               \
  TARGET static uint32_t NAME(uint32_t crc, const char *src, size_t len PARAMS) { \
    uint32_t sa = ~crc, sb = 0xffffffffu, sc = 0xffffffffu;                      \
    const char *a = src, *b = src + len, *c = src + 2 * len;                     \
    size_t i;                                                                    \
    for (i = 0; i < len; i += 8) {                                               \
      uint64_t qa, qb, qc;                                                       \
      LOAD(qa, a + i);                                                           \
      LOAD(qb, b + i);                                                           \
      LOAD(qc, c + i);                                                           \
      sa = (uint32_t)_mm_crc32_u64(sa, qa);                                      \
      sb = (uint32_t)_mm_crc32_u64(sb, qb);                                      \
      sc = (uint32_t)_mm_crc32_u64(sc, qc);                                      \
      STORE(i, qa);                                                              \
      STORE(len + i, qb);                                                        \
      STORE(2 * len + i, qc);                                                    \
    }                                                                            \
    return combine(combine(~sa, ~sb, len), ~sc, len);                            \
  }

#define NT(p, q) _mm_stream_si64((long long *)(p), (long long)(q))
#define STORE_1(at, q) NT(d0 + (at), q)
#define COMMA ,
THREE(three_1, COMMA char *d0, STORE_1)

/* Two or more destinations: the three crc streams load src and store each
 * word, in cache, into a small bounce buffer, BOUNCE bytes a stream at a
 * time; then each bounce part is streamed to every destination. Streaming
 * stores wait long in the store queue, and a load whose address matches a
 * queued store's in its low 12 bits waits on it (4K aliasing): with two
 * destinations streamed straight from src, a source just past a page offset
 * of the destinations ran tens of times slower (JAX's buffers sit at any
 * 64-byte offset). The bounce is read from L1, at an offset chosen away from the
 * destinations'. Internal state in and out: returns the crc32c continued. */
#define BOUNCE 2048
TARGET static void stream_out(char *dst, const char *from, size_t m) {
  size_t j = 0;
  if (((uintptr_t)dst & 15) == 0) { /* from is 16-byte aligned too */
    for (; j + 16 <= m; j += 16) {
      _mm_stream_si128((__m128i *)(dst + j), _mm_load_si128((const __m128i *)(from + j)));
    }
  }
  for (; j < m; j += 8) {
    uint64_t q;
    memcpy(&q, from + j, 8);
    NT(dst + j, q);
  }
}

TARGET static uint32_t three_n(uint32_t crc, const char *src, size_t len, char *const *out,
                               int nd, char *bounce) {
  uint32_t sa = ~crc, sb = 0xffffffffu, sc = 0xffffffffu;
  const char *a = src, *b = src + len, *c = src + 2 * len;
  size_t i, j;
  int d;
  for (i = 0; i < len; i += BOUNCE) {
    size_t m = len - i < BOUNCE ? len - i : BOUNCE;
    for (j = 0; j < m; j += 8) {
      uint64_t qa, qb, qc;
      LOAD(qa, a + i + j);
      LOAD(qb, b + i + j);
      LOAD(qc, c + i + j);
      sa = (uint32_t)_mm_crc32_u64(sa, qa);
      sb = (uint32_t)_mm_crc32_u64(sb, qb);
      sc = (uint32_t)_mm_crc32_u64(sc, qc);
      memcpy(bounce + j, &qa, 8);
      memcpy(bounce + BOUNCE + j, &qb, 8);
      memcpy(bounce + 2 * BOUNCE + j, &qc, 8);
    }
    for (d = 0; d < nd; d++) {
      stream_out(out[d] + i, bounce, m);
      stream_out(out[d] + len + i, bounce + BOUNCE, m);
      stream_out(out[d] + 2 * len + i, bounce + 2 * BOUNCE, m);
    }
  }
  return combine(combine(~sa, ~sb, len), ~sc, len);
}

TARGET static uint32_t copy_crc(uint32_t crc, const char *src, char **dsts, int nd, size_t n) {
  size_t head, len;
  int d;
  if (n < THREE_MIN) {
    return ~serial(~crc, src, dsts, nd, n);
  }
  /* ordinary stores up to the first destination's 8-byte alignment (16:
   * two or more, streamed 16 bytes at a time where their offsets agree) */
  head = (size_t)(-(uintptr_t)dsts[0]) & (nd == 1 ? 7 : 15);
  crc = ~serial(~crc, src, dsts, nd, head);
  src += head;
  n -= head;
  for (d = 0; d < nd; d++) {
    dsts[d] += head;
  }
  /* (a multiple of 64 for two or more: each part's destinations stay as
   * aligned as the first's) */
  len = (n / 3) & (nd == 1 ? ~(size_t)7 : ~(size_t)63);
  if (nd == 1) {
    crc = three_1(crc, src, len, dsts[0]);
  } else {
    /* 3 bounce parts and a page to place them in, 64-byte aligned */
    char room[3 * BOUNCE + 4096 + 64];
    uintptr_t base = ((uintptr_t)room + 63) & ~(uintptr_t)63;
    /* half a page from the first destination's offset */
    uintptr_t want = ((uintptr_t)dsts[0] + 2048) & 4095 & ~(uintptr_t)63;
    base += (want - (base & 4095)) & 4095;
    crc = three_n(crc, src, len, dsts, nd, (char *)base);
  }
  _mm_sfence(); /* the streamed lines are ordered before what follows */
  for (d = 0; d < nd; d++) {
    dsts[d] += 3 * len;
  }
  return ~serial(~crc, src + 3 * len, dsts, nd, n - 3 * len);
}

static int has_sse42(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") != 0;
}

#endif /* SNAPSTORE_X86 */

static int fused = 0;

/* A buffer of Python object pointers (numpy dtype=object): copying it would
 * copy references without counting them. */
static int holds_objects(const Py_buffer *b) {
  return b->format != NULL && strchr(b->format, 'O') != NULL;
}

static int overlaps(const Py_buffer *x, const Py_buffer *y) {
  const char *a = (const char *)x->buf, *b = (const char *)y->buf;
  return x->len && y->len && a < b + y->len && b < a + x->len;
}

static PyObject *copy_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer src, dst[MAX_DSTS];
  unsigned long long crc;
  int nd = (int)nargs - 2, got = 0, d;
  PyObject *result = NULL;
  (void)self;
  if (!fused) {
    PyErr_SetString(PyExc_RuntimeError, "copy_crc32c needs x86-64 with SSE4.2 (FUSED is 0)");
    return NULL;
  }
  if (nargs < 3 || nd > MAX_DSTS) {
    PyErr_Format(PyExc_TypeError, "copy_crc32c(crc, src, *dsts) takes 1 to %d dsts",
                 MAX_DSTS);
    return NULL;
  }
  {
    PyObject *index = PyNumber_Index(args[0]); /* ints and numpy integers */
    if (index == NULL) {
      return NULL;
    }
    crc = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (PyErr_Occurred()) {
      return NULL;
    }
  }
  if (crc > 0xffffffffull) {
    PyErr_SetString(PyExc_OverflowError, "crc must be below 2**32");
    return NULL;
  }
  if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    return NULL;
  }
  if (holds_objects(&src)) {
    PyBuffer_Release(&src);
    PyErr_SetString(PyExc_TypeError, "copy_crc32c: src holds Python objects");
    return NULL;
  }
  for (; got < nd; got++) {
    if (PyObject_GetBuffer(args[2 + got], &dst[got],
                           PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
      goto done;
    }
    if (holds_objects(&dst[got])) {
      PyErr_SetString(PyExc_TypeError, "copy_crc32c: a dst holds Python objects");
      got++;
      goto done;
    }
    if (dst[got].len != src.len) {
      PyErr_Format(PyExc_ValueError, "copy_crc32c: a dst has %zd bytes, src %zd",
                   dst[got].len, src.len);
      got++;
      goto done;
    }
    if (overlaps(&dst[got], &src)) {
      PyErr_SetString(PyExc_ValueError, "copy_crc32c: a dst overlaps src");
      got++;
      goto done;
    }
    for (d = 0; d < got; d++) {
      if (overlaps(&dst[got], &dst[d])) {
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: two dsts overlap");
        got++;
        goto done;
      }
    }
  }
#if SNAPSTORE_X86
  {
    char *out[MAX_DSTS];
    uint32_t c = (uint32_t)crc;
    for (d = 0; d < nd; d++) {
      out[d] = (char *)dst[d].buf;
    }
    if (src.len >= RELEASE_MIN) {
      Py_BEGIN_ALLOW_THREADS
      c = copy_crc(c, (const char *)src.buf, out, nd, (size_t)src.len);
      Py_END_ALLOW_THREADS
    } else {
      c = copy_crc(c, (const char *)src.buf, out, nd, (size_t)src.len);
    }
    result = PyLong_FromUnsignedLong(c);
  }
#endif
done:
  for (d = 0; d < got; d++) {
    PyBuffer_Release(&dst[d]);
  }
  PyBuffer_Release(&src);
  return result;
}

/* A signed 64-bit integer buffer ('q' or 'l', any byte-order prefix). */
static int is_int64(const Py_buffer *b) {
  const char *f = b->format == NULL ? "B" : b->format;
  if (*f == '<' || *f == '=' || *f == '@') {
    f++;
  }
  return b->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
}

static int is_uint32(const Py_buffer *b) {
  const char *f = b->format == NULL ? "B" : b->format;
  if (*f == '<' || *f == '=' || *f == '@') {
    f++;
  }
  return b->itemsize == 4 && strcmp(f, "I") == 0;
}

/* Takes a private copy of table (int64 rows of cols) into *rows (PyMem:
 * the caller frees it) and acquires crcs (one uint32 a row); returns the row
 * count, or -1 with an exception set, nothing held and nothing allocated.
 * The rows are checked and used from the private copy only: the caller's
 * table may be rewritten meanwhile (by a copy into a dst that overlaps it,
 * by Python code a source's buffer export runs, by another thread while the
 * GIL is released), and a row must not change between its check and its
 * copy. */
static Py_ssize_t get_rows(PyObject *const *args, int cols, int64_t **rows, Py_buffer *crcs,
                           const char *name) {
  Py_buffer table;
  Py_ssize_t n;
  *rows = NULL;
  if (PyObject_GetBuffer(args[0], &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    return -1;
  }
  if (!is_int64(&table) || table.len % (8 * cols) != 0) {
    PyErr_Format(PyExc_TypeError, "%s: table must be int64 rows of %d", name, cols);
    PyBuffer_Release(&table);
    return -1;
  }
  n = table.len / (8 * cols);
  *rows = PyMem_Malloc(table.len > 0 ? (size_t)table.len : 1);
  if (*rows == NULL) {
    PyBuffer_Release(&table);
    PyErr_NoMemory();
    return -1;
  }
  memcpy(*rows, table.buf, (size_t)table.len);
  PyBuffer_Release(&table);
  if (PyObject_GetBuffer(args[1], crcs, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
    goto fail;
  }
  if (!is_uint32(crcs) || crcs->len != 4 * n) {
    PyErr_Format(PyExc_TypeError, "%s: crcs must be %zd uint32", name, n);
    PyBuffer_Release(crcs);
    goto fail;
  }
  return n;
fail:
  PyMem_Free(*rows);
  *rows = NULL;
  return -1;
}

/* copy_crc32c_many(src, dst, table, crcs): for each row i of table (int64
 * rows of (offset, length, seed)), copies src[offset:offset+length] to the
 * same place in dst and writes the crc32c of the bytes copied, continued
 * from seed, to crcs[i]. One call for a run of small pieces: no Python per
 * piece. */
static PyObject *copy_crc32c_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer src, dst, crcs;
  int64_t *t = NULL; /* the private copy of the table's rows */
  int held = 0;
  Py_ssize_t n, i, total = 0;
  PyObject *result = NULL;
  (void)self;
  if (!fused) {
    PyErr_SetString(PyExc_RuntimeError,
                    "copy_crc32c_many needs x86-64 with SSE4.2 (FUSED is 0)");
    return NULL;
  }
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "copy_crc32c_many(src, dst, table, crcs) takes 4 arguments");
    return NULL;
  }
  if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    return NULL;
  }
  held = 1;
  if (PyObject_GetBuffer(args[1], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
    goto done;
  }
  held = 2;
  n = get_rows(args + 2, 3, &t, &crcs, "copy_crc32c_many");
  if (n < 0) {
    goto done;
  }
  held = 4;
  if (holds_objects(&src) || holds_objects(&dst)) {
    PyErr_SetString(PyExc_TypeError, "copy_crc32c_many: src or dst holds Python objects");
    goto done;
  }
  if (dst.len != src.len) {
    PyErr_Format(PyExc_ValueError, "copy_crc32c_many: dst has %zd bytes, src %zd", dst.len,
                 src.len);
    goto done;
  }
  if (overlaps(&dst, &src) || overlaps(&crcs, &src) || overlaps(&crcs, &dst)) {
    PyErr_SetString(PyExc_ValueError, "copy_crc32c_many: buffers overlap");
    goto done;
  }
  for (i = 0; i < n; i++) {
    int64_t at = t[3 * i], len = t[3 * i + 1], seed = t[3 * i + 2];
    if (at < 0 || len < 0 || at > src.len || len > src.len - at) {
      PyErr_Format(PyExc_ValueError,
                   "copy_crc32c_many: row %zd (%lld, %lld) is outside the %zd bytes", i,
                   (long long)at, (long long)len, src.len);
      goto done;
    }
    if (seed < 0 || seed > 0xffffffffll) {
      PyErr_Format(PyExc_OverflowError, "copy_crc32c_many: row %zd's seed is not a uint32", i);
      goto done;
    }
    if (total < RELEASE_MIN) {
      total += len; /* (only compared with RELEASE_MIN: no overflow) */
    }
  }
#if SNAPSTORE_X86
  {
    uint32_t *out = (uint32_t *)crcs.buf;
    const char *s = (const char *)src.buf;
    char *d = (char *)dst.buf;
    PyThreadState *ts = total >= RELEASE_MIN ? PyEval_SaveThread() : NULL;
    for (i = 0; i < n; i++) {
      char *to = d + t[3 * i];
      out[i] = copy_crc((uint32_t)t[3 * i + 2], s + t[3 * i], &to, 1, (size_t)t[3 * i + 1]);
    }
    if (ts != NULL) {
      PyEval_RestoreThread(ts);
    }
  }
#endif
  result = Py_NewRef(Py_None);
done:
  if (held >= 4) {
    PyBuffer_Release(&crcs);
    PyMem_Free(t);
  }
  if (held >= 2) PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return result;
}

/* copy_crc32c_gather(dst, table, crcs, srcs): for each source i of the
 * sequence srcs, copies it to dst[offset:offset+len(src)] (table: int64
 * rows of (offset, seed)) and writes the crc32c of the bytes copied,
 * continued from seed, to crcs[i]. One call for many small pieces (a save's
 * shards): no Python per piece. Rows whose places overlap in dst are the
 * caller's to avoid: a later copy would overwrite bytes an earlier crc
 * covers (memory stays safe). */
static PyObject *copy_crc32c_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer dst, crcs, *srcs = NULL;
  int64_t *t = NULL; /* the private copy of the table's rows */
  PyObject *seq = NULL, *result = NULL;
  int held = 0;
  Py_ssize_t n = 0, got = 0, i, total = 0;
  (void)self;
  if (!fused) {
    PyErr_SetString(PyExc_RuntimeError,
                    "copy_crc32c_gather needs x86-64 with SSE4.2 (FUSED is 0)");
    return NULL;
  }
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError,
                    "copy_crc32c_gather(dst, table, crcs, srcs) takes 4 arguments");
    return NULL;
  }
  if (PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
    return NULL;
  }
  held = 1;
  n = get_rows(args + 1, 2, &t, &crcs, "copy_crc32c_gather");
  if (n < 0) {
    n = 0;
    goto done;
  }
  held = 3;
  if (holds_objects(&dst)) {
    PyErr_SetString(PyExc_TypeError, "copy_crc32c_gather: dst holds Python objects");
    goto done;
  }
  if (overlaps(&crcs, &dst)) {
    PyErr_SetString(PyExc_ValueError, "copy_crc32c_gather: buffers overlap");
    goto done;
  }
  /* A tuple: its items cannot change or go away while a source's buffer
   * export runs Python code (a list's could). */
  seq = PySequence_Tuple(args[3]);
  if (seq == NULL) {
    goto done;
  }
  if (PyTuple_GET_SIZE(seq) != n) {
    PyErr_Format(PyExc_ValueError, "copy_crc32c_gather: %zd srcs for %zd rows",
                 PyTuple_GET_SIZE(seq), n);
    goto done;
  }
  srcs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
  if (srcs == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  /* Every source acquired first (exports may run Python code), then every
   * row checked against them: no Python runs between a check and its copy. */
  for (; got < n; got++) {
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, got), &srcs[got],
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      goto done;
    }
    if (holds_objects(&srcs[got])) {
      got++;
      PyErr_SetString(PyExc_TypeError, "copy_crc32c_gather: a src holds Python objects");
      goto done;
    }
    if (overlaps(&srcs[got], &dst)) {
      got++;
      PyErr_SetString(PyExc_ValueError, "copy_crc32c_gather: a src overlaps dst");
      goto done;
    }
  }
  for (i = 0; i < n; i++) {
    int64_t at = t[2 * i], seed = t[2 * i + 1];
    if (at < 0 || at > dst.len || srcs[i].len > dst.len - at) {
      PyErr_Format(PyExc_ValueError,
                   "copy_crc32c_gather: row %zd: %zd bytes at %lld are outside the %zd bytes",
                   i, srcs[i].len, (long long)at, dst.len);
      goto done;
    }
    if (seed < 0 || seed > 0xffffffffll) {
      PyErr_Format(PyExc_OverflowError, "copy_crc32c_gather: row %zd's seed is not a uint32", i);
      goto done;
    }
    if (total < RELEASE_MIN) {
      total += srcs[i].len; /* (only compared with RELEASE_MIN: no overflow) */
    }
  }
#if SNAPSTORE_X86
  {
    uint32_t *out = (uint32_t *)crcs.buf;
    char *d = (char *)dst.buf;
    PyThreadState *ts = total >= RELEASE_MIN ? PyEval_SaveThread() : NULL;
    for (i = 0; i < n; i++) {
      char *to = d + t[2 * i];
      out[i] = copy_crc((uint32_t)t[2 * i + 1], (const char *)srcs[i].buf, &to, 1,
                        (size_t)srcs[i].len);
    }
    if (ts != NULL) {
      PyEval_RestoreThread(ts);
    }
  }
#endif
  result = Py_NewRef(Py_None);
done:
  for (i = 0; i < got; i++) {
    PyBuffer_Release(&srcs[i]);
  }
  PyMem_Free(srcs);
  Py_XDECREF(seq);
  if (held >= 3) {
    PyBuffer_Release(&crcs);
    PyMem_Free(t);
  }
  PyBuffer_Release(&dst);
  return result;
}

static PyMethodDef methods[] = {
    {"copy_crc32c", (PyCFunction)(void (*)(void))copy_crc32c, METH_FASTCALL,
     "copy_crc32c(crc, src, *dsts, /) -> int: copies src into every dst (same length,\n"
     "not overlapping src) with streaming stores; returns the crc32c of the bytes\n"
     "copied, continued from crc."},
    {"copy_crc32c_many", (PyCFunction)(void (*)(void))copy_crc32c_many, METH_FASTCALL,
     "copy_crc32c_many(src, dst, table, crcs, /) -> None: for each int64 row\n"
     "(offset, length, seed) of table, copies src[offset:offset+length] to the same\n"
     "place in dst (as long as src, not overlapping it) and writes the crc32c of the\n"
     "bytes copied, continued from seed, to the uint32 crcs[row]."},
    {"copy_crc32c_gather", (PyCFunction)(void (*)(void))copy_crc32c_gather, METH_FASTCALL,
     "copy_crc32c_gather(dst, table, crcs, srcs, /) -> None: copies each buffer of\n"
     "srcs to dst at its int64 row (offset, seed) of table (not overlapping dst) and\n"
     "writes the crc32c of the bytes copied, continued from seed, to the uint32\n"
     "crcs[row]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream",
    "A copy fused with its crc32c, streaming stores (see the source's comment).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__stream(void) {
  PyObject *m;
#if SNAPSTORE_X86
  fused = has_sse42();
  if (fused) {
    init_x2n();
  }
#endif
  m = PyModule_Create(&module);
  if (m == NULL) {
    return NULL;
  }
  if (PyModule_AddIntConstant(m, "FUSED", fused) < 0 ||
      PyModule_AddIntConstant(m, "MAX_DSTS", MAX_DSTS) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
