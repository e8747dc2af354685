/*
 * libgpushare_inflight.so: bound the kernel launches a process has in flight (LD_PRELOAD).
 *
 * Why: gpushare freezes an offline (training) client with the cgroup v2 freezer while an online
 * request is in flight. A freeze stops new launches, but kernels already queued on the GPU still
 * run ahead of the online request. CUDA_LAUNCH_BLOCKING=1 bounds that queue to one kernel but makes
 * every launch wait for its kernel, so the client's per-kernel CPU time (framework overhead) can no
 * longer overlap the GPU. This library bounds the queue to k kernels instead: after each launch it
 * records a pooled event on the launch's stream, and a launch that would make k+1 first retires
 * the launches whose events have completed (in any order, over all streams) and waits only when
 * every one of the k is still pending. With k >= 2 the CPU prepares launch N while kernel N-1
 * runs, and a freeze still bites within k kernels.
 *
 * Environment (names kept in gpushare/native/__init__.py):
 *   GPUSHARE_MAX_INFLIGHT=k       integer 1..INFLIGHT_MAX; missing or invalid: everything passes
 *                                 through unchanged and one stderr line names the problem.
 *   GPUSHARE_INFLIGHT_STATS=path  at exit, each process that made a launch appends one JSON line
 *                                 of counters there (children inherit the environment: a shell
 *                                 or tool the job runs must not overwrite the job's line). Only a
 *                                 regular file is written; it is created 0600 and never through
 *                                 a symbolic link; a FIFO or device is refused (never blocks).
 *   GPUSHARE_INFLIGHT_WAIT_LIMIT_MS=ms  optional, default 5000: after this long (awake) waiting
 *                                 with every slot pending, that one launch goes through
 *                                 unbounded (a "give-up", counted in the stats) and the bound
 *                                 re-arms as soon as a pending launch completes (see make_room).
 *   GPUSHARE_INFLIGHT_CONTROL=path  optional: a regular file holding the bound as a 4-byte
 *                                 little-endian int at offset 0 (0 = unbounded, above
 *                                 INFLIGHT_MAX = that), mapped read-only and read at every launch,
 *                                 so the daemon can change the bound without a restart. It
 *                                 overrides GPUSHARE_MAX_INFLIGHT. The writer must rewrite those 4
 *                                 bytes in place (pwrite at offset 0) and never truncate the
 *                                 file: a read past the end of a mapping is SIGBUS.
 *
 * How launches reach the wrappers (all three are needed for real programs):
 *   1. Direct symbols: a program linked to libcuda calls cuLaunchKernel etc.; LD_PRELOAD wins.
 *   2. cuGetProcAddress / cuGetProcAddress_v2 / cuGetProcAddress_v2_ptsz: CUDA >= 11.3 runtimes
 *      (and cuda-python) fetch every driver entry point through it. The per-thread-default-stream
 *      flag returns the _ptsz variant under the base name, so the real pointer is kept per variant.
 *   3. dlsym itself: cudart does dlopen("libcuda.so.1") + dlsym(handle, "cuGetProcAddress..."),
 *      which searches only that library and so bypasses LD_PRELOAD. We define dlsym. Every name we
 *      do not hook, and every lookup through RTLD_DEFAULT or RTLD_NEXT, is a tail call (a jump) to
 *      the next dlsym, so glibc, which resolves those pseudo-handles relative to the return address
 *      of dlsym, sees the caller's own: a plugin loaded RTLD_LOCAL still finds its dependencies.
 *      The next dlsym is found with glibc's own: dlvsym(RTLD_NEXT, "dlsym", <glibc version>)
 *      (GLIBC_2.34, where glibc moved dlsym into libc, then the first x86-64 and aarch64 versions)
 *      gives glibc's, and that one's dlsym(RTLD_NEXT, "dlsym"), called from here, gives whatever
 *      comes after this library: an unversioned dlsym of a later preload (an interposer in
 *      HAMi-core's style), which a versioned lookup would skip, else glibc's. This follows the
 *      approach of Project-HAMi/HAMi-core (src/libvgpu.c) and tdavidcl/cu_intercept; no code was
 *      copied from either.
 *
 * Safety: a stream being captured into a graph passes through untouched (no event may be recorded
 * or waited in a capture). Event queries run with this thread's capture mode exchanged to
 * RELAXED, so another thread's global-mode capture is not invalidated by them. Any unexpected CUDA
 * error in the bookkeeping turns the bound off for the rest of the process with one stderr line: a
 * broken interposer must never break the job. One mutex guards the slots and pools; it is never
 * held across a wait, a real launch or an event record (a thread that waits naps with it
 * released), so one slow stream cannot stall another stream's launches beyond the bound, and a
 * thread cancelled or longjmp'ed out of a signal handler mid-wait leaves no lock behind.
 * Cancellation is disabled from entering the gate to leaving it (the bookkeeping between is
 * not cancellation-safe); a cancel requested meanwhile acts at the thread's next cancellation
 * point, as without the library. No allocation: slots and the per-context event pools are static
 * arrays; events are created once and reused.
 *
 * Contexts: pools are keyed by the context's unique id (cuCtxGetId, CUDA >= 12.0, "unique for the
 * life of the program"), not only its handle, and a pool is checked against its context's id
 * before any of its events is touched: after cuCtxDestroy, cuDevicePrimaryCtxReset or
 * cudaDeviceReset the pool's events died with their context, so the pool is dropped (its events are
 * never queried, recorded or destroyed again) and its pending launches count as done. Without
 * cuCtxGetId (older drivers) pools are keyed by handle alone, as before.
 *
 * Graphs drain: a graph launch waits until nothing of this process is in flight and, while it is
 * pending, no other launch is made. Why not weigh it by its kernel nodes counted at
 * instantiation: that needs hooking cuGraphInstantiate (four entry points and versions),
 * cuGraphExecUpdate and cuGraphExecDestroy, and a table keyed by CUgraphExec handles that the
 * driver reuses; and the graphs a shallow queue meets (torch.compile "reduce-overhead", XLA) hold
 * a whole iteration, hundreds of kernels against a k of 2-4, so a weight would drain anyway. A
 * freeze then bites within one graph, whatever it holds: the bound cannot split a graph.
 *
 * Limits: only kernel and graph launches are counted; async copies and memsets, host functions
 * (cuLaunchHostFunc) and stream waits queued between them still run ahead after a freeze, and
 * NCCL collectives wait on other processes the bound knows nothing of. The bound is per process,
 * over all its streams and contexts. A kernel that can only finish after a later launch of this
 * process needs k above the number of such launches, else every such launch waits
 * GPUSHARE_INFLIGHT_WAIT_LIMIT_MS and then goes through (a give-up). A forked child of a process
 * that used CUDA passes everything through (CUDA is not fork-safe); a child of a process that did
 * not keeps the bound with fresh slots.
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
#include <signal.h>
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

/* The sanitizers' runtimes call dlsym while they start, before their shadow memory exists: the
 * code on that path must not be instrumented (an instrumented build only; a no-op otherwise). */
#if defined(__has_attribute)
#if __has_attribute(no_sanitize)
#define NO_SANITIZE __attribute__((no_sanitize("address", "undefined", "thread")))
#endif
#endif
#ifndef NO_SANITIZE
#define NO_SANITIZE
#endif

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
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM (1ull << 0)
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
 * cuGetProcAddress_v2 (CUDA >= 12.0, adds symbolStatus; cuda.h maps the name to _v2, and to
 * cuGetProcAddress_v2_ptsz under CUDA_API_PER_THREAD_DEFAULT_STREAM). */
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
/* cuda.h (CUDA >= 12.0): CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId); */
typedef CUresult (*ctx_get_id_fn)(CUcontext, unsigned long long *);
typedef CUresult (*exchange_mode_fn)(CUstreamCaptureMode *);

/* ---- state ---------------------------------------------------------------------------------- */

#define INFLIGHT_MAX 1024 /* largest accepted bound: the slots and each pool are this long */
#define MAX_CONTEXTS 16   /* live contexts with an event pool; more turns the bound off */
#define PREFIX "gpushare-inflight: "

enum slot_state { SLOT_FREE, SLOT_RESERVED, SLOT_PENDING };

/* One launch in flight. RESERVED: admitted, the real launch and its event record are being made
 * (by the thread that reserved it, without the lock); PENDING: its event is recorded. */
typedef struct {
    CUevent event;
    int pool;      /* index into g_pools: the event's context */
    unsigned gen;  /* g_pools[pool].gen when reserved: a dropped pool's slots are done */
    int live_pos;  /* index into g_live */
    unsigned char state;
    unsigned char graph;
} slot_t;

typedef struct {
    CUcontext ctx;           /* NULL: unused */
    unsigned long long id;   /* cuCtxGetId, or 0 without it */
    unsigned gen;            /* bumped when the pool is dropped */
    unsigned checked;        /* g_sweep_no of the last liveness check */
    int nfree;
    int created;
    CUevent free[INFLIGHT_MAX];
} pool_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static slot_t g_slots[INFLIGHT_MAX];
static int g_live[INFLIGHT_MAX]; /* indices of the non-free slots; g_count of them */
static int g_count;
static int g_freelist[INFLIGHT_MAX], g_nfreelist, g_fresh; /* free slots: list, then fresh */
static int g_graphs;     /* graph launches among the live slots */
static int g_draining;   /* graph launches waiting for the slots to empty */
static int g_stuck;      /* a wait gave up: pass through until some launch completes */
static unsigned g_sweep_no;
static pool_t g_pools[MAX_CONTEXTS];

static int g_bound;                /* k from the environment; 0 = pass through */
static int g_wait_limit_ms = 5000; /* GPUSHARE_INFLIGHT_WAIT_LIMIT_MS */
static atomic_int g_last_bound;    /* the bound the last tracked launch used (stats) */
static const volatile uint32_t *g_control; /* GPUSHARE_INFLIGHT_CONTROL mapping, or NULL */
static atomic_int g_active;        /* 1 while the bound is enforced */
static char g_reason[160];         /* why everything passes through, or "" */
static atomic_ullong g_launches;   /* wrapped launch calls */
static atomic_ullong g_waits;      /* launches that had to wait for an older kernel */
static atomic_ullong g_give_ups;   /* waits that reached the limit: that launch went through */
static atomic_ullong g_graph_launches; /* tracked graph launches (each drains) */
static atomic_ullong g_captured;   /* launches passed through because their stream was captured */
static atomic_int g_max_inflight;  /* most launches outstanding at once */
static atomic_int g_gave_up_said;  /* the one stderr line about give-ups was printed */
static char g_stats_path[4096];

/* Real driver functions. */
static struct {
    event_create_fn event_create;
    event_record_fn event_record;
    event_fn event_query;
    stream_get_ctx_fn stream_get_ctx;
    stream_is_capturing_fn stream_is_capturing;
    ctx_get_fn ctx_get_current;
    ctx_push_fn ctx_push_current;
    ctx_get_fn ctx_pop_current;
    ctx_get_id_fn ctx_get_id;               /* optional (CUDA >= 12.0) */
    exchange_mode_fn exchange_capture_mode; /* optional (CUDA >= 10.1) */
    atomic_int resolved;                    /* 1 ok, -1 failed, 0 not yet */
} g_cu;

/* ---- the real and the next dlsym -------------------------------------------------------------- */

typedef void *(*dlsym_fn)(void *, const char *);
/* glibc's, and the next definition after this library (glibc's if none). Found without
 * pthread_once, which ThreadSanitizer intercepts and cannot run while it starts: finding them
 * twice at once is harmless (the same answers). */
static _Atomic(dlsym_fn) g_real_dlsym, g_next_dlsym;

/* Not inlined: glibc resolves RTLD_NEXT relative to the return address of its dlsym, which must
 * be in this library for "the next dlsym after this library". */
NO_SANITIZE __attribute__((noinline)) static dlsym_fn find_dlsyms(void)
{
    /* dlvsym is not interposed here, so it cannot recurse into our dlsym. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
    dlsym_fn real = NULL;
    for (int i = 0; versions[i] != NULL && real == NULL; i++)
        real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    dlsym_fn next = real != NULL ? (dlsym_fn)real(RTLD_NEXT, "dlsym") : NULL;
    atomic_store_explicit(&g_real_dlsym, real, memory_order_release);
    atomic_store_explicit(&g_next_dlsym, next != NULL ? next : real, memory_order_release);
    return next != NULL ? next : real;
}

NO_SANITIZE static dlsym_fn next_dlsym(void)
{
    dlsym_fn next = atomic_load_explicit(&g_next_dlsym, memory_order_acquire);
    return next != NULL ? next : find_dlsyms();
}

static void *real_dlsym(void *handle, const char *name)
{
    next_dlsym();
    dlsym_fn real = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    return real != NULL ? real(handle, name) : NULL;
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
    H_GPA_V2_PTSZ,
    H_COUNT
};

typedef struct {
    const char *symbol; /* exported name in libcuda */
    const char *base;   /* name cuGetProcAddress is asked for (NULL: not reached that way) */
    int ptsz;           /* per-thread-default-stream variant */
    void *wrapper;      /* ours */
} hook_t;

EXPORT CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, CUstream, void **, void **);
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, CUstream, void **, void **);
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
EXPORT CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                          unsigned, unsigned, unsigned, CUstream, void **);
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                               unsigned, unsigned, unsigned, CUstream, void **);
EXPORT CUresult cuGraphLaunch(CUgraphExec, CUstream);
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec, CUstream);
EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult *);
EXPORT CUresult cuGetProcAddress_v2_ptsz(const char *, void **, int, cuuint64_t,
                                         CUdriverProcAddressQueryResult *);

/* A constant table, not filled by the constructor: the sanitizers' runtimes (and other
 * libraries' constructors) call dlsym before our constructor has run. Each _ptsz hook follows its
 * legacy one. base NULL: swap_proc handles "cuGetProcAddress" itself (its ABI follows the
 * version). */
static const hook_t g_hooks[H_COUNT] = {
    [H_LAUNCH] = {"cuLaunchKernel", "cuLaunchKernel", 0, (void *)cuLaunchKernel},
    [H_LAUNCH_PTSZ] = {"cuLaunchKernel_ptsz", "cuLaunchKernel", 1, (void *)cuLaunchKernel_ptsz},
    [H_LAUNCH_EX] = {"cuLaunchKernelEx", "cuLaunchKernelEx", 0, (void *)cuLaunchKernelEx},
    [H_LAUNCH_EX_PTSZ] = {"cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", 1,
                          (void *)cuLaunchKernelEx_ptsz},
    [H_COOP] = {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", 0,
                (void *)cuLaunchCooperativeKernel},
    [H_COOP_PTSZ] = {"cuLaunchCooperativeKernel_ptsz", "cuLaunchCooperativeKernel", 1,
                     (void *)cuLaunchCooperativeKernel_ptsz},
    [H_GRAPH] = {"cuGraphLaunch", "cuGraphLaunch", 0, (void *)cuGraphLaunch},
    [H_GRAPH_PTSZ] = {"cuGraphLaunch_ptsz", "cuGraphLaunch", 1, (void *)cuGraphLaunch_ptsz},
    [H_GPA] = {"cuGetProcAddress", NULL, 0, (void *)cuGetProcAddress},
    [H_GPA_V2] = {"cuGetProcAddress_v2", NULL, 0, (void *)cuGetProcAddress_v2},
    [H_GPA_V2_PTSZ] = {"cuGetProcAddress_v2_ptsz", NULL, 1, (void *)cuGetProcAddress_v2_ptsz},
};
static _Atomic(void *) g_real[H_COUNT]; /* the real function behind each hook, once known */

static void disable(const char *fmt, CUresult rc);

/* The real function behind hook h: the one dlsym/cuGetProcAddress gave us, else the next
 * definition after this library (a program linked to libcuda), else libcuda.so.1 if loaded. */
static void *real_fn(enum hook_id h)
{
    void *fn = atomic_load_explicit(&g_real[h], memory_order_acquire);
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
        atomic_store_explicit(&g_real[h], fn, memory_order_release);
    return fn;
}

/* Resolve the bookkeeping functions from the loaded libcuda (once, under g_lock). */
static int resolve_driver(void)
{
    int r = atomic_load(&g_cu.resolved);
    if (r != 0)
        return r > 0;
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) {
        atomic_store(&g_cu.resolved, -1);
        disable("libcuda.so.1 is not loaded in this process", 0);
        return 0;
    }
    g_cu.event_create = (event_create_fn)real_dlsym(lib, "cuEventCreate");
    g_cu.event_record = (event_record_fn)real_dlsym(lib, "cuEventRecord");
    g_cu.event_query = (event_fn)real_dlsym(lib, "cuEventQuery");
    g_cu.stream_get_ctx = (stream_get_ctx_fn)real_dlsym(lib, "cuStreamGetCtx");
    g_cu.stream_is_capturing = (stream_is_capturing_fn)real_dlsym(lib, "cuStreamIsCapturing");
    g_cu.ctx_get_current = (ctx_get_fn)real_dlsym(lib, "cuCtxGetCurrent");
    g_cu.ctx_push_current = (ctx_push_fn)real_dlsym(lib, "cuCtxPushCurrent_v2");
    g_cu.ctx_pop_current = (ctx_get_fn)real_dlsym(lib, "cuCtxPopCurrent_v2");
    g_cu.ctx_get_id = (ctx_get_id_fn)real_dlsym(lib, "cuCtxGetId");
    g_cu.exchange_capture_mode =
        (exchange_mode_fn)real_dlsym(lib, "cuThreadExchangeStreamCaptureMode");
    dlclose(lib); /* RTLD_NOLOAD took a reference; the program still holds its own */
    if (!g_cu.event_create || !g_cu.event_record || !g_cu.event_query || !g_cu.stream_get_ctx ||
        !g_cu.stream_is_capturing || !g_cu.ctx_get_current || !g_cu.ctx_push_current ||
        !g_cu.ctx_pop_current) {
        atomic_store(&g_cu.resolved, -1);
        disable("libcuda.so.1 lacks an event or stream entry point", 0);
        return 0;
    }
    atomic_store(&g_cu.resolved, 1);
    return 1;
}

/* ---- the bound -------------------------------------------------------------------------------- */

static atomic_int g_reason_set;

static void disable(const char *what, CUresult rc)
{
    int was = atomic_exchange(&g_active, 0);
    if (atomic_exchange(&g_reason_set, 1) == 0) {
        if (rc != 0)
            snprintf(g_reason, sizeof g_reason, "%s (CUresult %d)", what, rc);
        else
            snprintf(g_reason, sizeof g_reason, "%s", what);
    }
    if (was)
        fprintf(stderr, PREFIX "%s; kernel launches are no longer bounded in this process\n",
                g_reason);
}

/* Whether pool p's context is still the one its events were created in (g_lock held). */
static int pool_alive(const pool_t *p)
{
    if (g_cu.ctx_get_id == NULL)
        return 1; /* no way to tell (CUDA < 12.0): keyed by handle, as before */
    unsigned long long id = 0;
    return g_cu.ctx_get_id(p->ctx, &id) == CUDA_SUCCESS && id == p->id;
}

static void live_remove(int idx)
{
    int pos = g_slots[idx].live_pos;
    int last = g_live[--g_count];
    g_live[pos] = last;
    g_slots[last].live_pos = pos;
}

/* Free slot idx; its event goes back to its pool unless the pool was dropped (g_lock held). */
static void release_slot(int idx)
{
    slot_t *s = &g_slots[idx];
    pool_t *p = &g_pools[s->pool];
    if (s->event != NULL && s->gen == p->gen)
        p->free[p->nfree++] = s->event;
    if (s->graph)
        g_graphs--;
    s->event = NULL;
    s->state = SLOT_FREE;
    live_remove(idx);
    g_freelist[g_nfreelist++] = idx;
}

/* Pool pi's context is gone (destroyed or reset): its events died with it. Forget them without
 * touching them, and count its pending launches as done (g_lock held). Returns how many. */
static int drop_pool(int pi)
{
    pool_t *p = &g_pools[pi];
    int done = 0;
    p->gen++;
    p->ctx = NULL;
    p->id = 0;
    p->nfree = p->created = 0;
    for (int i = g_count - 1; i >= 0; i--) {
        int idx = g_live[i];
        if (g_slots[idx].pool == pi && g_slots[idx].state == SLOT_PENDING) {
            release_slot(idx);
            done++;
            i = g_count; /* g_live changed under the loop: start again (it only shrinks) */
        }
    }
    return done;
}

/* The pool for context ctx with id `id` (g_lock held); -1 when there is none to be had. */
static int pool_for(CUcontext ctx, unsigned long long id)
{
    int unused = -1;
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (g_pools[i].ctx == ctx && g_pools[i].id == id)
            return i;
        if (g_pools[i].ctx == ctx) /* the handle came back with a new id: a new context */
            drop_pool(i);
        if (g_pools[i].ctx == NULL && unused < 0)
            unused = i;
    }
    for (int i = 0; i < MAX_CONTEXTS && unused < 0; i++)
        if (!pool_alive(&g_pools[i])) {
            drop_pool(i);
            unused = i;
        }
    if (unused < 0) {
        disable("more than 16 live CUDA contexts launched kernels", 0);
        return -1;
    }
    g_pools[unused].ctx = ctx;
    g_pools[unused].id = id;
    return unused;
}

/* Retire every pending launch whose event has completed, in any order (g_lock held). Returns how
 * many were retired, or -1 when an unexpected error turned the bound off. */
static int sweep(void)
{
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = g_cu.exchange_capture_mode != NULL &&
                    g_cu.exchange_capture_mode(&mode) == CUDA_SUCCESS;
    int retired = 0;
    g_sweep_no++;
    for (int i = g_count - 1; i >= 0 && retired >= 0; i--) {
        int idx = g_live[i];
        slot_t *s = &g_slots[idx];
        if (s->state != SLOT_PENDING)
            continue;
        pool_t *p = &g_pools[s->pool];
        if (p->checked != g_sweep_no) { /* once per sweep: its events exist only if it is alive */
            p->checked = g_sweep_no;
            if (!pool_alive(p)) {
                retired += drop_pool(s->pool);
                i = g_count;
                continue;
            }
        }
        CUresult rc = g_cu.event_query(s->event);
        if (rc == CUDA_SUCCESS) {
            release_slot(idx);
            retired++;
        } else if (rc != CUDA_ERROR_NOT_READY) {
            disable("querying an earlier kernel's event failed", rc);
            retired = -1;
        }
    }
    if (exchanged)
        g_cu.exchange_capture_mode(&mode);
    return retired;
}

#define SPIN_NS 1000000LL        /* poll with sched_yield for the first millisecond of a wait */
#define NAP_NS 50000L            /* then nap 50 us between polls (about 110-130 us with slack) */
#define FROZEN_GAP_NS 10000000LL /* a gap this long between polls: we were frozen or preempted */

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int has_room(int bound, int graph)
{
    if (graph)
        return g_count == 0; /* a graph drains: see the header */
    return g_count < bound && g_graphs == 0 && g_draining == 0;
}

static void gave_up(void)
{
    atomic_fetch_add(&g_give_ups, 1);
    g_stuck = 1;
    if (atomic_exchange(&g_gave_up_said, 1) == 0)
        fprintf(stderr,
                PREFIX "an earlier kernel ran %d ms without finishing (it may wait on a later "
                       "launch, e.g. one NCCL group over several GPUs in one process); launches "
                       "go through unbounded until one in flight completes (counted as give_ups)\n",
                g_wait_limit_ms);
}

/* Make room for one more launch (g_lock held; released while waiting, held again on return).
 * Returns 1 when there is room, 0 to let this launch through untracked.
 *
 * Completed launches are retired in any order; the wait is only when every slot is pending, and
 * it polls (the lock released between polls) rather than cuEventSynchronize: that cannot time
 * out, and a kernel that waits on a later launch of this process (a kernel of one NCCL group over
 * several GPUs in one process, a producer/consumer pair of persistent kernels) would never finish
 * while we hold that launch back. After g_wait_limit_ms of waiting awake (a cgroup freeze of this
 * process, the point of the bound, does not use up the limit) the launch goes through (a give-up),
 * and until some launch in flight completes so do later ones, without waiting: the bound is back
 * as soon as there is room again. The first millisecond spins with sched_yield (the kernels a
 * shallow queue holds back are short; a sleep there would cost its wake-up on every launch), then
 * polls after 50 us naps, which Linux's default timer slack for a normal thread (50 us,
 * PR_SET_TIMERSLACK) and the wake-up stretch to about 120 us each (117 us median measured by
 * bench/inflight_overhead.py): a completion is seen some 60 us late on average and at most one
 * period, 12 % of a 1 ms kernel. The slack is process-wide and the job's, so it is left alone;
 * the simulator's INFLIGHT_NAP_LAG_S (50 us, half of a 50 us nap plus 50 us of slack) is that
 * average less the wake-up. */
static int make_room(int bound, int graph, sigset_t *saved, int *masked)
{
    int64_t awake = 0, last = 0;
    int waited = 0, ok = 0;
    unsigned seen = g_sweep_no;
    sigset_t async; /* blocked while the lock is held between naps: see below */
    if (graph)
        g_draining++;
    for (;;) {
        if (!atomic_load(&g_active))
            break;
        if (has_room(bound, graph)) {
            ok = 1;
            break;
        }
        /* With several waiters, one sweep a poll is enough: skip ours if another thread swept
         * since we last looked (has_room above saw what it retired). */
        int retired = g_sweep_no == seen ? sweep() : 0;
        seen = g_sweep_no;
        if (retired < 0)
            break;
        if (retired > 0) {
            g_stuck = 0;
            continue;
        }
        if (g_stuck)
            break;
        if (!waited) {
            waited = 1;
            atomic_fetch_add(&g_waits, 1);
            last = now_ns();
            /* A handler that longjmps out of the wait must find the lock free: signals are
             * delivered only during the naps (gate_enter restores the mask). The synchronous
             * ones stay unblocked: blocked, they would kill the process. */
            sigfillset(&async);
            sigdelset(&async, SIGSEGV);
            sigdelset(&async, SIGBUS);
            sigdelset(&async, SIGILL);
            sigdelset(&async, SIGFPE);
            *masked = pthread_sigmask(SIG_BLOCK, &async, saved) == 0;
        }
        pthread_mutex_unlock(&g_lock);
        if (*masked)
            pthread_sigmask(SIG_SETMASK, saved, NULL);
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
        if (*masked)
            pthread_sigmask(SIG_BLOCK, &async, NULL);
        pthread_mutex_lock(&g_lock);
        if (awake > (int64_t)g_wait_limit_ms * 1000000LL) {
            gave_up();
            break;
        }
    }
    if (graph)
        g_draining--;
    return ok;
}

/* A free slot, RESERVED for a launch on pool pi's context (g_lock held). */
static int reserve(int pi, int graph)
{
    int idx = g_nfreelist > 0 ? g_freelist[--g_nfreelist] : g_fresh++;
    slot_t *s = &g_slots[idx];
    pool_t *p = &g_pools[pi];
    s->event = p->nfree > 0 ? p->free[--p->nfree] : NULL;
    s->pool = pi;
    s->gen = p->gen;
    s->state = SLOT_RESERVED;
    s->graph = (unsigned char)graph;
    s->live_pos = g_count;
    g_live[g_count++] = idx;
    if (graph)
        g_graphs++;
    return idx;
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

/* One launch through the gate: what gate_enter found, for gate_leave. */
typedef struct {
    int slot;
    CUstream stream;
    CUcontext ctx;
    CUevent event; /* from the pool, or NULL: create one */
    unsigned gen;
    int pool;
    int cancel_state;
} gate_t;

/* The context of `stream` and its unique id (0 without cuCtxGetId); 0 on an error, which is the
 * launch's own problem (a bad stream): the real launch reports it, untracked. */
static int stream_context(CUstream stream, CUcontext *ctx, unsigned long long *id)
{
    *id = 0;
    if (g_cu.stream_get_ctx(stream, ctx) != CUDA_SUCCESS)
        return 0;
    return g_cu.ctx_get_id == NULL || g_cu.ctx_get_id(*ctx, id) == CUDA_SUCCESS;
}

/* Before a launch: 1 when it is to be tracked (leave with gate_leave), 0 to pass through. */
static int gate_enter(gate_t *g, CUstream stream, int ptsz, int graph)
{
    atomic_fetch_add_explicit(&g_launches, 1, memory_order_relaxed);
    if (!atomic_load_explicit(&g_active, memory_order_acquire))
        return 0;
    int bound = current_bound();
    if (bound == 0) /* unbounded for now (control file): nothing to track */
        return 0;
    if (atomic_load(&g_cu.resolved) == 0) {
        pthread_mutex_lock(&g_lock);
        resolve_driver();
        pthread_mutex_unlock(&g_lock);
    }
    if (atomic_load(&g_cu.resolved) < 0)
        return 0;
    g->stream = stream == NULL && ptsz ? CU_STREAM_PER_THREAD : stream;
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &g->cancel_state);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = g_cu.stream_is_capturing(g->stream, &st);
    unsigned long long id = 0;
    int tracked = 0;
    if (rc == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE)
        atomic_fetch_add(&g_captured, 1);
    else if (rc == CUDA_SUCCESS && stream_context(g->stream, &g->ctx, &id))
        tracked = 1; /* else an error: the launch's own problem, reported by the real launch */
    if (tracked) {
        sigset_t saved;
        int masked = 0;
        pthread_mutex_lock(&g_lock);
        tracked = make_room(bound, graph, &saved, &masked) &&
                  (g->pool = pool_for(g->ctx, id)) >= 0;
        if (tracked) {
            g->slot = reserve(g->pool, graph);
            g->event = g_slots[g->slot].event;
            g->gen = g_slots[g->slot].gen;
            atomic_store_explicit(&g_last_bound, bound, memory_order_relaxed);
        }
        pthread_mutex_unlock(&g_lock);
        if (masked)
            pthread_sigmask(SIG_SETMASK, &saved, NULL);
    }
    if (!tracked) {
        int ignored;
        pthread_setcancelstate(g->cancel_state, &ignored);
    }
    return tracked;
}

/* An event of context ctx (made current while creating: the stream's context may differ from
 * the thread's, as CUkernel launches allow). Warm-up only: pooled events are reused. */
static CUevent create_event(CUcontext ctx)
{
    CUcontext cur = NULL;
    int pushed = 0;
    CUresult rc = CUDA_SUCCESS;
    if (g_cu.ctx_get_current(&cur) == CUDA_SUCCESS && cur != ctx) {
        rc = g_cu.ctx_push_current(ctx);
        if (rc != CUDA_SUCCESS) {
            disable("cuCtxPushCurrent for an event pool failed", rc);
            return NULL;
        }
        pushed = 1;
    }
    CUevent ev = NULL;
    rc = g_cu.event_create(&ev, CU_EVENT_DISABLE_TIMING);
    if (pushed) {
        CUcontext popped;
        g_cu.ctx_pop_current(&popped);
    }
    if (rc != CUDA_SUCCESS) {
        disable("cuEventCreate failed", rc);
        return NULL;
    }
    return ev;
}

/* After the real launch: record the slot's event on the launch's stream, or free the slot. */
static void gate_leave(gate_t *g, CUresult launch_rc)
{
    CUevent ev = g->event;
    int created = 0, recorded = 0;
    if (launch_rc == CUDA_SUCCESS && atomic_load(&g_active)) {
        if (ev == NULL) {
            ev = create_event(g->ctx);
            created = ev != NULL;
        }
        if (ev != NULL) {
            CUresult rc = g_cu.event_record(ev, g->stream);
            recorded = rc == CUDA_SUCCESS;
            if (!recorded)
                disable("cuEventRecord after a launch failed", rc);
        }
    }
    pthread_mutex_lock(&g_lock);
    slot_t *s = &g_slots[g->slot];
    pool_t *p = &g_pools[g->pool];
    s->event = ev;
    if (created && p->gen == g->gen)
        p->created++;
    if (recorded && p->gen == g->gen) {
        s->state = SLOT_PENDING;
        int n = g_count;
        if (n > atomic_load_explicit(&g_max_inflight, memory_order_relaxed))
            atomic_store_explicit(&g_max_inflight, n, memory_order_relaxed);
        if (s->graph)
            atomic_fetch_add(&g_graph_launches, 1);
    } else {
        release_slot(g->slot); /* the launch failed, or its context went meanwhile */
    }
    pthread_mutex_unlock(&g_lock);
    int ignored;
    pthread_setcancelstate(g->cancel_state, &ignored);
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
    gate_t g;
    if (!gate_enter(&g, s, g_hooks[h].ptsz, 0))
        return real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
    CUresult rc = real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
    gate_leave(&g, rc);
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
    gate_t g;
    if (cfg == NULL || !gate_enter(&g, cfg->hStream, g_hooks[h].ptsz, 0))
        return real(cfg, f, params, extra); /* a NULL config is invalid: the driver says so */
    CUresult rc = real(cfg, f, params, extra);
    gate_leave(&g, rc);
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
    gate_t g;
    if (!gate_enter(&g, s, g_hooks[h].ptsz, 0))
        return real(f, gx, gy, gz, bx, by, bz, shmem, s, params);
    CUresult rc = real(f, gx, gy, gz, bx, by, bz, shmem, s, params);
    gate_leave(&g, rc);
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

/* A graph launch drains (see the header): it waits until nothing is in flight, and nothing else
 * launches until its event, recorded after all its nodes, completes. */
static CUresult graph_launch(enum hook_id h, CUgraphExec ge, CUstream s)
{
    graph_launch_fn real = (graph_launch_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    gate_t g;
    if (!gate_enter(&g, s, g_hooks[h].ptsz, 1))
        return real(ge, s);
    CUresult rc = real(ge, s);
    gate_leave(&g, rc);
    return rc;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return graph_launch(H_GRAPH, g, s); }

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    return graph_launch(H_GRAPH_PTSZ, g, s);
}

/* ---- cuGetProcAddress and dlsym --------------------------------------------------------------- */

NO_SANITIZE static int find_hook(const char *name, int by_base)
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
 * variant asked for and hand out our wrapper of that variant. `ptsz_default`: asked through
 * cuGetProcAddress_v2_ptsz, whose CU_GET_PROC_ADDRESS_DEFAULT means the per-thread variants (the
 * default a per-thread-default-stream compilation unit gets). */
static void *swap_proc(const char *symbol, void *fn, int version, cuuint64_t flags,
                       int ptsz_default)
{
    if (fn == NULL || symbol == NULL)
        return fn;
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 ||
                     (ptsz_default && !(flags & CU_GET_PROC_ADDRESS_LEGACY_STREAM));
    int h;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        /* Asked through itself: the ABI depends on the version (_v2 from CUDA 12.0). */
        h = version < 12000 ? H_GPA : per_thread ? H_GPA_V2_PTSZ : H_GPA_V2;
    } else {
        h = find_hook(symbol, 1);
        if (h < 0)
            return fn;
        if (per_thread)
            h += 1; /* each _ptsz hook follows its legacy one */
    }
    if (fn == g_hooks[h].wrapper)
        return fn;
    atomic_store_explicit(&g_real[h], fn, memory_order_release);
    return g_hooks[h].wrapper;
}

static CUresult gpa_v2(enum hook_id h, const char *symbol, void **pfn, int version,
                       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    gpa_v2_fn real = (gpa_v2_fn)real_fn(h);
    if (real == NULL)
        return MISSING_REAL;
    CUresult rc = real(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_proc(symbol, *pfn, version, flags, g_hooks[h].ptsz);
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    return gpa_v2(H_GPA_V2, symbol, pfn, version, flags, status);
}

EXPORT CUresult cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    return gpa_v2(H_GPA_V2_PTSZ, symbol, pfn, version, flags, status);
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    gpa_v1_fn real = (gpa_v1_fn)real_fn(H_GPA);
    if (real == NULL)
        return MISSING_REAL;
    CUresult rc = real(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL)
        *pfn = swap_proc(symbol, *pfn, version, flags, 0);
    return rc;
}

/* dlsym(handle, name) on a specific handle searches only that library, so a program that
 * dlopens libcuda would bypass the preloaded symbols: for the hooked names on such a handle hand
 * out our wrapper and keep what the next dlsym found as the real function. Everything else is a
 * tail call to the next dlsym. */
NO_SANITIZE static void *dlsym_hooked(void *handle, const char *name, int h)
{
    dlsym_fn next = next_dlsym();
    void *fn = next != NULL ? next(handle, name) : NULL;
    if (fn == NULL || fn == g_hooks[h].wrapper)
        return fn;
    atomic_store_explicit(&g_real[h], fn, memory_order_release);
    return g_hooks[h].wrapper;
}

#if defined(__GNUC__) && !defined(__clang__)
/* Keep the forward a tail call even in a build without -O2's sibling-call optimisation (clang
 * does tail calls from -O1). */
__attribute__((optimize("optimize-sibling-calls")))
#endif
NO_SANITIZE EXPORT void *dlsym(void *handle, const char *name)
{
    /* glibc resolves RTLD_DEFAULT and RTLD_NEXT relative to dlsym's return address, so the
     * forward must stay a tail call (a jump: gcc -O2 emits one) for the caller's own scope to be
     * searched. tests/native fails if it is not (a plugin's RTLD_DEFAULT lookup, RTLD_NEXT from
     * the program). */
    int h = handle == RTLD_NEXT || handle == RTLD_DEFAULT ? -1 : find_hook(name, 0);
    if (h >= 0)
        return dlsym_hooked(handle, name, h);
    dlsym_fn next = next_dlsym();
    return next != NULL ? next(handle, name) : NULL;
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

/* Open a path from the environment without ever blocking or following a final symbolic link,
 * and only if it is a regular file (a FIFO would block, a device could be anything). Returns
 * the descriptor or -1 with *why set. */
static int open_regular(const char *path, int flags, mode_t mode, const char **why)
{
    int fd = open(path, flags | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, mode);
    struct stat st;
    if (fd < 0) {
        *why = errno == ELOOP ? "a symbolic link (refused)" : strerror(errno);
        return -1;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        *why = "not a regular file (refused)";
        return -1;
    }
    return fd;
}

/* Counters only (atomics), no lock: a thread that died or jumped out while holding g_lock must
 * not hang the exit. */
__attribute__((destructor)) static void inflight_fini(void)
{
    if (g_stats_path[0] == '\0' || atomic_load(&g_launches) == 0)
        return;
    char reason[400], line[800];
    if (atomic_load(&g_reason_set)) {
        char esc[380];
        json_str(esc, sizeof esc, g_reason);
        snprintf(reason, sizeof reason, "\"%s\"", esc);
    } else {
        snprintf(reason, sizeof reason, "null");
    }
    int len = snprintf(line, sizeof line,
                       "{\"pid\": %d, \"launches\": %llu, \"waits\": %llu, \"give_ups\": %llu, "
                       "\"graph_launches\": %llu, \"max_inflight\": %d, \"bound\": %d, "
                       "\"captured_passthrough\": %llu, \"passthrough_reason\": %s}\n",
                       (int)getpid(), (unsigned long long)atomic_load(&g_launches),
                       (unsigned long long)atomic_load(&g_waits),
                       (unsigned long long)atomic_load(&g_give_ups),
                       (unsigned long long)atomic_load(&g_graph_launches),
                       atomic_load(&g_max_inflight),
                       g_control != NULL ? atomic_load(&g_last_bound) : g_bound,
                       (unsigned long long)atomic_load(&g_captured), reason);
    const char *why = "";
    int fd = open_regular(g_stats_path, O_WRONLY | O_CREAT | O_APPEND, 0600, &why);
    if (fd < 0) {
        fprintf(stderr, PREFIX "cannot write GPUSHARE_INFLIGHT_STATS=%.200s: %s\n", g_stats_path,
                why);
        return;
    }
    if (len > 0 && write(fd, line, (size_t)len) != len)
        fprintf(stderr, PREFIX "short write to %.200s\n", g_stats_path);
    close(fd);
}

/* fork: take g_lock so the child inherits consistent slots and pools (never held for long: no
 * wait, launch or record happens under it). */
static void before_fork(void) { pthread_mutex_lock(&g_lock); }
static void after_fork_in_parent(void) { pthread_mutex_unlock(&g_lock); }

/* A forked child cannot use its parent's CUDA context (CUDA is not fork-safe): the child of a
 * process that launched through us passes everything through. A child of a process that never
 * did (Python multiprocessing's fork start, Lightning's ddp_fork: the parent forks before touching
 * CUDA) starts CUDA afresh, so it keeps the bound with fresh slots. Counters start afresh either
 * way, so the child reports only its own launches. */
static void after_fork_in_child(void)
{
    int parent_used_cuda = atomic_load(&g_launches) > 0 || atomic_load(&g_cu.resolved) != 0;
    memset(g_slots, 0, sizeof g_slots);
    g_count = g_nfreelist = g_fresh = g_graphs = g_draining = g_stuck = 0;
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        g_pools[i].ctx = NULL;
        g_pools[i].id = 0;
        g_pools[i].nfree = g_pools[i].created = 0;
    }
    atomic_store(&g_launches, 0);
    atomic_store(&g_waits, 0);
    atomic_store(&g_give_ups, 0);
    atomic_store(&g_graph_launches, 0);
    atomic_store(&g_captured, 0);
    atomic_store(&g_max_inflight, 0);
    if (parent_used_cuda && atomic_exchange(&g_active, 0)) {
        atomic_store(&g_reason_set, 1);
        snprintf(g_reason, sizeof g_reason,
                 "a forked child of a process that used CUDA (CUDA is not fork-safe)");
    }
    /* before_fork took it in the thread that forked, which is the child's only thread. */
    pthread_mutex_unlock(&g_lock);
}

static void read_wait_limit(void)
{
    const char *limit = getenv("GPUSHARE_INFLIGHT_WAIT_LIMIT_MS");
    if (limit == NULL || limit[0] == '\0')
        return;
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

/* GPUSHARE_INFLIGHT_CONTROL: 1 when the mapping is in place. */
static int map_control(void)
{
    const char *control = getenv("GPUSHARE_INFLIGHT_CONTROL");
    if (control == NULL || control[0] == '\0')
        return 0;
    const char *why = "not a file of at least 4 bytes";
    int fd = open_regular(control, O_RDONLY, 0, &why);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < 4) {
        fprintf(stderr,
                PREFIX "GPUSHARE_INFLIGHT_CONTROL=%.200s: %s; the bound comes from "
                       "GPUSHARE_MAX_INFLIGHT alone\n",
                control, why);
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
    return g_control != NULL;
}

__attribute__((constructor)) static void inflight_init(void)
{
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
    const char *stats = getenv("GPUSHARE_INFLIGHT_STATS");
    if (stats != NULL && stats[0] != '\0' && strlen(stats) < sizeof g_stats_path)
        strcpy(g_stats_path, stats);
    read_wait_limit();
    if (map_control()) {
        atomic_store(&g_active, 1);
        return; /* GPUSHARE_MAX_INFLIGHT is not needed, nor read */
    }

    const char *env = getenv("GPUSHARE_MAX_INFLIGHT");
    if (env == NULL || env[0] == '\0') {
        atomic_store(&g_reason_set, 1);
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
        atomic_store(&g_reason_set, 1);
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
