/* Registration as memory hooks see it. UCX (ucm) and Open MPI (its patcher) hook mmap, mremap
 * and munmap to learn when application memory goes away, and drop their registration-cache
 * entries for it. This program hooks them the same way (the executable's definitions come
 * first in the symbol lookup, so the library's calls reach them; build with -rdynamic) and
 * checks that registering, deregistering and registering again a written buffer is, as on a
 * NIC, no mapping change of that buffer at all, and keeps every byte.
 * Prints "ALL OK" and exits 0, or names the first failure and exits 1. */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static uintptr_t watch_lo, watch_hi;
static int hooked_calls_on_watch;

static void seen(const char *what, void *addr, size_t len) {
  uintptr_t a = (uintptr_t)addr;
  if (a < watch_hi && a + len > watch_lo) {
    hooked_calls_on_watch++;
    fprintf(stderr, "hook: %s(%p, %zu) touches the registered buffer\n", what, addr, len);
  }
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  if (flags & MAP_FIXED) seen("mmap", addr, len);
  return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}

int munmap(void *addr, size_t len) {
  seen("munmap", addr, len);
  return (int)syscall(SYS_munmap, addr, len);
}

void *mremap(void *old, size_t old_len, size_t new_len, int flags, ...) {
  void *to = NULL;
  if (flags & MREMAP_FIXED) {
    va_list ap;
    va_start(ap, flags);
    to = va_arg(ap, void *);
    va_end(ap);
    seen("mremap (destination)", to, new_len);
  }
  seen("mremap (source)", old, old_len);
  return (void *)syscall(SYS_mremap, old, old_len, new_len, flags, to);
}

static int fail(const char *what) {
  fprintf(stderr, "FAIL: %s\n", what);
  return 1;
}

static int pattern_holds(const unsigned char *p, size_t len, unsigned seed) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != (unsigned char)(i * 31 + seed)) return 0;
  return 1;
}

int main(void) {
  int n;
  struct ibv_device **devs = ibv_get_device_list(&n);
  if (!devs || n < 1) return fail("no device");
  struct ibv_context *ctx = ibv_open_device(devs[0]);
  if (!ctx) return fail("open device");
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  if (!pd) return fail("alloc pd");
  size_t sizes[] = {4096, 65536, 1 << 20, 16 << 20};
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  for (unsigned k = 0; k < sizeof sizes / sizeof *sizes; k++) {
    size_t len = sizes[k];
    unsigned char *buf = (void *)syscall(SYS_mmap, NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return fail("mmap");
    for (size_t i = 0; i < len; i++) buf[i] = (unsigned char)(i * 31 + k);
    watch_lo = (uintptr_t)buf;
    watch_hi = watch_lo + len;
    for (int round = 0; round < 3; round++) {
      struct ibv_mr *mr = ibv_reg_mr(pd, buf, len, access);
      if (!mr) return fail("reg_mr");
      if (!pattern_holds(buf, len, k)) return fail("bytes changed by registration");
      buf[len / 2] ^= 0xff; /* written while registered */
      buf[len / 2] ^= 0xff;
      if (ibv_dereg_mr(mr)) return fail("dereg_mr");
      if (!pattern_holds(buf, len, k)) return fail("bytes changed by deregistration");
    }
    watch_lo = watch_hi = 0;
    if (hooked_calls_on_watch) {
      fprintf(stderr, "FAIL: %d hooked mapping calls on a %zu-byte buffer: a registration cache would drop its entry\n",
              hooked_calls_on_watch, len);
      return 1;
    }
    syscall(SYS_munmap, buf, len);
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(devs);
  printf("ALL OK\n");
  return 0;
}
