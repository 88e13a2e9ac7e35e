/* The data path alone, without registration: two ranks, the same buffers throughout (the
 * registration caches hit after the first use), per message size
 *   pingpong - MPI_Send then MPI_Recv, answered alike (half the round trip)
 *   exchange - MPI_Sendrecv by both ranks at once (both directions loaded)
 * Prints `exchange N pingpong_us X exchange_us Y` per size (rank 0's mean of the second of
 * two timed blocks, the first warming up) and, when every received byte was the one sent,
 * "exchange: all checked". Every message carries its iteration number in its first and last
 * 8 bytes (checked on each receive: a stale or lost message shows) and the rest of the
 * buffer a per-size pattern (checked once per block).
 *   -m largest size (default 1 MiB), sizes 8 B and 4 KiB to -m, x4 steps
 *   -i iterations per block for sizes below 256 KiB (default 2000; a tenth of it above) */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static unsigned char pattern(size_t size, int from, size_t i) {
  uint64_t x = (size * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)from << 40) ^ (i * 0xbf58476d1ce4e5b9ULL);
  return (unsigned char)(x >> 56 ^ x >> 23 ^ i);
}

static long long bad;
static int me;

/* Writes `stamp` at both ends of the message (both ends once for 8 bytes). */
static void stamp(unsigned char *b, size_t s, uint64_t stamp) {
  memcpy(b, &stamp, 8);
  if (s >= 16) memcpy(b + s - 8, &stamp, 8);
}

static void check_stamp(const unsigned char *b, size_t s, uint64_t want) {
  uint64_t head, tail = want;
  memcpy(&head, b, 8);
  if (s >= 16) memcpy(&tail, b + s - 8, 8);
  if ((head != want || tail != want) && bad++ < 5)
    fprintf(stderr, "rank %d: size %zu: message %llu, not %llu\n", me, s, (unsigned long long)head, (unsigned long long)want);
}

static void check_body(const unsigned char *b, size_t s, int from) {
  for (size_t i = 8; i + 8 < s; i++)
    if (b[i] != pattern(s, from, i) && bad++ < 5)
      fprintf(stderr, "rank %d: size %zu from %d: byte %zu is %u, not %u\n", me, s, from, i, b[i], pattern(s, from, i));
}

int main(int argc, char **argv) {
  int iters = 2000, opt;
  size_t max = 1 << 20;
  while ((opt = getopt(argc, argv, "i:m:")) != -1) {
    if (opt == 'i') iters = atoi(optarg);
    else if (opt == 'm') max = strtoull(optarg, NULL, 0);
  }
  MPI_Init(&argc, &argv);
  int n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 2) {
    if (me == 0) fprintf(stderr, "exchange: needs exactly 2 ranks\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int peer = 1 - me;
  unsigned char *sb = malloc(max < 8 ? 8 : max), *rb = malloc(max < 8 ? 8 : max);
  if (!sb || !rb) MPI_Abort(MPI_COMM_WORLD, 2);
  uint64_t seq = 0; /* messages sent by each rank so far: both ranks count alike */
  for (size_t s = 8; s <= max; s = s == 8 ? 4096 : s * 4) {
    int count = s >= 262144 ? (iters / 10 > 0 ? iters / 10 : 1) : iters;
    for (size_t i = 0; i < s; i++) sb[i] = pattern(s, me, i);
    double pp = 0, ex = 0;
    for (int block = 0; block < 2; block++) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t = MPI_Wtime();
      for (int i = 0; i < count; i++, seq++) {
        stamp(sb, s, seq);
        if (me == 0) {
          MPI_Send(sb, (int)s, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
          MPI_Recv(rb, (int)s, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Recv(rb, (int)s, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(sb, (int)s, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
        }
        check_stamp(rb, s, seq);
      }
      pp = (MPI_Wtime() - t) / count / 2 * 1e6;
      check_body(rb, s, peer);
      memset(rb, 0, s);
      MPI_Barrier(MPI_COMM_WORLD);
      t = MPI_Wtime();
      for (int i = 0; i < count; i++, seq++) {
        stamp(sb, s, seq);
        MPI_Sendrecv(sb, (int)s, MPI_BYTE, peer, 2, rb, (int)s, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        check_stamp(rb, s, seq);
      }
      ex = (MPI_Wtime() - t) / count * 1e6;
      check_body(rb, s, peer);
      memset(rb, 0, s);
    }
    if (me == 0) printf("exchange %zu pingpong_us %.2f exchange_us %.2f\n", s, pp, ex);
  }
  long long all_bad = 0;
  MPI_Reduce(&bad, &all_bad, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
  if (me == 0) {
    if (all_bad) printf("exchange: %lld bad\n", all_bad);
    else printf("exchange: all checked\n");
  }
  MPI_Finalize();
  return all_bad != 0;
}
