/*
 * Drives the fake libcuda (fake_cuda.c) the ways real programs reach the driver, then prints what
 * the fake GPU saw as one JSON line. Usage:
 *   launcher_prog REACH API N US [STREAMS [THREADS [CAPTURE [SWITCH]]]]
 * REACH: direct (linked symbols) | gpa (linked cuGetProcAddress_v2) | gpa-self (cuGetProcAddress
 *   fetched through itself) | dlsym-gpa (dlopen + dlsym(handle, "cuGetProcAddress_v2"), as cudart
 *   does) | dlsym-gpa-v1 (the CUDA 11 four-argument cuGetProcAddress) | dlsym (dlsym(handle,
 *   "cuLaunchKernel"), as ctypes does) | ptsz (dlsym-gpa with the per-thread-default-stream flag,
 *   stream 0) | rtld-next (dlsym(RTLD_NEXT, ...) from this program).
 * API: kernel | ex | coop | graph | pair (cuLaunchKernel alternating, over two streams, a kernel
 * that waits for the next launch (gridDimZ 2) and that launch (gridDimZ 3)). N launches of US microseconds per thread, round-robin over
 * STREAMS streams per thread. CAPTURE: none | same (the launch streams are being captured) |
 * other (another stream is being captured while these launch). SWITCH (optional) PATH:VALUE:
 * after half the launches (one thread), wait until the GPU is idle, write VALUE as a 4-byte
 * little-endian int at offset 0 of PATH in place (GPUSHARE_INFLIGHT_CONTROL), and count the most
 * kernels in flight afresh; max_inflight_before_switch is the first half's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
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
int fake_max_inflight(void);
long fake_kernels_done(void);
int fake_events_created(void);
int fake_events_timed(void);
int fake_capture_violations(void);
int fake_capture_invalidated(void);
long fake_calls_legacy(void);
long fake_calls_ptsz(void);
void fake_set_capturing(void *, int);
void fake_wait_idle(void);
void fake_reset_max(void);
int fake_log(uintptr_t *, unsigned *, int);

static const char *reach, *api;
static int n, us, nstreams = 1, nthreads = 1;
static void *fn; /* the launch entry point as REACH found it */
static int ptsz;
static long errors;
static unsigned (*graph_specs)[2];
static const char *switch_spec;
static int max_before_switch = -1;

/* SWITCH: the daemon's side of GPUSHARE_INFLIGHT_CONTROL, in the middle of the run. */
static void do_switch(void)
{
    char path[4096];
    const char *colon = strrchr(switch_spec, ':');
    if (colon == NULL || (size_t)(colon - switch_spec) >= sizeof path) {
        fprintf(stderr, "SWITCH is PATH:VALUE\n");
        exit(2);
    }
    memcpy(path, switch_spec, (size_t)(colon - switch_spec));
    path[colon - switch_spec] = '\0';
    int32_t v = (int32_t)atoi(colon + 1);
    unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                           (unsigned char)(v >> 24)};
    fake_wait_idle();
    max_before_switch = fake_max_inflight();
    int fd = open(path, O_WRONLY);
    if (fd < 0 || pwrite(fd, le, 4, 0) != 4) {
        perror(path);
        exit(2);
    }
    close(fd);
    fake_reset_max();
}

static const char *api_symbol(void)
{
    if (strcmp(api, "ex") == 0)
        return "cuLaunchKernelEx";
    if (strcmp(api, "coop") == 0)
        return "cuLaunchCooperativeKernel";
    if (strcmp(api, "graph") == 0)
        return "cuGraphLaunch";
    return "cuLaunchKernel";
}

static void *direct_symbol(void)
{
    if (strcmp(api, "ex") == 0)
        return (void *)cuLaunchKernelEx;
    if (strcmp(api, "coop") == 0)
        return (void *)cuLaunchCooperativeKernel;
    if (strcmp(api, "graph") == 0)
        return (void *)cuGraphLaunch;
    return (void *)cuLaunchKernel;
}

static void find_launch(void)
{
    const char *sym = api_symbol();
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (strcmp(reach, "direct") == 0) {
        fn = direct_symbol();
    } else if (strcmp(reach, "gpa") == 0) {
        cuGetProcAddress_v2(sym, &fn, 12040, 0, NULL);
    } else if (strcmp(reach, "gpa-self") == 0) {
        void *gpa = NULL;
        cuGetProcAddress_v2("cuGetProcAddress", &gpa, 12040, 0, NULL);
        ((gpa2_fn)gpa)(sym, &fn, 12040, 0, NULL);
    } else if (strcmp(reach, "dlsym-gpa") == 0 || strcmp(reach, "ptsz") == 0) {
        gpa2_fn gpa = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
        ptsz = strcmp(reach, "ptsz") == 0;
        gpa(sym, &fn, 12040, ptsz ? 2ull : 0ull, NULL);
    } else if (strcmp(reach, "dlsym-gpa-v1") == 0) {
        gpa1_fn gpa = (gpa1_fn)dlsym(lib, "cuGetProcAddress");
        gpa(sym, &fn, 11080, 0);
    } else if (strcmp(reach, "dlsym") == 0) {
        fn = dlsym(lib, sym);
    } else if (strcmp(reach, "rtld-next") == 0) {
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

static CUresult launch_one(CUstream s, unsigned tag)
{
    if (strcmp(api, "ex") == 0) {
        CUlaunchConfig c = {(unsigned)us, tag, 1, 1, 1, 1, 0, s, NULL, 0};
        return ((ex_fn)fn)(&c, NULL, NULL, NULL);
    }
    if (strcmp(api, "coop") == 0)
        return ((coop_fn)fn)(NULL, (unsigned)us, tag, 1, 1, 1, 1, 0, s, NULL);
    if (strcmp(api, "graph") == 0) {
        graph_specs[tag][0] = (unsigned)us;
        graph_specs[tag][1] = tag;
        return ((graph_fn)fn)(graph_specs[tag], s);
    }
    unsigned z = strcmp(api, "pair") == 0 ? 2 + tag % 2 : 1;
    return ((launch_fn)fn)(NULL, (unsigned)us, tag, z, 1, 1, 1, 0, s, NULL, NULL);
}

static CUstream stream_of(int t, int i)
{
    if (ptsz)
        return NULL; /* the thread's per-thread default stream */
    if (strcmp(api, "pair") == 0)
        return (CUstream)(uintptr_t)(0x1000 + t * 2 + i % 2);
    return (CUstream)(uintptr_t)(0x1000 + t * nstreams + i % nstreams);
}

static void *run(void *arg)
{
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < n; i++) {
        if (switch_spec != NULL && t == 0 && i == n / 2)
            do_switch();
        if (launch_one(stream_of(t, i), (unsigned)(t * n + i)) != 0)
            __atomic_fetch_add(&errors, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s REACH API N US [STREAMS [THREADS [CAPTURE [SWITCH]]]]\n", argv[0]);
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
    graph_specs = calloc((size_t)(n * nthreads), sizeof *graph_specs);
    cuInit(0);
    find_launch();
    if (strcmp(capture, "same") == 0)
        for (int s = 0; s < nstreams * nthreads; s++)
            fake_set_capturing((void *)(uintptr_t)(0x1000 + s), 1);
    else if (strcmp(capture, "other") == 0)
        fake_set_capturing((void *)(uintptr_t)0xC0DE, 1);

    pthread_t th[64];
    if (nthreads < 1 || nthreads > 64 || n < 1 || nstreams < 1) {
        fprintf(stderr, "N, STREAMS >= 1 and THREADS 1..64\n");
        return 2;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < nthreads; t++)
        pthread_create(&th[t], NULL, run, (void *)(intptr_t)t);
    for (int t = 0; t < nthreads; t++)
        pthread_join(th[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fake_wait_idle();
    long long launch_ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);

    /* Every kernel ran once, and in launch order on each stream. */
    int total = n * nthreads;
    uintptr_t *ls = calloc((size_t)total + 1, sizeof *ls);
    unsigned *lt = calloc((size_t)total + 1, sizeof *lt);
    int got = fake_log(ls, lt, total + 1);
    int order_ok = got == total;
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
    printf("{\"max_inflight\": %d, \"kernels_done\": %ld, \"expected\": %d, \"order_ok\": %s, "
           "\"events_created\": %d, \"events_timed\": %d, \"capture_violations\": %d, "
           "\"capture_invalidated\": %d, \"calls_legacy\": %ld, \"calls_ptsz\": %ld, "
           "\"launch_errors\": %ld, \"launch_loop_ns\": %lld, "
           "\"max_inflight_before_switch\": %d}\n",
           fake_max_inflight(), fake_kernels_done(), total, order_ok ? "true" : "false",
           fake_events_created(), fake_events_timed(), fake_capture_violations(),
           fake_capture_invalidated(), fake_calls_legacy(), fake_calls_ptsz(), errors, launch_ns,
           max_before_switch);
    return 0;
}
