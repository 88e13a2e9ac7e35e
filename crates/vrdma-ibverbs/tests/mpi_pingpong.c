/*
 * An MPI program, built with Debian's mpicc and run unmodified over a vNIC (the dropin test
 * `mpi_runs_over_the_vnic`): a ping-pong between ranks 0 and 1 at sizes from 1 B to 4 MiB
 * (eager and rendezvous), every byte of every message checked, a nonblocking exchange in
 * both directions at once, and collectives with known results. Prints the half round trip
 * per size and, when everything held, "mpi over vrdma: all checked".
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fill(unsigned char *b, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		b[i] = (unsigned char)(i * 131 + seed * 7 + 1);
}

static void expect(const unsigned char *b, size_t n, unsigned seed, int rank, const char *what)
{
	for (size_t i = 0; i < n; i++) {
		if (b[i] != (unsigned char)(i * 131 + seed * 7 + 1)) {
			fprintf(stderr, "rank %d: %s of %zu bytes (seed %u): byte %zu is %u\n", rank, what, n, seed, i, b[i]);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, nranks;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);
	if (nranks != 2) {
		if (rank == 0)
			fprintf(stderr, "run with 2 ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	const size_t sizes[] = { 1, 8, 4096, 65536, 1 << 20, 4 << 20 };
	const size_t max = 4 << 20;
	unsigned char *sb = malloc(max), *rb = malloc(max), *rb2 = malloc(max);
	if (!sb || !rb || !rb2)
		MPI_Abort(MPI_COMM_WORLD, 3);
	int peer = 1 - rank;
	for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
		size_t n = sizes[s];
		int iters = n >= (1 << 20) ? 20 : 500;
		MPI_Barrier(MPI_COMM_WORLD);
		double t0 = MPI_Wtime();
		for (int i = 0; i < iters; i++) {
			unsigned seed = s * 1000 + i;
			if (rank == 0) {
				fill(sb, n, seed);
				MPI_Send(sb, (int)n, MPI_BYTE, peer, i, MPI_COMM_WORLD);
				memset(rb, 0, n);
				MPI_Recv(rb, (int)n, MPI_BYTE, peer, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				expect(rb, n, seed + 1, rank, "pong");
			} else {
				memset(rb, 0, n);
				MPI_Recv(rb, (int)n, MPI_BYTE, peer, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				expect(rb, n, seed, rank, "ping");
				fill(sb, n, seed + 1);
				MPI_Send(sb, (int)n, MPI_BYTE, peer, i, MPI_COMM_WORLD);
			}
		}
		double dt = MPI_Wtime() - t0;
		if (rank == 0)
			printf("size %zu: %.2f us half round trip (with the checks)\n", n, dt / iters / 2 * 1e6);
	}
	/* Both directions at once, nonblocking. */
	for (int i = 0; i < 10; i++) {
		MPI_Request rq[2];
		fill(sb, max, 7000 + rank * 100 + i);
		memset(rb2, 0, max);
		MPI_Irecv(rb2, (int)max, MPI_BYTE, peer, 77, MPI_COMM_WORLD, &rq[0]);
		MPI_Isend(sb, (int)max, MPI_BYTE, peer, 77, MPI_COMM_WORLD, &rq[1]);
		MPI_Waitall(2, rq, MPI_STATUSES_IGNORE);
		expect(rb2, max, 7000 + peer * 100 + i, rank, "exchange");
	}
	/* Collectives. */
	long v = rank + 1, sum = 0;
	MPI_Allreduce(&v, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
	long big[4096], bsum[4096];
	for (int i = 0; i < 4096; i++)
		big[i] = (long)i * (rank + 1);
	MPI_Allreduce(big, bsum, 4096, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
	for (int i = 0; i < 4096; i++) {
		if (bsum[i] != (long)i * 3) {
			fprintf(stderr, "rank %d: allreduce element %d is %ld\n", rank, i, bsum[i]);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}
	fill(sb, 1 << 20, 4242);
	if (rank != 0)
		memset(sb, 0, 1 << 20);
	MPI_Bcast(sb, 1 << 20, MPI_BYTE, 0, MPI_COMM_WORLD);
	expect(sb, 1 << 20, 4242, rank, "broadcast");
	if (sum != 3) {
		fprintf(stderr, "rank %d: allreduce gave %ld\n", rank, sum);
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("mpi over vrdma: all checked\n");
	free(sb);
	free(rb);
	free(rb2);
	MPI_Finalize();
	return 0;
}
