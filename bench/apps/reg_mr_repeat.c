/* ibv_reg_mr / ibv_dereg_mr timing as a registration cache sees it, against any libibverbs
 * (vrdma's drop-in inside `vrdma run`, or a NIC's): for each size, memory written first
 * (every page resident), then
 *   first     - the first registration of the range
 *   dereg     - its deregistration
 *   repeated  - registering the same range again (after the deregistration)
 *   overlap   - registering it once more while the repeated registration is alive
 *   fresh     - first registration of another, newly written range (malloc after free)
 * each the median of -n runs (default 5; every run uses new memory for `first`). Checks
 * that registration kept the bytes. Usage: reg_mr_repeat [-n runs] SIZE...
 * Prints one line per size: `reg_mr size N first_us X repeated_us Y overlap_us Z dereg_us W
 * first_GBps G`. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, n, sizeof *v, cmp);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static unsigned char *written(size_t n) {
  unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  for (size_t i = 0; i < n; i += 4096) p[i] = (unsigned char)(i >> 12) | 1;
  p[n - 1] = 0x5a;
  return p;
}

static void check(const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i += 4096)
    if (p[i] != ((unsigned char)(i >> 12) | 1)) {
      fprintf(stderr, "registration changed byte %zu\n", i);
      exit(1);
    }
  if (p[n - 1] != 0x5a) {
    fprintf(stderr, "registration changed the last byte\n");
    exit(1);
  }
}

int main(int argc, char **argv) {
  int runs = 5, opt, ndev;
  while ((opt = getopt(argc, argv, "n:")) != -1) {
    if (opt == 'n') runs = atoi(optarg);
    else return 2;
  }
  if (optind >= argc || runs < 1 || runs > 100) {
    fprintf(stderr, "usage: reg_mr_repeat [-n runs] SIZE...\n");
    return 2;
  }
  struct ibv_device **devs = ibv_get_device_list(&ndev);
  if (!devs || ndev < 1) {
    fprintf(stderr, "no RDMA device\n");
    return 1;
  }
  struct ibv_context *ctx = ibv_open_device(devs[0]);
  struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
  if (!pd) {
    fprintf(stderr, "cannot open %s\n", ibv_get_device_name(devs[0]));
    return 1;
  }
  int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  for (int a = optind; a < argc; a++) {
    size_t n = strtoull(argv[a], NULL, 0);
    double first[100], dereg[100], rep[100], over[100];
    for (int r = 0; r < runs; r++) {
      unsigned char *p = written(n);
      double t = now_us();
      struct ibv_mr *m = ibv_reg_mr(pd, p, n, acc);
      first[r] = now_us() - t;
      if (!m) {
        perror("ibv_reg_mr");
        return 1;
      }
      t = now_us();
      ibv_dereg_mr(m);
      dereg[r] = now_us() - t;
      t = now_us();
      m = ibv_reg_mr(pd, p, n, acc);
      rep[r] = now_us() - t;
      t = now_us();
      struct ibv_mr *m2 = ibv_reg_mr(pd, p, n, acc);
      over[r] = now_us() - t;
      if (!m || !m2) {
        perror("ibv_reg_mr again");
        return 1;
      }
      check(p, n);
      ibv_dereg_mr(m2);
      ibv_dereg_mr(m);
      munmap(p, n);
    }
    double f = median(first, runs);
    printf("reg_mr size %zu first_us %.1f repeated_us %.1f overlap_us %.1f dereg_us %.1f first_GBps %.2f repeated_GBps %.2f\n", n, f,
           median(rep, runs), median(over, runs), median(dereg, runs), n / f / 1e3, n / median(rep, runs) / 1e3);
    fflush(stdout);
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(devs);
  return 0;
}
