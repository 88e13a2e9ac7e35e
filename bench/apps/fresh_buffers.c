/* An OSU-style two-rank bandwidth and latency sweep whose every message lives in a buffer
 * allocated just for it and freed right after: what MPI applications that allocate per
 * message do to registration caches (UCX's and Open MPI's rcache must notice the free, or the
 * munmap, and never reuse a stale registration for new memory at the same address).
 * Rank 0 sends, rank 1 receives; every byte is checked on the receiver (-c, default on; -C
 * turns the check off for pure timing). Sizes 8 B to -m (default 4 MiB), x4 steps.
 *   -a malloc (default) | -M mmap/munmap per buffer (always returns the pages to the kernel;
 *      the next mmap often lands at the same address: the invalidation case)
 *   -w window: messages in flight per bandwidth step (default 16, as Isend/Irecv)
 *   -i iterations per size (default 50)
 * Prints `size N bw_MBps X lat_us Y` per size (lat: one-way, half a ping-pong of fresh
 * buffers) and, when all is well, "fresh buffers: all checked". */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int use_mmap, check = 1;

static unsigned char *get(size_t n) {
  if (!use_mmap) {
    unsigned char *p = malloc(n);
    if (!p) MPI_Abort(MPI_COMM_WORLD, 2);
    return p;
  }
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) MPI_Abort(MPI_COMM_WORLD, 2);
  return p;
}

static void put(unsigned char *p, size_t n) {
  if (use_mmap) munmap(p, n);
  else free(p);
}

/* The byte at `i` of message `tag`: differs between messages, so a stale buffer shows. */
static unsigned char pattern(uint64_t tag, size_t i) {
  uint64_t x = (tag * 0x9e3779b97f4a7c15ULL) ^ (i * 0xbf58476d1ce4e5b9ULL);
  return (unsigned char)(x >> 56 ^ x >> 17 ^ i);
}

static void fill(unsigned char *p, size_t n, uint64_t tag) {
  if (!check) {
    memset(p, (int)tag, n);
    return;
  }
  for (size_t i = 0; i < n; i++) p[i] = pattern(tag, i);
}

static long long bad_bytes;

static void verify(const unsigned char *p, size_t n, uint64_t tag) {
  if (!check) return;
  for (size_t i = 0; i < n; i++)
    if (p[i] != pattern(tag, i)) {
      if (bad_bytes < 5) fprintf(stderr, "message %llu size %zu: byte %zu is %u, not %u\n", (unsigned long long)tag, n, i, p[i], pattern(tag, i));
      bad_bytes++;
    }
}

int main(int argc, char **argv) {
  int rank, size, opt, window = 16, iters = 50;
  size_t max = 4 << 20;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  while ((opt = getopt(argc, argv, "aMcCw:i:m:")) != -1) {
    switch (opt) {
      case 'a': use_mmap = 0; break;
      case 'M': use_mmap = 1; break;
      case 'c': check = 1; break;
      case 'C': check = 0; break;
      case 'w': window = atoi(optarg); break;
      case 'i': iters = atoi(optarg); break;
      case 'm': max = strtoull(optarg, NULL, 0); break;
      default: MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  if (size != 2 || window < 1 || window > 1024 || iters < 1) {
    if (rank == 0) fprintf(stderr, "fresh_buffers: two ranks, -w 1..1024, -i >= 1\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  uint64_t tag = 1;
  unsigned char *bufs[1024];
  MPI_Request reqs[1024];
  for (size_t n = 8; n <= max; n *= 4) {
    /* Bandwidth: `window` fresh buffers in flight, then all freed. */
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    for (int it = 0; it < iters; it++) {
      for (int w = 0; w < window; w++) {
        bufs[w] = get(n);
        if (rank == 0) {
          fill(bufs[w], n, tag + w);
          MPI_Isend(bufs[w], (int)n, MPI_BYTE, 1, w, MPI_COMM_WORLD, &reqs[w]);
        } else {
          MPI_Irecv(bufs[w], (int)n, MPI_BYTE, 0, w, MPI_COMM_WORLD, &reqs[w]);
        }
      }
      MPI_Waitall(window, reqs, MPI_STATUSES_IGNORE);
      for (int w = 0; w < window; w++) {
        if (rank == 1) verify(bufs[w], n, tag + w);
        put(bufs[w], n);
      }
      tag += window;
      /* The receiver's acknowledgement ends the step, as in osu_bw. */
      char ack = 0;
      if (rank == 0) MPI_Recv(&ack, 1, MPI_BYTE, 1, 9999, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      else MPI_Send(&ack, 1, MPI_BYTE, 0, 9999, MPI_COMM_WORLD);
    }
    double bw_time = MPI_Wtime() - t;
    /* Latency: ping-pong, each leg a fresh buffer. */
    MPI_Barrier(MPI_COMM_WORLD);
    t = MPI_Wtime();
    for (int it = 0; it < iters; it++) {
      for (int leg = 0; leg < 2; leg++) {
        unsigned char *b = get(n);
        if (rank == leg) {
          fill(b, n, tag);
          MPI_Send(b, (int)n, MPI_BYTE, 1 - leg, 1, MPI_COMM_WORLD);
        } else {
          MPI_Recv(b, (int)n, MPI_BYTE, leg, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          verify(b, n, tag);
        }
        put(b, n);
        tag++;
      }
    }
    double lat_time = MPI_Wtime() - t;
    if (rank == 0)
      printf("size %zu bw_MBps %.1f lat_us %.2f\n", n, (double)n * window * iters / bw_time / 1e6, lat_time / iters / 2 * 1e6);
    if (n == max) break;
    if (n * 4 > max) n = max / 4; /* always end on -m */
  }
  long long all_bad = 0;
  MPI_Reduce(&bad_bytes, &all_bad, 1, MPI_LONG_LONG, MPI_SUM, 1, MPI_COMM_WORLD);
  MPI_Bcast(&all_bad, 1, MPI_LONG_LONG, 1, MPI_COMM_WORLD);
  if (rank == 0) {
    if (all_bad) printf("fresh buffers: %lld bad bytes\n", all_bad);
    else printf("fresh buffers: all %s (%s)\n", check ? "checked" : "unchecked", use_mmap ? "mmap" : "malloc");
  }
  MPI_Finalize();
  return all_bad ? 1 : 0;
}
