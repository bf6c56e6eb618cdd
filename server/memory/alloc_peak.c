/* attnserve's allocation hook: preloaded into `attnserve serve` (LD_PRELOAD, see
   alloc_hook.py), it counts per thread the bytes the thread has allocated and not freed, and
   the highest that count reached since the thread last reset it.

   Why per thread: onnxruntime runs a batch on the inference thread that calls it (its pool
   threads only split the arithmetic), allocating and freeing each intermediate tensor
   there, so that thread's peak over a run is the batch's peak; what other threads
   allocate meanwhile (the event loop building a response) stays out of it. What it
   misses: whatever onnxruntime's pool threads allocate inside a run (measured on
   MiniLM: the figure is 0.98-1.03 of the memory model fitted to memray's whole-process
   count), and a block the inference thread frees that another thread allocated counts
   against it.
   glibc's process-wide count (mallinfo2) can only be sampled, and misses peaks shorter
   than a read (server/memory.py).

   Every function forwards to glibc's own (__libc_*), so nothing else changes; the count
   costs a malloc_usable_size and two thread-local additions per call. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_pvalloc(size_t);
extern void *__libc_valloc(size_t);

#define THREAD_LOCAL static __thread __attribute__((tls_model("initial-exec")))
THREAD_LOCAL long long in_use;
THREAD_LOCAL long long peak;
THREAD_LOCAL long long base;

static inline void *took(void *p) {
    if (p) {
        in_use += (long long)malloc_usable_size(p);
        if (in_use > peak) peak = in_use;
    }
    return p;
}

static inline void gave(void *p) {
    if (p) in_use -= (long long)malloc_usable_size(p);
}

void *malloc(size_t n) { return took(__libc_malloc(n)); }
void free(void *p) { gave(p); __libc_free(p); }
void *calloc(size_t count, size_t n) { return took(__libc_calloc(count, n)); }
void *memalign(size_t align, size_t n) { return took(__libc_memalign(align, n)); }
void *aligned_alloc(size_t align, size_t n) { return took(__libc_memalign(align, n)); }
void *valloc(size_t n) { return took(__libc_valloc(n)); }
void *pvalloc(size_t n) { return took(__libc_pvalloc(n)); }

void *realloc(void *p, size_t n) {
    long long before = p ? (long long)malloc_usable_size(p) : 0;
    void *q = __libc_realloc(p, n);
    if (q || n == 0) in_use -= before;  /* moved, resized or freed; NULL otherwise: p kept */
    return took(q);
}

int posix_memalign(void **out, size_t align, size_t n) {
    if (align == 0 || align % sizeof(void *) || (align & (align - 1))) return EINVAL;
    void *p = __libc_memalign(align, n);
    if (!p) return ENOMEM;
    *out = took(p);
    return 0;
}

/* The calling thread's count: start a measurement, and read its peak since the start. */
void attnserve_alloc_reset(void) { peak = base = in_use; }
long long attnserve_alloc_peak(void) { return peak - base; }
