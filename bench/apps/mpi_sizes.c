/* Where an MPI application's communication time goes, by message size: a PMPI library
 * (LD_PRELOAD) that times MPI_Alltoallv by the bytes a rank sends to others (buckets of 8x
 * from 1 KiB), MPI_Alltoall and MPI_Allreduce, and prints rank 0's totals at MPI_Finalize
 * ("mpi_sizes: ..." lines on stderr). Graph-500's level exchanges are Alltoallv of freshly
 * allocated buffers: comparing these lines between transports shows which sizes cost.
 * Build: mpicc -O2 -shared -fPIC -o libmpi_sizes.so mpi_sizes.c */
#include <mpi.h>
#include <stdio.h>

#define BUCKETS 8
static double t_a2av[BUCKETS], t_a2a, t_ar;
static long n_a2av[BUCKETS], n_a2a, n_ar;
static const char *names[BUCKETS] = {"<1K", "<8K", "<64K", "<512K", "<4M", "<32M", "<256M", ">=256M"};

static int bucket(long bytes) {
  int i = 0;
  for (long b = bytes; b >= 1024 && i < BUCKETS - 1; b /= 8) i++;
  return i;
}

int MPI_Alltoallv(const void *sb, const int *sc, const int *sd, MPI_Datatype st, void *rb, const int *rc, const int *rd,
                  MPI_Datatype rt, MPI_Comm c) {
  int rank, n, size;
  MPI_Comm_rank(c, &rank);
  MPI_Comm_size(c, &n);
  MPI_Type_size(st, &size);
  long bytes = 0;
  for (int i = 0; i < n; i++)
    if (i != rank) bytes += (long)sc[i] * size;
  double t = MPI_Wtime();
  int r = PMPI_Alltoallv(sb, sc, sd, st, rb, rc, rd, rt, c);
  int b = bucket(bytes);
  t_a2av[b] += MPI_Wtime() - t;
  n_a2av[b]++;
  return r;
}

int MPI_Alltoall(const void *sb, int sc, MPI_Datatype st, void *rb, int rc, MPI_Datatype rt, MPI_Comm c) {
  double t = MPI_Wtime();
  int r = PMPI_Alltoall(sb, sc, st, rb, rc, rt, c);
  t_a2a += MPI_Wtime() - t;
  n_a2a++;
  return r;
}

int MPI_Allreduce(const void *s, void *r, int n, MPI_Datatype d, MPI_Op o, MPI_Comm c) {
  double t = MPI_Wtime();
  int x = PMPI_Allreduce(s, r, n, d, o, c);
  t_ar += MPI_Wtime() - t;
  n_ar++;
  return x;
}

int MPI_Finalize(void) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    for (int i = 0; i < BUCKETS; i++)
      if (n_a2av[i])
        fprintf(stderr, "mpi_sizes: alltoallv %-6s n %6ld total %9.2f ms each %9.1f us\n", names[i], n_a2av[i],
                t_a2av[i] * 1e3, t_a2av[i] / n_a2av[i] * 1e6);
    if (n_a2a) fprintf(stderr, "mpi_sizes: alltoall         n %6ld total %9.2f ms each %9.1f us\n", n_a2a, t_a2a * 1e3, t_a2a / n_a2a * 1e6);
    if (n_ar) fprintf(stderr, "mpi_sizes: allreduce        n %6ld total %9.2f ms each %9.1f us\n", n_ar, t_ar * 1e3, t_ar / n_ar * 1e6);
  }
  return PMPI_Finalize();
}
