/*
 * Small shared objects for tests/native's dlsym tests, one per -D flag:
 *   -DDEP: libdep.so, defining dep_symbol;
 *   -DPLUGIN: libplugin.so, linked to libdep.so and loaded RTLD_LOCAL (as Python loads extension
 *     modules): plugin_lookup() looks its dependency's symbol up through RTLD_DEFAULT, which glibc
 *     resolves in the caller's scope, so it finds it only if dlsym is called from the plugin;
 *   -DNEXT_INTERPOSER: a second LD_PRELOAD interposer in HAMi-core's style, preloaded after
 *     gpushare's: an unversioned dlsym that counts lookups of cuGetProcAddress_v2 on a library
 *     handle (next_interposer_lookups()) and forwards everything to glibc's dlsym as a tail call.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#if defined(DEP)
int dep_symbol = 42;

#elif defined(PLUGIN)
extern int dep_symbol;
int plugin_uses_dep(void) { return dep_symbol; }
/* Not a tail call: glibc must see this library as dlsym's caller. */
__attribute__((optimize("no-optimize-sibling-calls"))) void *plugin_lookup(void)
{
    void *p = dlsym(RTLD_DEFAULT, "dep_symbol");
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

#elif defined(NEXT_INTERPOSER)
typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real;
static int lookups;

/* Without pthread_once: ThreadSanitizer intercepts it and calls dlsym while it starts. */
static dlsym_fn find_real(void)
{
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
    dlsym_fn found = NULL;
    for (int i = 0; versions[i] != NULL && found == NULL; i++)
        found = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&real, found, __ATOMIC_RELEASE);
    return found;
}

int next_interposer_lookups(void) { return __atomic_load_n(&lookups, __ATOMIC_RELAXED); }

__attribute__((optimize("optimize-sibling-calls"))) void *dlsym(void *handle, const char *name)
{
    dlsym_fn r = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (r == NULL)
        r = find_real();
    if (handle != RTLD_NEXT && handle != RTLD_DEFAULT && strcmp(name, "cuGetProcAddress_v2") == 0)
        __atomic_fetch_add(&lookups, 1, __ATOMIC_RELAXED);
    return r(handle, name);
}
#endif
