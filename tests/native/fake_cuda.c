/*
 * A fake libcuda.so.1 for tests/native: the documented behaviour of the driver calls the
 * interposer touches, against a fake GPU. "[doc: ...]" names the CUDA driver API documentation
 * (docs.nvidia.com/cuda/cuda-driver-api/) section a behaviour follows.
 *
 * The GPU runs each stream's operations (kernels and event records) in submission order on that
 * stream's own worker thread, so streams run concurrently, as on a real GPU. A kernel "runs" by
 * sleeping: cuLaunchKernel(Cooperative)/Ex take gridDimX as microseconds and gridDimY as a tag;
 * cuGraphLaunch takes its CUgraphExec as a pointer to three unsigned ints {microseconds, tag,
 * kernel nodes} (read at launch; 0 nodes = 1), and runs that many kernels of that length one
 * after another. A kernel launched with gridDimZ = 2 first waits until a kernel with gridDimZ = 3
 * has been launched after it (anywhere in the process): a kernel that depends on a later launch,
 * as one NCCL group over several GPUs of one process does. The fake counts kernels enqueued and
 * not yet done, and the most at once: that, not anything the interposer says, is what the tests
 * check.
 *
 * Contexts [doc: 6.8 Context Management, 6.7 Primary Context Management]: device 0 has a primary
 * context (made current for a thread that has none, as cudart does on a thread's first runtime
 * call); cuCtxCreate makes a new one and pushes it; cuCtxPushCurrent/cuCtxPopCurrent keep a stack
 * per thread; cuCtxDestroy destroys a context (handles are reused: a new context may get the
 * address of a destroyed one, as a real driver's allocator may); cuDevicePrimaryCtxReset destroys
 * the primary context's state ("Destroy all allocations and reset all state on the primary
 * context") and re-initialises it under the same handle. cuCtxGetId gives an id "unique for the
 * life of the program", so a re-created context has a new one; on a destroyed context it fails
 * with CUDA_ERROR_CONTEXT_IS_DESTROYED. The events and streams of a destroyed context are
 * destroyed with it: any later use of such an event is counted (fake_stale_event_uses) and fails
 * with CUDA_ERROR_INVALID_HANDLE, where a real driver may crash.
 *
 * Streams [doc: 3. Stream synchronization behavior]: stream 0 in a legacy call, or
 * CU_STREAM_LEGACY (0x1), is the context's legacy default stream, which "synchronizes with all
 * other streams in the same CUcontext except for non-blocking streams": an operation on it first
 * waits for all earlier work on the context's blocking streams, and work on a blocking stream
 * enqueued after it waits for it. Stream 0 in a _ptsz call, or CU_STREAM_PER_THREAD (0x2), is the
 * calling thread's per-thread default stream in the current context, a blocking stream ("The
 * per-thread default stream is not a non-blocking stream and will synchronize with the legacy
 * default stream if both are used in a program"). cuStreamCreate with CU_STREAM_NON_BLOCKING (0x1)
 * makes a stream that does not synchronise with the legacy stream. Any other handle the tests
 * invent (0x1000 + i) is a blocking stream of the context current when it is first used.
 *
 * Events [doc: 6.19 Event Management]: cuEventRecord captures the stream's work so far and needs
 * the event and the stream in the same context (else CUDA_ERROR_INVALID_HANDLE); cuEventQuery is
 * CUDA_SUCCESS when that work is done (or the event was never recorded), else
 * CUDA_ERROR_NOT_READY; cuEventSynchronize waits for it. An event belongs to the context current
 * when it was created. Captures: fake_set_capturing(stream, 1) marks a stream as being captured
 * in global mode; while any stream is, an event query or wait from a thread whose capture mode is
 * not RELAXED is a prohibited unsafe call: it fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
 * invalidates the capture (as the driver does). Any event record or wait touching a capturing
 * stream is counted as a violation.
 *
 * cuGetProcAddress [doc: 6.29 Driver Entry Point Access]: an unknown symbol is CUDA_SUCCESS with
 * *pfn NULL and symbolStatus CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND; the per-thread flag returns the
 * _ptsz variant where there is one. cuGetProcAddress_v2_ptsz is what cuda.h names
 * cuGetProcAddress in a per-thread-default-stream compilation unit: here its
 * CU_GET_PROC_ADDRESS_DEFAULT means per-thread variants (that unit's default; not documented
 * beyond the name mapping, so an assumption).
 *
 * Test hooks: the fake_* functions. FAKE_CUDA_FAIL_EVENT_CREATE=1 makes cuEventCreate fail.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct fake_ctx *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef uint64_t cuuint64_t;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct fake_event {
    int stream;                /* index into streams[] of the last record; -1 = never recorded */
    unsigned long long target; /* that stream's op count at the record */
    unsigned int flags;
    CUcontext ctx;
    int dead; /* its context was destroyed */
} *CUevent;

struct fake_ctx {
    unsigned long long id; /* cuCtxGetId; 0 while destroyed */
    int in_use;
};

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define PER_THREAD_FLAG 2ull
#define LEGACY_FLAG 1ull
#define MODE_RELAXED 2
#define STREAM_LEGACY ((CUstream)0x1)     /* cuda.h: CU_STREAM_LEGACY */
#define STREAM_PER_THREAD ((CUstream)0x2) /* cuda.h: CU_STREAM_PER_THREAD */
#define NON_BLOCKING 0x1u                 /* cuda.h: CU_STREAM_NON_BLOCKING */
#define MAX_OPS 4096                      /* per stream */
#define MAX_STREAMS 64
#define MAX_CTX 8
#define MAX_EVENTS 4096
#define MAX_LOG 65536
#define CTX_STACK 16

typedef struct {
    int is_kernel, log;
    unsigned us, tag;
    unsigned long long seq;           /* global submission order (legacy-stream semantics) */
    unsigned long long needs_release; /* gridDimZ = 2: wait until releases >= this */
} op_t;

typedef struct {
    uintptr_t id;
    CUcontext ctx;
    int legacy, nonblocking, dead;
    op_t ops[MAX_OPS];
    int head, count;
    unsigned long long submitted, done; /* ops */
    pthread_cond_t work;
    pthread_t worker;
} stream_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static stream_t streams[MAX_STREAMS];
static int n_streams;
static struct fake_ctx ctxs[MAX_CTX]; /* ctxs[0]: device 0's primary context */
static unsigned long long next_ctx_id = 1;
static CUevent events[MAX_EVENTS];
static int n_events;
static int inflight, max_inflight;
static long kernels_done;
static unsigned long long next_seq;
static uintptr_t log_stream[MAX_LOG];
static unsigned log_tag[MAX_LOG];
static int log_n;
static uintptr_t capturing[16];
static int n_capturing, capture_invalidated, capture_violations, events_created, events_timed;
static int stale_event_uses;
static long calls_legacy, calls_ptsz;
static __thread int thread_mode; /* CUstreamCaptureMode of this thread; 0 = GLOBAL */
static __thread CUcontext ctx_stack[CTX_STACK];
static __thread int ctx_depth;
static __thread uintptr_t thread_no; /* 0 until this thread's per-thread stream is first used */
static uintptr_t next_thread_no = 1;
static unsigned long long releases; /* kernels launched with gridDimZ = 3 */

/* Whether op (at the head of st) may start: legacy-stream semantics (mu held). */
static int deps_done(const stream_t *st, const op_t *op)
{
    if (st->nonblocking)
        return 1;
    for (int j = 0; j < n_streams; j++) {
        const stream_t *o = &streams[j];
        if (o == st || o->ctx != st->ctx || o->nonblocking || o->count == 0)
            continue;
        /* The legacy stream waits for every blocking stream; a blocking stream for the legacy. */
        if ((st->legacy || o->legacy) && o->ops[o->head].seq < op->seq)
            return 0;
    }
    return 1;
}

static void *gpu(void *arg)
{
    stream_t *st = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (st->count == 0 || !deps_done(st, &st->ops[st->head]))
            pthread_cond_wait(st->count == 0 ? &st->work : &cv_done, &mu);
        op_t op = st->ops[st->head];
        if (op.is_kernel) {
            while (releases < op.needs_release)
                pthread_cond_wait(&cv_done, &mu);
            pthread_mutex_unlock(&mu);
            struct timespec ts = {op.us / 1000000, (long)(op.us % 1000000) * 1000};
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&mu);
            inflight--;
            kernels_done++;
            if (op.log && log_n < MAX_LOG) {
                log_stream[log_n] = st->id;
                log_tag[log_n] = op.tag;
                log_n++;
            }
        }
        st->head = (st->head + 1) % MAX_OPS;
        st->count--;
        st->done++;
        pthread_cond_broadcast(&cv_done);
    }
    return NULL;
}

/* This thread's current context: the top of its stack, else the primary one (mu not needed:
 * the stack is the thread's own and ctxs[0] is never freed). */
static CUcontext current(void)
{
    if (ctx_depth > 0)
        return ctx_stack[ctx_depth - 1];
    if (__atomic_load_n(&ctxs[0].id, __ATOMIC_ACQUIRE) == 0) { /* first use: initialise it */
        unsigned long long want = 0, id = __atomic_fetch_add(&next_ctx_id, 1, __ATOMIC_RELAXED);
        __atomic_compare_exchange_n(&ctxs[0].id, &want, id, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
        ctxs[0].in_use = 1;
    }
    return &ctxs[0];
}

/* The stream with this id, its worker started on first use (mu held). */
static int stream_index(uintptr_t id, CUcontext ctx, int legacy)
{
    for (int i = 0; i < n_streams; i++)
        if (streams[i].id == id && !streams[i].dead)
            return i;
    if (n_streams == MAX_STREAMS)
        abort();
    stream_t *st = &streams[n_streams];
    st->id = id;
    st->ctx = ctx;
    st->legacy = legacy;
    pthread_cond_init(&st->work, NULL);
    pthread_create(&st->worker, NULL, gpu, st);
    return n_streams++;
}

/* The stream a call means: legacy and per-thread default streams are per context (and thread);
 * a handle the fake has not seen is a blocking stream of the current context. */
static int resolve_stream(CUstream s, int ptsz)
{
    CUcontext ctx = current();
    uintptr_t ctx_no = (uintptr_t)(ctx - ctxs);
    if ((s == NULL && ptsz) || s == STREAM_PER_THREAD) {
        if (thread_no == 0)
            thread_no = __atomic_fetch_add(&next_thread_no, 1, __ATOMIC_RELAXED);
        return stream_index(0x100000 + thread_no * MAX_CTX + ctx_no, ctx, 0);
    }
    if (s == NULL || s == STREAM_LEGACY)
        return stream_index(0x10 + ctx_no, ctx, 1);
    return stream_index((uintptr_t)s, ctx, 0);
}

static int is_capturing(uintptr_t id)
{
    for (int i = 0; i < n_capturing; i++)
        if (capturing[i] == id)
            return 1;
    return 0;
}

/* Enqueue on stream i; returns its op count after this op (mu held). */
static unsigned long long enqueue(int i, int is_kernel, unsigned us, unsigned tag, unsigned z,
                                  int log)
{
    stream_t *st = &streams[i];
    while (st->count == MAX_OPS)
        pthread_cond_wait(&cv_done, &mu);
    st->ops[(st->head + st->count) % MAX_OPS] =
        (op_t){is_kernel, log, us, tag, next_seq++, z == 2 ? releases + 1 : 0};
    if (z == 3) {
        releases++;
        pthread_cond_broadcast(&cv_done);
    }
    st->count++;
    st->submitted++;
    if (is_kernel) {
        inflight++;
        if (inflight > max_inflight)
            max_inflight = inflight;
    }
    pthread_cond_signal(&st->work);
    pthread_cond_broadcast(&cv_done); /* a legacy op may now hold others back, or free them */
    return st->submitted;
}

static CUresult launch_n(int ptsz, CUstream s, unsigned us, unsigned tag, unsigned z, unsigned n)
{
    __atomic_fetch_add(ptsz ? &calls_ptsz : &calls_legacy, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&mu);
    int i = resolve_stream(s, ptsz);
    for (unsigned k = 0; k < n; k++)
        enqueue(i, 1, us, tag, z, k + 1 == n);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static CUresult launch(int ptsz, CUstream s, unsigned us, unsigned tag, unsigned z)
{
    return launch_n(ptsz, s, us, tag, z, 1);
}

/* ---- driver API ---- */

CUresult cuInit(unsigned int flags)
{
    (void)flags;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *v)
{
    *v = 12040;
    return CUDA_SUCCESS;
}

/* [doc: 6.8] "Returns in *pctx the CUDA context bound to the calling CPU thread." */
CUresult cuCtxGetCurrent(CUcontext *c)
{
    *c = current();
    return CUDA_SUCCESS;
}

/* [doc: 6.8] "Pushes the given context ctx onto the CPU thread's stack of current contexts." */
CUresult cuCtxPushCurrent_v2(CUcontext c)
{
    if (c == NULL || c->id == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth == CTX_STACK)
        abort();
    ctx_stack[ctx_depth++] = c;
    return CUDA_SUCCESS;
}

/* [doc: 6.8] "Pops the current CUDA context from the CPU thread and passes back the old context
 * handle in *pctx." */
CUresult cuCtxPopCurrent_v2(CUcontext *c)
{
    if (ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext top = ctx_stack[--ctx_depth];
    if (c != NULL)
        *c = top;
    return CUDA_SUCCESS;
}

/* [doc: 6.8] cuCtxCreate: "creates a new CUDA context and associates it with the calling thread
 * ... The context is created with a usage count of 1 ... pushed onto the thread's stack".
 * Handles are reused: the first free entry, as an allocator may hand back a destroyed one's. */
CUresult cuCtxCreate_v2(CUcontext *c, unsigned int flags, CUdevice dev)
{
    (void)flags, (void)dev;
    pthread_mutex_lock(&mu);
    int i = 1;
    while (i < MAX_CTX && ctxs[i].in_use)
        i++;
    if (i == MAX_CTX) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ctxs[i].in_use = 1;
    __atomic_store_n(&ctxs[i].id, __atomic_fetch_add(&next_ctx_id, 1, __ATOMIC_RELAXED),
                     __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    *c = &ctxs[i];
    return cuCtxPushCurrent_v2(*c);
}

/* The context's events and streams go with it (mu held); waits for its queued work first. */
static void destroy_context_state(CUcontext c)
{
    for (int i = 0; i < n_streams; i++)
        if (streams[i].ctx == c && !streams[i].dead)
            while (streams[i].count > 0)
                pthread_cond_wait(&cv_done, &mu);
    for (int i = 0; i < n_streams; i++)
        if (streams[i].ctx == c)
            streams[i].dead = 1;
    for (int i = 0; i < n_events; i++)
        if (events[i]->ctx == c)
            events[i]->dead = 1;
}

/* [doc: 6.8] cuCtxDestroy: "Destroys the CUDA context specified by ctx ... If ctx is current to
 * the calling thread then ctx will also be popped from the current thread's context stack". */
CUresult cuCtxDestroy_v2(CUcontext c)
{
    if (c == NULL || c == &ctxs[0] || c->id == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    destroy_context_state(c);
    __atomic_store_n(&c->id, 0, __ATOMIC_RELEASE);
    c->in_use = 0;
    pthread_mutex_unlock(&mu);
    if (ctx_depth > 0 && ctx_stack[ctx_depth - 1] == c)
        ctx_depth--;
    return CUDA_SUCCESS;
}

/* [doc: 6.7] cuDevicePrimaryCtxRetain: the primary context, initialised if it was not. */
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice dev)
{
    (void)dev;
    ctx_depth = 0;
    *c = current();
    return CUDA_SUCCESS;
}

/* [doc: 6.7] cuDevicePrimaryCtxReset: "Destroy all allocations and reset all state on the
 * primary context". Re-initialised under the same handle, as a new context (a new id). */
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    (void)dev;
    pthread_mutex_lock(&mu);
    destroy_context_state(&ctxs[0]);
    __atomic_store_n(&ctxs[0].id, __atomic_fetch_add(&next_ctx_id, 1, __ATOMIC_RELAXED),
                     __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* [doc: 6.8] cuCtxGetId: "Returns in ctxId the unique Id which is associated with a given
 * context. The Id is unique for the life of the program for this instance of CUDA. If context is
 * supplied as NULL and there is one current, the Id of the current context is returned." */
CUresult cuCtxGetId(CUcontext c, unsigned long long *id)
{
    if (id == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (c == NULL)
        c = current();
    unsigned long long v = __atomic_load_n(&c->id, __ATOMIC_ACQUIRE);
    if (v == 0)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *id = v;
    return CUDA_SUCCESS;
}

/* [doc: 6.18 Stream Management] cuStreamCreate: a stream of the current context; flags
 * CU_STREAM_NON_BLOCKING: "may run concurrently with work in stream 0 (the NULL stream), and ...
 * should perform no implicit synchronization with stream 0". */
CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    static uintptr_t next = 0x5000;
    pthread_mutex_lock(&mu);
    uintptr_t id = next++;
    int i = stream_index(id, current(), 0);
    streams[i].nonblocking = (flags & NON_BLOCKING) != 0;
    pthread_mutex_unlock(&mu);
    *s = (CUstream)id;
    return CUDA_SUCCESS;
}

/* [doc: 6.18] cuStreamGetCtx: the stream's context; for the NULL stream, CU_STREAM_LEGACY or
 * CU_STREAM_PER_THREAD, the current one. */
static CUresult stream_get_ctx(CUstream s, CUcontext *c, int ptsz)
{
    pthread_mutex_lock(&mu);
    int i = resolve_stream(s, ptsz);
    *c = streams[i].ctx;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream s, CUcontext *c) { return stream_get_ctx(s, c, 0); }
CUresult cuStreamGetCtx_ptsz(CUstream s, CUcontext *c) { return stream_get_ctx(s, c, 1); }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned sh, CUstream s, void **p, void **e)
{
    (void)f, (void)bx, (void)by, (void)bz, (void)sh, (void)p, (void)e;
    return launch(0, s, gx, gy, gz);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned sh, CUstream s, void **p, void **e)
{
    (void)f, (void)bx, (void)by, (void)bz, (void)sh, (void)p, (void)e;
    return launch(1, s, gx, gy, gz);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    (void)f, (void)p, (void)e;
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(0, c->hStream, c->gridDimX, c->gridDimY, c->gridDimZ);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    (void)f, (void)p, (void)e;
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(1, c->hStream, c->gridDimX, c->gridDimY, c->gridDimZ);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                   unsigned bx, unsigned by, unsigned bz, unsigned sh, CUstream s,
                                   void **p)
{
    (void)f, (void)bx, (void)by, (void)bz, (void)sh, (void)p;
    return launch(0, s, gx, gy, gz);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                        unsigned bx, unsigned by, unsigned bz, unsigned sh,
                                        CUstream s, void **p)
{
    (void)f, (void)bx, (void)by, (void)bz, (void)sh, (void)p;
    return launch(1, s, gx, gy, gz);
}

static CUresult graph_launch(int ptsz, CUgraphExec g, CUstream s)
{
    const unsigned *spec = (const unsigned *)g;
    return launch_n(ptsz, s, spec[0], spec[1], 1, spec[2] > 0 ? spec[2] : 1);
}

CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return graph_launch(0, g, s); }
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return graph_launch(1, g, s); }

/* [doc: 6.19] cuEventCreate: an event of the current context. */
CUresult cuEventCreate(CUevent *ev, unsigned int flags)
{
    const char *fail = getenv("FAKE_CUDA_FAIL_EVENT_CREATE");
    if (fail != NULL && fail[0] == '1')
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUevent e = calloc(1, sizeof *e);
    e->stream = -1;
    e->flags = flags;
    e->ctx = current();
    pthread_mutex_lock(&mu);
    if (n_events == MAX_EVENTS)
        abort();
    events[n_events++] = e; /* kept to the end: a stale handle stays readable, and counted */
    pthread_mutex_unlock(&mu);
    __atomic_fetch_add(&events_created, 1, __ATOMIC_RELAXED);
    if (!(flags & 0x2u)) /* CU_EVENT_DISABLE_TIMING */
        __atomic_fetch_add(&events_timed, 1, __ATOMIC_RELAXED);
    *ev = e;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent ev)
{
    pthread_mutex_lock(&mu);
    if (ev->dead)
        stale_event_uses++;
    ev->dead = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* A use of an event whose context is gone (mu held). */
static int stale(CUevent ev)
{
    if (!ev->dead)
        return 0;
    stale_event_uses++;
    return 1;
}

/* [doc: 6.19] cuEventRecord: "hEvent and hStream must be from the same context otherwise
 * CUDA_ERROR_INVALID_HANDLE is returned." */
static CUresult event_record(CUevent ev, CUstream s, int ptsz)
{
    pthread_mutex_lock(&mu);
    int i = resolve_stream(s, ptsz);
    CUresult rc = CUDA_SUCCESS;
    if (stale(ev) || streams[i].ctx != ev->ctx) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        if (is_capturing(streams[i].id))
            capture_violations++;
        ev->target = enqueue(i, 0, 0, 0, 0, 0);
        ev->stream = i;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuEventRecord(CUevent ev, CUstream s) { return event_record(ev, s, 0); }
CUresult cuEventRecord_ptsz(CUevent ev, CUstream s) { return event_record(ev, s, 1); }

/* Unsafe during another global-mode capture unless this thread is RELAXED (mu held). */
static int prohibited(void)
{
    if (n_capturing > 0 && thread_mode != MODE_RELAXED) {
        capture_invalidated = 1;
        return 1;
    }
    return 0;
}

CUresult cuEventQuery(CUevent ev)
{
    pthread_mutex_lock(&mu);
    CUresult rc = stale(ev)       ? CUDA_ERROR_INVALID_HANDLE
                  : prohibited() ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                  : ev->stream < 0 || streams[ev->stream].done >= ev->target ? CUDA_SUCCESS
                                                                             : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuEventSynchronize(CUevent ev)
{
    pthread_mutex_lock(&mu);
    if (stale(ev) || prohibited()) {
        pthread_mutex_unlock(&mu);
        return ev->dead ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    while (ev->stream >= 0 && streams[ev->stream].done < ev->target)
        pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static CUresult is_capturing_api(CUstream s, int *status, int ptsz)
{
    pthread_mutex_lock(&mu);
    *status = is_capturing(streams[resolve_stream(s, ptsz)].id) ? 1 : 0;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream s, int *status) { return is_capturing_api(s, status, 0); }
CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status)
{
    return is_capturing_api(s, status, 1);
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    int old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress ---- */

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status);
CUresult cuGetProcAddress_v2_ptsz(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                  int *status);
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags);

static const struct {
    const char *name;
    void *legacy, *ptsz;
} procs[] = {
    {"cuInit", (void *)cuInit, NULL},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion, NULL},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent, NULL},
    {"cuCtxGetId", (void *)cuCtxGetId, NULL},
    {"cuStreamGetCtx", (void *)cuStreamGetCtx, (void *)cuStreamGetCtx_ptsz},
    {"cuLaunchKernel", (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx, (void *)cuLaunchKernelEx_ptsz},
    {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel,
     (void *)cuLaunchCooperativeKernel_ptsz},
    {"cuGraphLaunch", (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz},
    {"cuEventCreate", (void *)cuEventCreate, NULL},
    {"cuEventRecord", (void *)cuEventRecord, (void *)cuEventRecord_ptsz},
    {"cuEventQuery", (void *)cuEventQuery, NULL},
    {"cuEventSynchronize", (void *)cuEventSynchronize, NULL},
    {"cuStreamIsCapturing", (void *)cuStreamIsCapturing, (void *)cuStreamIsCapturing_ptsz},
};

static CUresult gpa(const char *sym, void **pfn, int ver, int per_thread, int *status)
{
    if (sym == NULL || pfn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(sym, "cuGetProcAddress") == 0) {
        *pfn = ver < 12000    ? (void *)cuGetProcAddress
               : per_thread ? (void *)cuGetProcAddress_v2_ptsz
                            : (void *)cuGetProcAddress_v2;
    } else {
        for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
            if (strcmp(procs[i].name, sym) == 0) {
                *pfn = per_thread && procs[i].ptsz ? procs[i].ptsz : procs[i].legacy;
                break;
            }
        }
    }
    if (status != NULL)
        *status = *pfn != NULL ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status)
{
    return gpa(sym, pfn, ver, (flags & PER_THREAD_FLAG) != 0, status);
}

CUresult cuGetProcAddress_v2_ptsz(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                  int *status)
{
    return gpa(sym, pfn, ver, (flags & PER_THREAD_FLAG) || !(flags & LEGACY_FLAG), status);
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    return gpa(sym, pfn, ver, (flags & PER_THREAD_FLAG) != 0, NULL);
}

/* ---- test hooks ---- */

int fake_max_inflight(void) { return max_inflight; }

/* Start counting the most kernels in flight afresh (from what is in flight now). */
void fake_reset_max(void)
{
    pthread_mutex_lock(&mu);
    max_inflight = inflight;
    pthread_mutex_unlock(&mu);
}
long fake_kernels_done(void) { return kernels_done; }
int fake_events_created(void) { return events_created; }
int fake_events_timed(void) { return events_timed; }
int fake_capture_violations(void) { return capture_violations; }
int fake_capture_invalidated(void) { return capture_invalidated; }
int fake_stale_event_uses(void) { return stale_event_uses; }
long fake_calls_legacy(void) { return calls_legacy; }
long fake_calls_ptsz(void) { return calls_ptsz; }

void fake_set_capturing(void *stream, int on)
{
    pthread_mutex_lock(&mu);
    uintptr_t id = (uintptr_t)stream;
    if (on && n_capturing < 16) {
        capturing[n_capturing++] = id;
    } else if (!on) {
        for (int i = 0; i < n_capturing; i++)
            if (capturing[i] == id)
                capturing[i] = capturing[--n_capturing];
    }
    pthread_mutex_unlock(&mu);
}

/* Wait until the fake GPU is idle. */
void fake_wait_idle(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_streams; i++)
        while (streams[i].count > 0)
            pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
}

/* Execution log: kernel i ran on stream streams[i] with tag tags[i]; returns the count. */
int fake_log(uintptr_t *streams_out, unsigned *tags, int cap)
{
    pthread_mutex_lock(&mu);
    int n = log_n < cap ? log_n : cap;
    memcpy(streams_out, log_stream, (size_t)n * sizeof *streams_out);
    memcpy(tags, log_tag, (size_t)n * sizeof *tags);
    pthread_mutex_unlock(&mu);
    return n;
}
