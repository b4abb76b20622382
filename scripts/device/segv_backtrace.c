/* LD_PRELOAD this to print the native stack of a SIGSEGV to stderr (for machines without
 * gdb); run the process without Python's fault handler, which would take the signal.
 *   gcc -shared -fPIC -O0 -o /tmp/segv_backtrace.so scripts/device/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 -m pytest ... */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

enum { MAX_FRAMES = 64 };

static void on_segv(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    void *frames[MAX_FRAMES];
    static const char head[] = "\n== SIGSEGV, native stack (innermost first):\n";
    write(STDERR_FILENO, head, sizeof head - 1);
    int n = backtrace(frames, MAX_FRAMES);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    signal(sig, SIG_DFL);
    raise(sig);
    (void)info;
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigaction(SIGSEGV, &sa, NULL);
}
