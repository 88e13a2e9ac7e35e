/* Graph-500's exchange pattern, per message size: every call allocates its send and receive
 * buffers, fills the send buffer, runs MPI_Alltoallv (the same count to every rank, itself
 * included) and frees both, so each large message is a buffer the registration caches have
 * never seen and a rendezvous registers anew. Prints `alltoallv N us X` per size (N bytes to
 * each rank, X the mean time of a call on rank 0) and, when every received byte was the one
 * sent, "fresh alltoallv: all checked".
 *   -i iterations per size (default 50; 5 more warm up first)
 *   -m largest size (default 4 MiB), sizes 16 KiB to -m, x4 steps
 *   -C no byte check (timing only) */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The byte at `i` of what rank `from` sends rank `to` in call `call`. */
static unsigned char pattern(int call, int from, int to, size_t i) {
  uint64_t x = ((uint64_t)call * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)(from * 131 + to) << 40) ^ (i * 0xbf58476d1ce4e5b9ULL);
  return (unsigned char)(x >> 56 ^ x >> 23 ^ i);
}

int main(int argc, char **argv) {
  int iters = 50, check = 1, opt;
  size_t max = 4 << 20;
  while ((opt = getopt(argc, argv, "i:m:C")) != -1) {
    if (opt == 'i') iters = atoi(optarg);
    else if (opt == 'm') max = strtoull(optarg, NULL, 0);
    else if (opt == 'C') check = 0;
  }
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int *counts = malloc(n * sizeof(int)), *displs = malloc(n * sizeof(int));
  long long bad = 0;
  int call = 0;
  for (size_t s = 16384; s <= max; s *= 4) {
    for (int r = 0; r < n; r++) {
      counts[r] = (int)s;
      displs[r] = (int)(r * s);
    }
    double total = 0;
    for (int it = 0; it < iters + 5; it++, call++) {
      unsigned char *sb = malloc(s * n), *rb = malloc(s * n);
      if (!sb || !rb) MPI_Abort(MPI_COMM_WORLD, 2);
      for (int r = 0; r < n; r++) {
        if (check)
          for (size_t i = 0; i < s; i++) sb[r * s + i] = pattern(call, me, r, i);
        else
          memset(sb + r * s, call, s);
      }
      MPI_Barrier(MPI_COMM_WORLD);
      double t = MPI_Wtime();
      MPI_Alltoallv(sb, counts, displs, MPI_BYTE, rb, counts, displs, MPI_BYTE, MPI_COMM_WORLD);
      t = MPI_Wtime() - t;
      if (it >= 5) total += t;
      if (check)
        for (int r = 0; r < n; r++)
          for (size_t i = 0; i < s; i++)
            if (rb[r * s + i] != pattern(call, r, me, i) && bad++ < 5)
              fprintf(stderr, "rank %d: call %d size %zu from %d: byte %zu is %u, not %u\n", me, call, s, r, i, rb[r * s + i], pattern(call, r, me, i));
      free(sb);
      free(rb);
    }
    if (me == 0) printf("alltoallv %zu us %.1f\n", s, total / iters * 1e6);
  }
  long long all_bad = 0;
  MPI_Reduce(&bad, &all_bad, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
  if (me == 0) {
    if (check && all_bad == 0) printf("fresh alltoallv: all checked\n");
    else if (check) printf("fresh alltoallv: %lld bad bytes\n", all_bad);
    else printf("fresh alltoallv: not checked\n");
  }
  MPI_Finalize();
  return all_bad != 0;
}
