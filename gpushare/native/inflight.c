/*
 * libgpushare_inflight.so: bound the kernel launches a process has in flight (LD_PRELOAD).
 *
 * Why: gpushare freezes an offline (training) client with the cgroup v2 freezer while an online
 * request is in flight. A freeze stops new launches, but kernels already queued on the GPU still
 * run ahead of the online request. CUDA_LAUNCH_BLOCKING=1 bounds that queue to one kernel but makes
 * every launch wait for its kernel, so the client's per-kernel CPU time (framework overhead) can no
 * longer overlap the GPU. This library bounds the queue to k kernels instead: after each launch it
 * records a pooled event on the launch's stream, and before a launch that would make k+1 it waits
 * for the oldest outstanding event. With k >= 2 the CPU prepares launch N while kernel N-1 runs,
 * and a freeze still bites within k kernels.
 *
 * Environment (names kept in gpushare/native/__init__.py):
 *   GPUSHARE_MAX_INFLIGHT=k       integer 1..INFLIGHT_MAX; missing or invalid: everything passes
 *                                 through unchanged and one stderr line names the problem.
 *   GPUSHARE_INFLIGHT_STATS=path  at exit, each process that made a launch appends one JSON line
 *                                 of counters there (children inherit the environment: a shell
 *                                 or tool the job runs must not overwrite the job's line).
 *   GPUSHARE_INFLIGHT_WAIT_LIMIT_MS=ms  optional, default 5000: after this long (awake) waiting
 *                                 for one earlier kernel, the bound is turned off (see wait_event).
 *   GPUSHARE_INFLIGHT_CONTROL=path  optional: a file holding the bound as a 4-byte little-endian
 *                                 int at offset 0 (0 = unbounded, above INFLIGHT_MAX = that),
 *                                 mapped read-only and read at every launch, so the daemon can
 *                                 change the bound without a restart. It overrides
 *                                 GPUSHARE_MAX_INFLIGHT. The writer must rewrite those 4 bytes in
 *                                 place (pwrite at offset 0) and never truncate the file: a read
 *                                 past the end of a mapping is SIGBUS.
 *
 * How launches reach the wrappers (all three are needed for real programs):
 *   1. Direct symbols: a program linked to libcuda calls cuLaunchKernel etc.; LD_PRELOAD wins.
 *   2. cuGetProcAddress / cuGetProcAddress_v2: CUDA >= 11.3 runtimes (and cuda-python) fetch every
 *      driver entry point through it. The per-thread-default-stream flag returns the _ptsz variant
 *      under the base name, so the real pointer is kept per variant.
 *   3. dlsym itself: cudart does dlopen("libcuda.so.1") + dlsym(handle, "cuGetProcAddress..."),
 *      which searches only that library and so bypasses LD_PRELOAD. We define dlsym and reach the
 *      real one through dlvsym(RTLD_NEXT, "dlsym", <glibc version>), trying GLIBC_2.34 (glibc moved
 *      dlsym into libc there), then the first x86-64 (GLIBC_2.2.5) and aarch64 (GLIBC_2.17)
 *      versions. This follows the approach of Project-HAMi/HAMi-core (src/libvgpu.c: its dlsym
 *      hook tries a list of glibc versions through dlvsym(RTLD_NEXT, ...)) and
 *      tdavidcl/cu_intercept (real cuGetProcAddress_v2 fetched with the real dlsym from a
 *      dlopen'ed libcuda.so.1); no code was copied from either.
 *
 * Safety: a stream being captured into a graph passes through untouched (no event may be recorded
 * or waited in a capture). Event queries and waits run with this thread's capture mode exchanged
 * to RELAXED, so another thread's global-mode capture is not invalidated by them. Any CUDA error in
 * the bookkeeping turns the bound off for the rest of the process with one stderr line: a broken
 * interposer must never break the job. One mutex guards the ring; it is held across the real
 * launch so that two threads cannot both take the last slot. No allocation after warm-up: the ring
 * and the per-context event pools are static arrays; events are created once and reused.
 *
 * Limits: only kernel and graph launches are counted (a graph as one, however many kernels it
 * holds); async copies and memsets queued between them still run ahead after a freeze. The bound is
 * per process, over all its streams and contexts, and the wait is for the oldest launch even when a
 * later one on another stream finished first. A kernel that can only finish after a later launch of
 * this process needs k above the number of such launches, else the wait gives up after
 * GPUSHARE_INFLIGHT_WAIT_LIMIT_MS and the bound is off for the process. A context destroyed and
 * another created at the same address would reuse stale pooled events: the next record fails and
 * the bound turns off (training keeps one primary context per device). A forked child is unbounded.
 *
 * No CUDA header is needed: the few types and constants are declared below, each naming its cuda.h
 * definition (values checked against cuda-python's cydriver.pxd / driver enums, CUDA 12).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- cuda.h declarations (only what is used) ---------------------------------------------- */

/* cuda.h: typedef enum cudaError_enum { CUDA_SUCCESS = 0, ... } CUresult; (an int-sized enum). */
typedef int CUresult;
#define CUDA_SUCCESS 0               /* cudaError_enum::CUDA_SUCCESS */
#define CUDA_ERROR_NOT_INITIALIZED 3 /* cudaError_enum::CUDA_ERROR_NOT_INITIALIZED */
#define CUDA_ERROR_NOT_READY 600     /* cudaError_enum::CUDA_ERROR_NOT_READY */

/* cuda.h: typedef struct CUctx_st *CUcontext; and likewise for the other opaque handles. */
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st CUlaunchAttribute; /* only pointed to */
typedef uint64_t cuuint64_t;                           /* cuda.h: typedef uint64_t cuuint64_t; */

/* cuda.h: #define CU_STREAM_PER_THREAD ((CUstream)0x2): the per-thread default stream, usable
 * with any (legacy-named) driver API. A _ptsz launch on stream 0 runs on this stream. */
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

/* cuda.h: enum CUevent_flags_enum { ..., CU_EVENT_DISABLE_TIMING = 0x2, ... } */
#define CU_EVENT_DISABLE_TIMING 0x2u
/* cuda.h: enum CUdriverProcAddress_flags_enum { CU_GET_PROC_ADDRESS_DEFAULT = 0,
 *   CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1 << 0, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM =
 *   1 << 1 } */
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (1ull << 1)
/* cuda.h: enum CUstreamCaptureStatus_enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, ACTIVE = 1,
 *   INVALIDATED = 2 } */
typedef int CUstreamCaptureStatus;
#define CU_STREAM_CAPTURE_STATUS_NONE 0
/* cuda.h: enum CUstreamCaptureMode_enum { CU_STREAM_CAPTURE_MODE_GLOBAL = 0, THREAD_LOCAL = 1,
 *   CU_STREAM_CAPTURE_MODE_RELAXED = 2 } */
typedef int CUstreamCaptureMode;
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
/* cuda.h: typedef enum CUdriverProcAddressQueryResult_enum {...} CUdriverProcAddressQueryResult;
 */
typedef int CUdriverProcAddressQueryResult;

/* cuda.h (CUDA >= 11.8): typedef struct CUlaunchConfig_st { unsigned int gridDimX, gridDimY,
 * gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes; CUstream hStream; CUlaunchAttribute
 * *attrs; unsigned int numAttrs; } CUlaunchConfig; -- field order as in cydriver.pxd. */
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
_Static_assert(sizeof(void *) != 8 || offsetof(CUlaunchConfig, hStream) == 32,
               "CUlaunchConfig.hStream follows seven unsigned ints, 8-byte aligned");

/* Driver entry points, as declared in cuda.h. */
typedef CUresult (*launch_kernel_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*launch_kernel_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*launch_coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void **);
typedef CUresult (*graph_launch_fn)(CUgraphExec, CUstream);
/* cuGetProcAddress (CUDA 11.3-11.8 ABI, the exported "cuGetProcAddress") and
 * cuGetProcAddress_v2 (CUDA >= 12.0, adds symbolStatus; cuda.h maps the name to _v2). */
typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t,
                              CUdriverProcAddressQueryResult *);
typedef CUresult (*event_create_fn)(CUevent *, unsigned int);
typedef CUresult (*event_record_fn)(CUevent, CUstream);
typedef CUresult (*event_fn)(CUevent);
typedef CUresult (*stream_get_ctx_fn)(CUstream, CUcontext *);
typedef CUresult (*stream_is_capturing_fn)(CUstream, CUstreamCaptureStatus *);
typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*ctx_push_fn)(CUcontext);
typedef CUresult (*exchange_mode_fn)(CUstreamCaptureMode *);

/* ---- state ---------------------------------------------------------------------------------- */

#define INFLIGHT_MAX 1024 /* largest accepted bound: the ring and each pool are this long */
#define MAX_CONTEXTS 16   /* contexts with an event pool; more turns the bound off */
#define PREFIX "gpushare-inflight: "

typedef struct {
    CUevent event;
    int pool; /* index into g_pools: the event's context */
} slot_t;

typedef struct {
    CUcontext ctx;
    int nfree;
    int created;
    CUevent free[INFLIGHT_MAX];
} pool_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static slot_t g_ring[INFLIGHT_MAX]; /* outstanding launches, oldest at g_head */
static int g_head, g_count;
static pool_t g_pools[MAX_CONTEXTS];
static int g_npools;

static int g_bound;                /* k from the environment; 0 = pass through */
static int g_wait_limit_ms = 5000; /* GPUSHARE_INFLIGHT_WAIT_LIMIT_MS */
static int g_last_bound;           /* the bound the last tracked launch used (stats) */
static const volatile uint32_t *g_control; /* GPUSHARE_INFLIGHT_CONTROL mapping, or NULL */
static atomic_int g_active;        /* 1 while the bound is enforced */
static char g_reason[160];         /* why everything passes through, or "" */
static atomic_ullong g_launches;   /* wrapped launch calls */
static atomic_ullong g_waits;      /* launches that had to wait for an older kernel */
static atomic_ullong g_captured;   /* launches passed through because their stream was captured */
static int g_max_inflight;         /* most launches outstanding at once (under g_lock) */
static char g_stats_path[4096];

/* Real driver functions. */
static struct {
    event_create_fn event_create;
    event_record_fn event_record;
    event_fn event_query, event_synchronize;
    stream_get_ctx_fn stream_get_ctx;
    stream_is_capturing_fn stream_is_capturing;
    ctx_get_fn ctx_get_current;
    ctx_push_fn ctx_push_current;
    ctx_get_fn ctx_pop_current;
    exchange_mode_fn exchange_capture_mode;
    int resolved; /* 1 ok, -1 failed */
} g_cu;

/* ---- the real dlsym --------------------------------------------------------------------------- */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn g_real_dlsym;
static pthread_once_t g_dlsym_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void)
{
    /* dlvsym is not interposed here, so it cannot recurse into our dlsym. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
    for (int i = 0; versions[i] != NULL && g_real_dlsym == NULL; i++)
        g_real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void *real_dlsym(void *handle, const char *name)
{
    pthread_once(&g_dlsym_once, find_real_dlsym);
    return g_real_dlsym != NULL ? g_real_dlsym(handle, name) : NULL;
}

/* ---- hooked entry points ---------------------------------------------------------------------- */

enum hook_id {
    H_LAUNCH,
    H_LAUNCH_PTSZ,
    H_LAUNCH_EX,
    H_LAUNCH_EX_PTSZ,
    H_COOP,
    H_COOP_PTSZ,
    H_GRAPH,
    H_GRAPH_PTSZ,
    H_GPA,
    H_GPA_V2,
    H_COUNT
};

typedef struct {
    const char *symbol; /* exported name in libcuda */
    const char *base;   /* name cuGetProcAddress is asked for (NULL: not reached that way) */
    int ptsz;           /* per-thread-default-stream variant */
    void *wrapper;      /* ours */
    _Atomic(void *) real;
} hook_t;

static hook_t g_hooks[H_COUNT];

static void disable(const char *fmt, CUresult rc);

/* The real function behind hook h: the one dlsym/cuGetProcAddress gave us, else the next
 * definition after this library (a program linked to libcuda), else libcuda.so.1 if loaded. */
static void *real_fn(enum hook_id h)
{
    void *fn = atomic_load_explicit(&g_hooks[h].real, memory_order_acquire);
    if (fn != NULL)
        return fn;
    fn = real_dlsym(RTLD_NEXT, g_hooks[h].symbol);
    if (fn == NULL) {
        void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (lib != NULL) {
            fn = real_dlsym(lib, g_hooks[h].symbol);
            dlclose(lib);
        }
    }
    if (fn == g_hooks[h].wrapper)
        fn = NULL;
    if (fn != NULL)
        atomic_store_explicit(&g_hooks[h].real, fn, memory_order_release);
    return fn;
}

/* Resolve the bookkeeping functions from the loaded libcuda (once, under g_lock). */
static int resolve_driver(void)
{
    if (g_cu.resolved != 0)
        return g_cu.resolved > 0;
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) {
        g_cu.resolved = -1;
        disable("libcuda.so.1 is not loaded in this process", 0);
        return 0;
    }
    g_cu.event_create = (event_create_fn)real_dlsym(lib, "cuEventCreate");
    g_cu.event_record = (event_record_fn)real_dlsym(lib, "cuEventRecord");
    g_cu.event_query = (event_fn)real_dlsym(lib, "cuEventQuery");
    g_cu.event_synchronize = (event_fn)real_dlsym(lib, "cuEventSynchronize");
    g_cu.stream_get_ctx = (stream_get_ctx_fn)real_dlsym(lib, "cuStreamGetCtx");
    g_cu.stream_is_capturing = (stream_is_capturing_fn)real_dlsym(lib, "cuStreamIsCapturing");
    g_cu.ctx_get_current = (ctx_get_fn)real_dlsym(lib, "cuCtxGetCurrent");
    g_cu.ctx_push_current = (ctx_push_fn)real_dlsym(lib, "cuCtxPushCurrent_v2");
    g_cu.ctx_pop_current = (ctx_get_fn)real_dlsym(lib, "cuCtxPopCurrent_v2");
    /* Optional (CUDA >= 10.1): without it queries simply run in the thread's own mode. */
    g_cu.exchange_capture_mode =
        (exchange_mode_fn)real_dlsym(lib, "cuThreadExchangeStreamCaptureMode");
    dlclose(lib); /* RTLD_NOLOAD took a reference; the program still holds its own */
    if (!g_cu.event_create || !g_cu.event_record || !g_cu.event_query ||
        !g_cu.event_synchronize || !g_cu.stream_get_ctx || !g_cu.stream_is_capturing ||
        !g_cu.ctx_get_current || !g_cu.ctx_push_current || !g_cu.ctx_pop_current) {
        g_cu.resolved = -1;
        disable("libcuda.so.1 lacks an event or stream entry point", 0);
        return 0;
    }
    g_cu.resolved = 1;
    return 1;
}

/* ---- the bound -------------------------------------------------------------------------------- */

static void disable(const char *what, CUresult rc)
{
    int was = atomic_exchange(&g_active, 0);
    if (g_reason[0] == '\0') {
        if (rc != 0)
            snprintf(g_reason, sizeof g_reason, "%s (CUresult %d)", what, rc);
        else
            snprintf(g_reason, sizeof g_reason, "%s", what);
    }
    if (was)
        fprintf(stderr, PREFIX "%s; kernel launches are no longer bounded in this process\n",
                g_reason);
}

static int pool_for(CUcontext ctx)
{
    for (int i = 0; i < g_npools; i++)
        if (g_pools[i].ctx == ctx)
            return i;
    if (g_npools == MAX_CONTEXTS) {
        disable("more than 16 CUDA contexts launched kernels", 0);
        return -1;
    }
    g_pools[g_npools].ctx = ctx;
    g_pools[g_npools].nfree = 0;
    g_pools[g_npools].created = 0;
    return g_npools++;
}

static void release_oldest(void)
{
    slot_t s = g_ring[g_head];
    pool_t *p = &g_pools[s.pool];
    p->free[p->nfree++] = s.event;
    g_head = (g_head + 1) % INFLIGHT_MAX;
    g_count--;
}

#define WAIT_GAVE_UP (-1)
#define SPIN_NS 1000000LL     /* poll with sched_yield for the first millisecond of a wait */
#define NAP_NS 50000L         /* then nap 50 us between polls */
#define FROZEN_GAP_NS 10000000LL /* a gap this long between polls: we were frozen or preempted */

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Wait for `ev` by polling cuEventQuery. Not cuEventSynchronize: that cannot time out, and a
 * kernel that waits on a later launch of this process (a kernel of one NCCL group over several
 * GPUs in one process, a producer/consumer pair of persistent kernels) would never finish while
 * we hold that launch back: past g_wait_limit_ms of waiting the bound gives up (WAIT_GAVE_UP)
 * rather than hang the job. Only time spent awake counts, so a cgroup freeze of this process (the
 * point of the bound) does not use up the limit. The first millisecond spins with sched_yield (the
 * kernels a shallow queue holds back are short; a sleep there would cost its wake-up on every
 * launch), then polls every 50 us (at most 5 % on a kernel of a millisecond or more). */
static CUresult wait_event(CUevent ev)
{
    int64_t awake = 0, last = now_ns();
    for (;;) {
        CUresult rc = g_cu.event_query(ev);
        if (rc != CUDA_ERROR_NOT_READY)
            return rc;
        if (awake < SPIN_NS) {
            sched_yield();
        } else {
            struct timespec nap = {0, NAP_NS};
            nanosleep(&nap, NULL);
        }
        int64_t t = now_ns();
        if (t - last < FROZEN_GAP_NS)
            awake += t - last;
        last = t;
        if (awake > (int64_t)g_wait_limit_ms * 1000000LL)
            return WAIT_GAVE_UP;
    }
}

/* Make room for one more launch: retire completed launches from the oldest; if still at the
 * bound, wait for the oldest. Launches on one stream complete in order, so the oldest is the one
 * whose completion a single-stream trainer would wait for anyway. Called with g_lock held. */
static int make_room(int bound)
{
    if (g_count < bound)
        return 1;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = g_cu.exchange_capture_mode != NULL &&
                    g_cu.exchange_capture_mode(&mode) == CUDA_SUCCESS;
    int ok = 1;
    while (g_count >= bound) {
        CUresult rc = g_cu.event_query(g_ring[g_head].event);
        if (rc == CUDA_ERROR_NOT_READY) {
            atomic_fetch_add(&g_waits, 1);
            rc = wait_event(g_ring[g_head].event);
        }
        if (rc == WAIT_GAVE_UP) {
            char what[160];
            snprintf(what, sizeof what,
                     "an earlier kernel ran %d ms without finishing (it may wait on a later launch, "
                     "e.g. one NCCL group over several GPUs in one process)",
                     g_wait_limit_ms);
            disable(what, 0);
            ok = 0;
            break;
        }
        if (rc != CUDA_SUCCESS) {
            disable("waiting for an earlier kernel's event failed", rc);
            ok = 0;
            break;
        }
        release_oldest();
    }
    if (exchanged)
        g_cu.exchange_capture_mode(&mode);
    return ok;
}

/* After a successful launch on `stream`: record a pooled event there (g_lock held). */
static void track(CUstream stream)
{
    CUcontext ctx = NULL;
    CUresult rc = g_cu.stream_get_ctx(stream, &ctx);
    if (rc != CUDA_SUCCESS) {
        disable("cuStreamGetCtx on a launch's stream failed", rc);
        return;
    }
    int pi = pool_for(ctx);
    if (pi < 0)
        return;
    pool_t *p = &g_pools[pi];
    CUevent ev;
    if (p->nfree > 0) {
        ev = p->free[--p->nfree];
    } else {
        if (p->created == INFLIGHT_MAX) { /* cannot happen: each context holds <= bound */
            disable("event pool exhausted", 0);
            return;
        }
        /* Events belong to the current context; the stream's may differ (CUkernel launches take
         * the stream's), so make it current while creating. Warm-up only. */
        CUcontext cur = NULL;
        int pushed = 0;
        if (g_cu.ctx_get_current(&cur) == CUDA_SUCCESS && cur != ctx) {
            rc = g_cu.ctx_push_current(ctx);
            if (rc != CUDA_SUCCESS) {
                disable("cuCtxPushCurrent for an event pool failed", rc);
                return;
            }
            pushed = 1;
        }
        rc = g_cu.event_create(&ev, CU_EVENT_DISABLE_TIMING);
        if (pushed) {
            CUcontext popped;
            g_cu.ctx_pop_current(&popped);
        }
        if (rc != CUDA_SUCCESS) {
            disable("cuEventCreate failed", rc);
            return;
        }
        p->created++;
    }
    rc = g_cu.event_record(ev, stream);
    if (rc != CUDA_SUCCESS) {
        p->free[p->nfree++] = ev;
        disable("cuEventRecord after a launch failed", rc);
        return;
    }
    int tail = (g_head + g_count) % INFLIGHT_MAX;
    g_ring[tail].event = ev;
    g_ring[tail].pool = pi;
    g_count++;
    if (g_count > g_max_inflight)
        g_max_inflight = g_count;
}

/* The bound for this launch: the control file's value if there is one, else the environment's. */
static int current_bound(void)
{
    if (g_control == NULL)
        return g_bound;
    uint32_t v = __atomic_load_n(g_control, __ATOMIC_RELAXED);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    int32_t k = (int32_t)v;
    return k <= 0 ? 0 : k > INFLIGHT_MAX ? INFLIGHT_MAX : (int)k;
}

/* Before a launch: 1 with g_lock held when the launch is to be tracked, 0 to pass through. */
static int gate_enter(CUstream *stream, int ptsz)
{
    atomic_fetch_add_explicit(&g_launches, 1, memory_order_relaxed);
    if (!atomic_load_explicit(&g_active, memory_order_acquire))
        return 0;
    int bound = current_bound();
    if (bound == 0) /* unbounded for now (control file): nothing to track */
        return 0;
    if (*stream == NULL && ptsz)
        *stream = CU_STREAM_PER_THREAD; /* what a _ptsz launch on stream 0 means */
    pthread_mutex_lock(&g_lock);
    if (!atomic_load(&g_active) || !resolve_driver()) {
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = g_cu.stream_is_capturing(*stream, &st);
    /* An error here is the launch's own problem (a bad or implicitly captured stream): let the
     * real launch report it, untracked. */
    if (rc != CUDA_SUCCESS || st != CU_STREAM_CAPTURE_STATUS_NONE) {
        if (rc == CUDA_SUCCESS)
            atomic_fetch_add(&g_captured, 1);
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    g_last_bound = bound;
    if (!make_room(bound)) {
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    return 1;
}

static void gate_leave(CUstream stream, CUresult launch_rc)
{
    if (launch_rc == CUDA_SUCCESS && atomic_load(&g_active))
        track(stream);
    pthread_mutex_unlock(&g_lock);
}

/* ---- launch wrappers -------------------------------------------------------------------------- */

#define MISSING_REAL CUDA_ERROR_NOT_INITIALIZED /* no libcuda behind us: what an unloaded driver says */

static CUresult launch_kernel(enum hook_id h, CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                              unsigned bx, unsigned by, unsigned bz, unsigned shmem, CUstream s,
                              void **params, void **extra)
{
    launch_kernel_fn real = (launch_kernel_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    CUstream eff = s;
    if (!gate_enter(&eff, g_hooks[h].ptsz))
        return real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
    CUresult rc = real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
    gate_leave(eff, rc);
    return rc;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                               void **extra)
{
    return launch_kernel(H_LAUNCH, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                    CUstream s, void **params, void **extra)
{
    return launch_kernel(H_LAUNCH_PTSZ, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

static CUresult launch_ex(enum hook_id h, const CUlaunchConfig *cfg, CUfunction f, void **params,
                          void **extra)
{
    launch_kernel_ex_fn real = (launch_kernel_ex_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    if (cfg == NULL) /* invalid: the driver says so */
        return real(cfg, f, params, extra);
    CUstream eff = cfg->hStream;
    if (!gate_enter(&eff, g_hooks[h].ptsz))
        return real(cfg, f, params, extra);
    CUresult rc = real(cfg, f, params, extra);
    gate_leave(eff, rc);
    return rc;
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                 void **extra)
{
    return launch_ex(H_LAUNCH_EX, cfg, f, params, extra);
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                      void **extra)
{
    return launch_ex(H_LAUNCH_EX_PTSZ, cfg, f, params, extra);
}

static CUresult launch_coop(enum hook_id h, CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                            unsigned bx, unsigned by, unsigned bz, unsigned shmem, CUstream s,
                            void **params)
{
    launch_coop_fn real = (launch_coop_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    CUstream eff = s;
    if (!gate_enter(&eff, g_hooks[h].ptsz))
        return real(f, gx, gy, gz, bx, by, bz, shmem, s, params);
    CUresult rc = real(f, gx, gy, gz, bx, by, bz, shmem, s, params);
    gate_leave(eff, rc);
    return rc;
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                          unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                          CUstream s, void **params)
{
    return launch_coop(H_COOP, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                               unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                               unsigned shmem, CUstream s, void **params)
{
    return launch_coop(H_COOP_PTSZ, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

/* A graph launch counts as one entry: the bound is on launches, and a graph's kernels finish
 * before the event recorded after it completes. */
static CUresult graph_launch(enum hook_id h, CUgraphExec g, CUstream s)
{
    graph_launch_fn real = (graph_launch_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    CUstream eff = s;
    if (!gate_enter(&eff, g_hooks[h].ptsz))
        return real(g, s);
    CUresult rc = real(g, s);
    gate_leave(eff, rc);
    return rc;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return graph_launch(H_GRAPH, g, s); }

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    return graph_launch(H_GRAPH_PTSZ, g, s);
}

/* ---- cuGetProcAddress and dlsym --------------------------------------------------------------- */

static int find_hook(const char *name, int by_base)
{
    if (name == NULL || name[0] != 'c' || name[1] != 'u')
        return -1;
    for (int i = 0; i < H_COUNT; i++) {
        const char *n = by_base ? g_hooks[i].base : g_hooks[i].symbol;
        if (n != NULL && strcmp(n, name) == 0)
            return i;
    }
    return -1;
}

/* cuGetProcAddress returned `fn` for base name `symbol`: keep it as the real function of the
 * variant asked for and hand out our wrapper of that variant. */
static void *swap_proc(const char *symbol, void *fn, int version, cuuint64_t flags)
{
    if (fn == NULL || symbol == NULL)
        return fn;
    int h;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        /* Asked through itself: the ABI depends on the version (_v2 from CUDA 12.0). */
        h = version >= 12000 ? H_GPA_V2 : H_GPA;
    } else {
        h = find_hook(symbol, 1);
        if (h < 0)
            return fn;
        if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
            h += 1; /* each _ptsz hook follows its legacy one */
    }
    if (fn == g_hooks[h].wrapper)
        return fn;
    atomic_store_explicit(&g_hooks[h].real, fn, memory_order_release);
    return g_hooks[h].wrapper;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    gpa_v2_fn real = (gpa_v2_fn)real_fn(H_GPA_V2);
    if (real == NULL)
        return MISSING_REAL;
    CUresult rc = real(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_proc(symbol, *pfn, version, flags);
    return rc;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    gpa_v1_fn real = (gpa_v1_fn)real_fn(H_GPA);
    if (real == NULL)
        return MISSING_REAL;
    CUresult rc = real(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_proc(symbol, *pfn, version, flags);
    return rc;
}

/* dlsym(handle, name) on a specific handle searches only that library, so a program that
 * dlopens libcuda would bypass the preloaded symbols: hand out our wrapper for the hooked names
 * and keep what the handle had as the real function. */
#if defined(__GNUC__) && !defined(__clang__)
/* Keep the RTLD_NEXT forward a tail call even in a build without -O2's sibling-call optimisation
 * (clang does tail calls from -O1). */
__attribute__((optimize("optimize-sibling-calls")))
#endif
EXPORT void *dlsym(void *handle, const char *name)
{
    if (handle == RTLD_NEXT) {
        /* glibc resolves RTLD_NEXT relative to dlsym's return address, so this must stay a tail
         * call (a jump: gcc -O2 emits one) for the caller's own "next" to be found; it is not
         * hooked. tests/native (test_rtld_next_from_the_program) fails if it is not a jump. */
        pthread_once(&g_dlsym_once, find_real_dlsym);
        dlsym_fn next = g_real_dlsym;
        return next != NULL ? next(handle, name) : NULL;
    }
    void *fn = real_dlsym(handle, name);
    int h = find_hook(name, 0);
    if (h < 0 || fn == NULL || fn == g_hooks[h].wrapper)
        return fn;
    atomic_store_explicit(&g_hooks[h].real, fn, memory_order_release);
    return g_hooks[h].wrapper;
}

/* ---- set-up and exit -------------------------------------------------------------------------- */

static void json_str(char *out, size_t n, const char *s)
{
    size_t j = 0;
    for (; *s != '\0' && j + 7 < n; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[j++] = '\\';
            out[j++] = (char)c;
        } else if (c < 0x20) {
            j += (size_t)snprintf(out + j, n - j, "\\u%04x", c);
        } else {
            out[j++] = (char)c;
        }
    }
    out[j] = '\0';
}

__attribute__((destructor)) static void inflight_fini(void)
{
    if (g_stats_path[0] == '\0' || atomic_load(&g_launches) == 0)
        return;
    pthread_mutex_lock(&g_lock);
    char reason[400], line[700];
    if (g_reason[0] != '\0') {
        char esc[380];
        json_str(esc, sizeof esc, g_reason);
        snprintf(reason, sizeof reason, "\"%s\"", esc);
    } else {
        snprintf(reason, sizeof reason, "null");
    }
    int len = snprintf(line, sizeof line,
                       "{\"pid\": %d, \"launches\": %llu, \"waits\": %llu, \"max_inflight\": %d, "
                       "\"bound\": %d, \"captured_passthrough\": %llu, "
                       "\"passthrough_reason\": %s}\n",
                       (int)getpid(), (unsigned long long)atomic_load(&g_launches),
                       (unsigned long long)atomic_load(&g_waits), g_max_inflight,
                       g_control != NULL ? g_last_bound : g_bound,
                       (unsigned long long)atomic_load(&g_captured), reason);
    pthread_mutex_unlock(&g_lock);
    int fd = open(g_stats_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, PREFIX "cannot write GPUSHARE_INFLIGHT_STATS=%s: %s\n", g_stats_path,
                strerror(errno));
        return;
    }
    if (len > 0 && write(fd, line, (size_t)len) != len)
        fprintf(stderr, PREFIX "short write to %s\n", g_stats_path);
    close(fd);
}

/* A forked child cannot use the parent's CUDA context (CUDA is not fork-safe), and g_lock may
 * have been held by another thread at the fork: start the child unbounded with fresh counters, so
 * it neither deadlocks nor reports the parent's launches. */
static void after_fork_in_child(void)
{
    pthread_mutex_init(&g_lock, NULL);
    atomic_store(&g_active, 0);
    snprintf(g_reason, sizeof g_reason, "a forked child (CUDA is not fork-safe)");
    g_head = g_count = g_npools = g_max_inflight = 0;
    atomic_store(&g_launches, 0);
    atomic_store(&g_waits, 0);
    atomic_store(&g_captured, 0);
}

__attribute__((constructor)) static void inflight_init(void)
{
    pthread_atfork(NULL, NULL, after_fork_in_child);
    static const struct {
        const char *symbol, *base;
        int ptsz;
        void *wrapper;
    } table[H_COUNT] = {
        [H_LAUNCH] = {"cuLaunchKernel", "cuLaunchKernel", 0, (void *)cuLaunchKernel},
        [H_LAUNCH_PTSZ] = {"cuLaunchKernel_ptsz", "cuLaunchKernel", 1,
                           (void *)cuLaunchKernel_ptsz},
        [H_LAUNCH_EX] = {"cuLaunchKernelEx", "cuLaunchKernelEx", 0, (void *)cuLaunchKernelEx},
        [H_LAUNCH_EX_PTSZ] = {"cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", 1,
                              (void *)cuLaunchKernelEx_ptsz},
        [H_COOP] = {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", 0,
                    (void *)cuLaunchCooperativeKernel},
        [H_COOP_PTSZ] = {"cuLaunchCooperativeKernel_ptsz", "cuLaunchCooperativeKernel", 1,
                         (void *)cuLaunchCooperativeKernel_ptsz},
        [H_GRAPH] = {"cuGraphLaunch", "cuGraphLaunch", 0, (void *)cuGraphLaunch},
        [H_GRAPH_PTSZ] = {"cuGraphLaunch_ptsz", "cuGraphLaunch", 1, (void *)cuGraphLaunch_ptsz},
        /* base NULL: swap_proc handles "cuGetProcAddress" itself (its ABI follows the version). */
        [H_GPA] = {"cuGetProcAddress", NULL, 0, (void *)cuGetProcAddress},
        [H_GPA_V2] = {"cuGetProcAddress_v2", NULL, 0, (void *)cuGetProcAddress_v2},
    };
    for (int i = 0; i < H_COUNT; i++) {
        g_hooks[i].symbol = table[i].symbol;
        g_hooks[i].base = table[i].base;
        g_hooks[i].ptsz = table[i].ptsz;
        g_hooks[i].wrapper = table[i].wrapper;
        atomic_init(&g_hooks[i].real, NULL);
    }

    const char *stats = getenv("GPUSHARE_INFLIGHT_STATS");
    if (stats != NULL && stats[0] != '\0' && strlen(stats) < sizeof g_stats_path)
        strcpy(g_stats_path, stats);

    const char *limit = getenv("GPUSHARE_INFLIGHT_WAIT_LIMIT_MS");
    if (limit != NULL && limit[0] != '\0') {
        char *end = NULL;
        long ms = strtol(limit, &end, 10);
        if (limit[0] < '0' || limit[0] > '9' || *end != '\0' || ms < 1 || ms > 3600000)
            fprintf(stderr,
                    PREFIX "GPUSHARE_INFLIGHT_WAIT_LIMIT_MS='%.64s' is not an integer from 1 to "
                           "3600000; using %d\n",
                    limit, g_wait_limit_ms);
        else
            g_wait_limit_ms = (int)ms;
    }

    const char *control = getenv("GPUSHARE_INFLIGHT_CONTROL");
    if (control != NULL && control[0] != '\0') {
        int fd = open(control, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < 4) {
            fprintf(stderr,
                    PREFIX "GPUSHARE_INFLIGHT_CONTROL=%.200s: %s; the bound comes from "
                           "GPUSHARE_MAX_INFLIGHT alone\n",
                    control, fd < 0 ? strerror(errno) : "not a file of at least 4 bytes");
        } else {
            void *m = mmap(NULL, 4, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED)
                fprintf(stderr, PREFIX "GPUSHARE_INFLIGHT_CONTROL=%.200s: mmap: %s\n", control,
                        strerror(errno));
            else
                g_control = m;
        }
        if (fd >= 0)
            close(fd); /* the mapping stays */
        if (g_control != NULL) {
            atomic_store(&g_active, 1);
            return; /* GPUSHARE_MAX_INFLIGHT is not needed, nor read */
        }
    }

    const char *env = getenv("GPUSHARE_MAX_INFLIGHT");
    if (env == NULL || env[0] == '\0') {
        snprintf(g_reason, sizeof g_reason, "GPUSHARE_MAX_INFLIGHT is not set");
        fprintf(stderr,
                PREFIX "GPUSHARE_MAX_INFLIGHT is not set; kernel launches pass through unbounded "
                       "(set it to an integer from 1 to %d)\n",
                INFLIGHT_MAX);
        return;
    }
    char *end = NULL;
    errno = 0;
    long k = strtol(env, &end, 10);
    /* Digits only: strtol alone would also take leading blanks and a sign. */
    if (env[0] < '0' || env[0] > '9' || errno != 0 || *end != '\0' || k < 1 ||
        k > INFLIGHT_MAX) {
        snprintf(g_reason, sizeof g_reason, "GPUSHARE_MAX_INFLIGHT is not an integer from 1 to %d",
                 INFLIGHT_MAX);
        fprintf(stderr,
                PREFIX "GPUSHARE_MAX_INFLIGHT='%.64s' is not an integer from 1 to %d; kernel "
                       "launches pass through unbounded\n",
                env, INFLIGHT_MAX);
        return;
    }
    g_bound = (int)k;
    atomic_store(&g_active, 1);
}
