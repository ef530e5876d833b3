/* LD_PRELOAD shim for the llama-server benchmarks: refuse the AMX tile permission request (arch_prctl
 * ARCH_REQ_XCOMP_PERM), so ggml's CPU backend finds AMX "not ready" and runs without it, as our ggml and the
 * llama.cpp reference are built (build_ggml.py NO_AMX: its AMX kernels crash on this project's Xeons). A
 * llama-server built by serve_bench.py --build-llama-server with -march=native has them compiled in. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

long syscall(long number, ...) {
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_arch_prctl && a[0] == 0x1023) { /* ARCH_REQ_XCOMP_PERM */
        errno = EPERM;
        return -1;
    }
    long (*real)(long, ...) = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
