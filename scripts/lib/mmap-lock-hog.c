// LD_PRELOAD: in `vrdma perf` only (not in `vrdma run`), a thread that holds the process's
// mmap_lock for writing as much as it can: mprotect over a large populated range, in a loop.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>
static size_t len;
static char *mem;
static void *hog(void *arg) {
    for (;;) {
        mprotect(mem, len, PROT_READ);
        mprotect(mem, len, PROT_READ | PROT_WRITE);
    }
    return 0;
}
__attribute__((constructor)) static void start(void) {
    char buf[4096];
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = 0;
    const char *a1 = buf + strlen(buf) + 1;
    if (a1 >= buf + n || strcmp(a1, "perf") != 0) return;
    const char *mb = getenv("HOG_MB");
    len = (size_t)(mb ? atol(mb) : 2048) << 20;
    mem = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return;
    for (size_t i = 0; i < len; i += 4096) mem[i] = 1;
    pthread_t t;
    pthread_create(&t, 0, hog, 0);
}
