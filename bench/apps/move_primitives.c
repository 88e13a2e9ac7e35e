/* What a registration's move onto a memfd and its move back cost, as crates/vrdma does them
 * (crates/vrdma/src/mr.rs `share_gap`, crates/vrdma/src/unshare.rs `move_to_private`), against
 * keeping the application's own pages aside ("parked") while the range is on the memfd and
 * moving the bytes back into them: per size, the mean of -n rounds of
 *   current: fallocate + pwrite the written pages into the memfd, mmap it MAP_FIXED over the
 *            range (the private pages are freed); back: a fresh MAP_POPULATE private mapping,
 *            memcpy from the memfd, mremap it over the range, punch the memfd
 *   no_fallocate: the same without the fallocate (pwrite allocates the memfd's pages)
 *   parked:  pwrite (no fallocate), then mremap the private pages to a reserved address and
 *            mmap the memfd over the range; back: memcpy into the parked pages, mremap them
 *            over the range, punch the memfd (no private page is allocated, zeroed or freed)
 * Every round writes the range first and checks its bytes after the move back, including one
 * written while it was on the memfd. Prints `move SIZE current_us A B no_fallocate_us C D
 * parked_us E F` (move, move back). Usage: move_primitives [-n rounds] SIZE... (default 1 MiB and 4 MiB).
 * Build: gcc -O2 -o move_primitives move_primitives.c */
#define _GNU_SOURCE
#include <fcntl.h>
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

static void die(const char *what) {
  perror(what);
  exit(1);
}

enum way { CURRENT, NO_FALLOCATE, PARKED, WAYS };

/* One round: move [buf, +n) onto `fd` and back the way `way`; adds the times. */
static void round_trip(char *buf, size_t n, int fd, char *hole, enum way way, int round, double *move, double *back) {
  int parked = way == PARKED;
  memset(buf, round, n);
  double t0 = now_us();
  char *park = NULL;
  if (way == CURRENT && fallocate(fd, 0, 0, n) != 0) die("fallocate");
  if (pwrite(fd, buf, n, 0) != (ssize_t)n) die("pwrite");
  if (parked) {
    park = mremap(buf, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, hole);
    if (park == MAP_FAILED) die("mremap to the park");
  }
  if (mmap(buf, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) die("mmap memfd");
  double t1 = now_us();
  buf[n / 2] = (char)(round + 1); /* written while on the memfd (by the application or a peer) */
  if (parked) {
    memcpy(park, buf, n);
    if (mremap(park, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, buf) == MAP_FAILED) die("mremap back");
  } else {
    char *tmp = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (tmp == MAP_FAILED) die("mmap private");
    memcpy(tmp, buf, n);
    if (mremap(tmp, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, buf) == MAP_FAILED) die("mremap over");
  }
  if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, n) != 0) die("punch");
  double t2 = now_us();
  for (size_t i = 0; i < n; i++)
    if (buf[i] != (char)(i == n / 2 ? round + 1 : round)) {
      fprintf(stderr, "byte %zu is %d after the move back\n", i, buf[i]);
      exit(1);
    }
  *move += t1 - t0;
  *back += t2 - t1;
}

int main(int argc, char **argv) {
  int rounds = 1000, opt;
  while ((opt = getopt(argc, argv, "n:")) != -1)
    if (opt == 'n') rounds = atoi(optarg);
  size_t defaults[] = {1 << 20, 4 << 20};
  int count = optind < argc ? argc - optind : 2;
  for (int k = 0; k < count; k++) {
    size_t n = optind < argc ? strtoull(argv[optind + k], NULL, 0) : defaults[k];
    n = (n + 4095) & ~(size_t)4095;
    int fd = memfd_create("move-primitives", 0);
    if (fd < 0 || ftruncate(fd, n) != 0) die("memfd");
    char *buf = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *hole = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED || hole == MAP_FAILED) die("mmap");
    double t[WAYS][2] = {{0, 0}, {0, 0}, {0, 0}};
    /* Alternated, so that no way always runs on a warmer machine. */
    for (int r = 0; r < WAYS * rounds; r++) round_trip(buf, n, fd, hole, r % WAYS, r, &t[r % WAYS][0], &t[r % WAYS][1]);
    printf("move %zu current_us %.1f %.1f no_fallocate_us %.1f %.1f parked_us %.1f %.1f\n", n, t[0][0] / rounds,
           t[0][1] / rounds, t[1][0] / rounds, t[1][1] / rounds, t[2][0] / rounds, t[2][1] / rounds);
    munmap(buf, n);
    close(fd);
  }
  return 0;
}
