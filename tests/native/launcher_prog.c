/*
 * Drives the fake libcuda (fake_cuda.c) the ways real programs reach the driver, then prints what
 * the fake GPU saw as one JSON line. Usage:
 *   launcher_prog REACH API N US [STREAMS [THREADS [CAPTURE [SWITCH]]]]
 * REACH: direct (linked symbols) | gpa (linked cuGetProcAddress_v2) | gpa-ptsz (linked
 *   cuGetProcAddress_v2_ptsz, default flags: the per-thread variants) | gpa-self
 *   (cuGetProcAddress fetched through itself) | dlsym-gpa (dlopen + dlsym(handle,
 *   "cuGetProcAddress_v2"), as cudart does) | dlsym-gpa-v1 (the CUDA 11 four-argument
 *   cuGetProcAddress) | dlsym (dlsym(handle, "cuLaunchKernel"), as ctypes does) | ptsz (dlsym-gpa
 *   with the per-thread-default-stream flag, stream 0) | rtld-next (dlsym(RTLD_NEXT, ...) from
 *   this program).
 * API: kernel | ex | coop | graph (LAUNCHER_GRAPH_NODES kernels each, default 1) | pair
 *   (cuLaunchKernel alternating, over two streams, a kernel that waits for the next launch
 *   (gridDimZ 2) and that launch (gridDimZ 3)) | slowfirst (launch 0 runs 300 ms on one stream,
 *   the rest on another) | stuck (launch 0 runs 600 ms, the rest US on the same stream) |
 *   twoctx (two created contexts, a created stream in each, launched from the primary context) |
 *   legacy (three launches: 30 ms on a stream, 1 ms on the legacy default stream, 1 ms on another
 *   stream) | cancel (a thread's second launch waits for its 300 ms first; the main thread
 *   cancels it, then launches) | longjmp (a launch waiting behind a 300 ms kernel is left by
 *   siglongjmp from SIGALRM; then one more launch).
 * N launches of US microseconds per thread, round-robin over STREAMS streams per thread.
 * CAPTURE: none | same (the launch streams are being captured) | other (another stream is being
 * captured while these launch). SWITCH (optional): after half the launches (one thread) wait
 * until the GPU is idle, then PATH:VALUE writes VALUE as a 4-byte little-endian int at offset 0
 * of PATH in place (GPUSHARE_INFLIGHT_CONTROL), "reset" resets the primary context
 * (cuDevicePrimaryCtxReset), "recreate" destroys the current created context and creates
 * another (which gets its handle), "-" does nothing; then the most kernels in flight are counted
 * afresh; max_inflight_before_switch is the first half's.
 * Environment: LAUNCHER_FORK=1 forks first and runs everything in the child (which exits with
 * _exit, as Python's fork children do), the parent never touching CUDA; LAUNCHER_PLUGIN=path
 * dlopens that library RTLD_LOCAL and reports whether its plugin_lookup() found its dependency.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUcontext;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
typedef CUresult (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
typedef CUresult (*ex_fn)(const CUlaunchConfig *, void *, void **, void **);
typedef CUresult (*coop_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void **);
typedef CUresult (*graph_fn)(void *, CUstream);
typedef CUresult (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*gpa1_fn)(const char *, void **, int, unsigned long long);

/* The fake libcuda, linked. */
CUresult cuInit(unsigned);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, void *, void **, void **);
CUresult cuLaunchCooperativeKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void **);
CUresult cuGraphLaunch(void *, CUstream);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuGetProcAddress_v2_ptsz(const char *, void **, int, unsigned long long, int *);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuDevicePrimaryCtxReset_v2(int);
CUresult cuStreamCreate(CUstream *, unsigned);
int fake_max_inflight(void);
long fake_kernels_done(void);
int fake_events_created(void);
int fake_events_timed(void);
int fake_capture_violations(void);
int fake_capture_invalidated(void);
int fake_stale_event_uses(void);
long fake_calls_legacy(void);
long fake_calls_ptsz(void);
void fake_set_capturing(void *, int);
void fake_wait_idle(void);
void fake_reset_max(void);
int fake_log(uintptr_t *, unsigned *, int);

static const char *reach, *api;
static int n, us, nstreams = 1, nthreads = 1;
static int total;    /* tags are 0 .. total - 1 */
static int expected; /* kernels that should run (each tag at most once) */
static void *fn; /* the launch entry point as REACH found it */
static int ptsz;
static long errors;
static unsigned (*graph_specs)[3];
static unsigned graph_nodes = 1;
static const char *switch_spec;
static int max_before_switch = -1;
static CUcontext created_ctx;
static CUstream ctx_streams[2];
static int jumped = -1;

static int is(const char *a, const char *b) { return strcmp(a, b) == 0; }

/* SWITCH: the daemon's side of GPUSHARE_INFLIGHT_CONTROL, or a context reset, mid-run. */
static void do_switch(void)
{
    fake_wait_idle();
    max_before_switch = fake_max_inflight();
    if (is(switch_spec, "reset")) {
        cuDevicePrimaryCtxReset_v2(0);
    } else if (is(switch_spec, "recreate")) {
        cuCtxDestroy_v2(created_ctx);
        cuCtxCreate_v2(&created_ctx, 0, 0);
    } else if (!is(switch_spec, "-")) {
        char path[4096];
        const char *colon = strrchr(switch_spec, ':');
        if (colon == NULL || (size_t)(colon - switch_spec) >= sizeof path) {
            fprintf(stderr, "SWITCH is PATH:VALUE, reset, recreate or -\n");
            exit(2);
        }
        memcpy(path, switch_spec, (size_t)(colon - switch_spec));
        path[colon - switch_spec] = '\0';
        int32_t v = (int32_t)atoi(colon + 1);
        unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8),
                               (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
        int fd = open(path, O_WRONLY);
        if (fd < 0 || pwrite(fd, le, 4, 0) != 4) {
            perror(path);
            exit(2);
        }
        close(fd);
    }
    fake_reset_max();
}

static const char *api_symbol(void)
{
    if (is(api, "ex"))
        return "cuLaunchKernelEx";
    if (is(api, "coop"))
        return "cuLaunchCooperativeKernel";
    if (is(api, "graph"))
        return "cuGraphLaunch";
    return "cuLaunchKernel";
}

static void *direct_symbol(void)
{
    if (is(api, "ex"))
        return (void *)cuLaunchKernelEx;
    if (is(api, "coop"))
        return (void *)cuLaunchCooperativeKernel;
    if (is(api, "graph"))
        return (void *)cuGraphLaunch;
    return (void *)cuLaunchKernel;
}

static void find_launch(void)
{
    const char *sym = api_symbol();
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (is(reach, "direct")) {
        fn = direct_symbol();
    } else if (is(reach, "gpa")) {
        cuGetProcAddress_v2(sym, &fn, 12040, 0, NULL);
    } else if (is(reach, "gpa-ptsz")) {
        ptsz = 1;
        cuGetProcAddress_v2_ptsz(sym, &fn, 12040, 0, NULL);
    } else if (is(reach, "gpa-self")) {
        void *gpa = NULL;
        cuGetProcAddress_v2("cuGetProcAddress", &gpa, 12040, 0, NULL);
        ((gpa2_fn)gpa)(sym, &fn, 12040, 0, NULL);
    } else if (is(reach, "dlsym-gpa") || is(reach, "ptsz")) {
        gpa2_fn gpa = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
        ptsz = is(reach, "ptsz");
        gpa(sym, &fn, 12040, ptsz ? 2ull : 0ull, NULL);
    } else if (is(reach, "dlsym-gpa-v1")) {
        gpa1_fn gpa = (gpa1_fn)dlsym(lib, "cuGetProcAddress");
        gpa(sym, &fn, 11080, 0);
    } else if (is(reach, "dlsym")) {
        fn = dlsym(lib, sym);
    } else if (is(reach, "rtld-next")) {
        fn = dlsym(RTLD_NEXT, sym);
    } else {
        fprintf(stderr, "unknown REACH %s\n", reach);
        exit(2);
    }
    if (fn == NULL) {
        fprintf(stderr, "no entry point for %s via %s\n", sym, reach);
        exit(2);
    }
}

static CUresult launch_us(CUstream s, unsigned tag, unsigned len)
{
    if (is(api, "ex")) {
        CUlaunchConfig c = {len, tag, 1, 1, 1, 1, 0, s, NULL, 0};
        return ((ex_fn)fn)(&c, NULL, NULL, NULL);
    }
    if (is(api, "coop"))
        return ((coop_fn)fn)(NULL, len, tag, 1, 1, 1, 1, 0, s, NULL);
    if (is(api, "graph")) {
        graph_specs[tag][0] = len;
        graph_specs[tag][1] = tag;
        graph_specs[tag][2] = graph_nodes;
        return ((graph_fn)fn)(graph_specs[tag], s);
    }
    unsigned z = is(api, "pair") ? 2 + tag % 2 : 1;
    return ((launch_fn)fn)(NULL, len, tag, z, 1, 1, 1, 0, s, NULL, NULL);
}

static void launch_counted(CUstream s, unsigned tag, unsigned len)
{
    if (launch_us(s, tag, len) != 0)
        __atomic_fetch_add(&errors, 1, __ATOMIC_RELAXED);
}

static CUstream stream_of(int t, int i)
{
    if (ptsz)
        return NULL; /* the thread's per-thread default stream */
    if (is(api, "twoctx"))
        return ctx_streams[i % 2];
    if (is(api, "slowfirst"))
        return (CUstream)(uintptr_t)(i == 0 ? 0x1000 : 0x1001);
    if (is(api, "pair"))
        return (CUstream)(uintptr_t)(0x1000 + t * 2 + i % 2);
    return (CUstream)(uintptr_t)(0x1000 + t * nstreams + i % nstreams);
}

static unsigned length_of(int i)
{
    if (i == 0 && is(api, "slowfirst"))
        return 300000;
    if (i == 0 && is(api, "stuck"))
        return 600000;
    return (unsigned)us;
}

static void *run(void *arg)
{
    int t = (int)(intptr_t)arg;
    if (created_ctx != NULL)
        cuCtxPushCurrent_v2(created_ctx); /* contexts are current per thread */
    for (int i = 0; i < n; i++) {
        if (switch_spec != NULL && t == 0 && i == n / 2)
            do_switch();
        launch_counted(stream_of(t, i), (unsigned)(t * n + i), length_of(i));
    }
    return NULL;
}

/* ---- scenarios that are not a loop of launches ---- */

static void *cancel_target(void *arg)
{
    (void)arg;
    launch_counted((CUstream)0x1000, 0, 300000);
    launch_counted((CUstream)0x1000, 1, (unsigned)us); /* waits (k = 1) for the first */
    return NULL;
}

static void scenario_cancel(void)
{
    pthread_t th;
    pthread_create(&th, NULL, cancel_target, NULL);
    struct timespec wait = {0, 50000000};
    nanosleep(&wait, NULL);
    pthread_cancel(th);
    pthread_join(th, NULL);
    launch_counted((CUstream)0x1000, 2, (unsigned)us);
    total = expected = 3;
}

static sigjmp_buf jump_back;
static void on_alarm(int sig)
{
    (void)sig;
    siglongjmp(jump_back, 1);
}

static void scenario_longjmp(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, NULL);
    launch_counted((CUstream)0x1000, 0, 300000);
    struct itimerval it = {{0, 0}, {0, 50000}};
    jumped = 1;
    if (sigsetjmp(jump_back, 1) == 0) {
        setitimer(ITIMER_REAL, &it, NULL);
        launch_counted((CUstream)0x1000, 1, (unsigned)us); /* waits (k = 1) for the first */
        jumped = 0;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    launch_counted((CUstream)0x1000, 2, (unsigned)us);
    total = 3;
    expected = jumped ? 2 : 3;
}

static void scenario_legacy(void)
{
    launch_counted((CUstream)0x1000, 0, 30000);
    launch_counted(NULL, 1, 1000); /* the legacy default stream */
    launch_counted((CUstream)0x1001, 2, 1000);
    total = expected = 3;
}

static void make_context_streams(void)
{
    for (int c = 0; c < 2; c++) {
        CUcontext ctx, popped;
        cuCtxCreate_v2(&ctx, 0, 0);
        cuStreamCreate(&ctx_streams[c], 0);
        cuCtxPopCurrent_v2(&popped);
    }
}

/* ---- report ---- */

static void report(long long launch_ns)
{
    /* Every kernel ran once, and in launch order on each stream. */
    uintptr_t *ls = calloc((size_t)total + 1, sizeof *ls);
    unsigned *lt = calloc((size_t)total + 1, sizeof *lt);
    int got = fake_log(ls, lt, total + 1);
    int order_ok = got == expected;
    char *seen = calloc((size_t)total, 1);
    for (int i = 0; i < got && order_ok; i++) {
        if (lt[i] >= (unsigned)total || seen[lt[i]])
            order_ok = 0;
        else
            seen[lt[i]] = 1;
        for (int j = i + 1; j < got && order_ok; j++)
            if (ls[j] == ls[i] && lt[j] < lt[i])
                order_ok = 0;
    }
    char tags[400] = "";
    for (int i = 0, off = 0; i < got && got <= 64 && off < 380; i++)
        off += snprintf(tags + off, sizeof tags - (size_t)off, "%s%u", i ? ", " : "", lt[i]);
    int (*lookups)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "next_interposer_lookups");
    int plugin_found = -1;
    const char *plugin = getenv("LAUNCHER_PLUGIN");
    if (plugin != NULL) {
        void *h = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
        void *(*lookup)(void) = h != NULL ? (void *(*)(void))dlsym(h, "plugin_lookup") : NULL;
        plugin_found = lookup != NULL && lookup() != NULL;
    }
    printf("{\"max_inflight\": %d, \"kernels_done\": %ld, \"expected\": %d, \"order_ok\": %s, "
           "\"events_created\": %d, \"events_timed\": %d, \"capture_violations\": %d, "
           "\"capture_invalidated\": %d, \"stale_event_uses\": %d, \"calls_legacy\": %ld, "
           "\"calls_ptsz\": %ld, \"launch_errors\": %ld, \"launch_loop_ns\": %lld, "
           "\"max_inflight_before_switch\": %d, \"last_tag\": %d, \"tags\": [%s], "
           "\"next_interposer_lookups\": %d, \"plugin_found\": %d, \"jumped\": %d}\n",
           fake_max_inflight(), fake_kernels_done(), expected, order_ok ? "true" : "false",
           fake_events_created(), fake_events_timed(), fake_capture_violations(),
           fake_capture_invalidated(), fake_stale_event_uses(), fake_calls_legacy(),
           fake_calls_ptsz(), errors, launch_ns, max_before_switch,
           got > 0 ? (int)lt[got - 1] : -1, tags, lookups != NULL ? lookups() : -1, plugin_found,
           jumped);
    fflush(stdout);
}

/* LAUNCHER_FORK=1: the parent only waits; returns in the child. */
static void maybe_fork(void)
{
    const char *f = getenv("LAUNCHER_FORK");
    if (f == NULL || !is(f, "1"))
        return;
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(2);
    }
    if (pid == 0)
        return;
    int st = 0;
    waitpid(pid, &st, 0);
    exit(WIFEXITED(st) ? WEXITSTATUS(st) : 3);
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s REACH API N US [STREAMS [THREADS [CAPTURE [SWITCH]]]]\n",
                argv[0]);
        return 2;
    }
    reach = argv[1];
    api = argv[2];
    n = atoi(argv[3]);
    us = atoi(argv[4]);
    if (argc > 5)
        nstreams = atoi(argv[5]);
    if (argc > 6)
        nthreads = atoi(argv[6]);
    const char *capture = argc > 7 ? argv[7] : "none";
    switch_spec = argc > 8 ? argv[8] : NULL;
    const char *nodes = getenv("LAUNCHER_GRAPH_NODES");
    if (nodes != NULL)
        graph_nodes = (unsigned)atoi(nodes);
    if (nthreads < 1 || nthreads > 64 || n < 1 || nstreams < 1) {
        fprintf(stderr, "N, STREAMS >= 1 and THREADS 1..64\n");
        return 2;
    }
    graph_specs = calloc((size_t)(n * nthreads), sizeof *graph_specs);
    total = expected = n * nthreads;
    maybe_fork();
    cuInit(0);
    find_launch();
    if (is(capture, "same"))
        for (int s = 0; s < nstreams * nthreads; s++)
            fake_set_capturing((void *)(uintptr_t)(0x1000 + s), 1);
    else if (is(capture, "other"))
        fake_set_capturing((void *)(uintptr_t)0xC0DE, 1);
    if (is(api, "twoctx"))
        make_context_streams();
    if (switch_spec != NULL && is(switch_spec, "recreate")) {
        CUcontext popped;
        cuCtxCreate_v2(&created_ctx, 0, 0);
        cuCtxPopCurrent_v2(&popped); /* made current in the launching thread */
    }

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (is(api, "cancel")) {
        scenario_cancel();
    } else if (is(api, "longjmp")) {
        scenario_longjmp();
    } else if (is(api, "legacy")) {
        scenario_legacy();
    } else {
        pthread_t th[64];
        for (int t = 0; t < nthreads; t++)
            pthread_create(&th[t], NULL, run, (void *)(intptr_t)t);
        for (int t = 0; t < nthreads; t++)
            pthread_join(th[t], NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fake_wait_idle();
    report((t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec));
    if (getenv("LAUNCHER_FORK") != NULL && is(getenv("LAUNCHER_FORK"), "1"))
        _exit(0);
    return 0;
}
