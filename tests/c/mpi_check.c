/* An MPI program of the project's own: every rank passes a buffer of known values around a
 * ring (each checks what its left neighbour sent), then all ranks add vectors with
 * MPI_Allreduce and check the sums, then broadcast a buffer from the last rank and check it.
 * Sizes go from one int to 1 MiB, so eager and rendezvous protocols both run. Rank 0 prints
 * "mpi_check: ok N ranks" when every rank passed; any mismatch aborts the job.
 *
 * usage: mpirun -np N mpi_check */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int rank, ranks;

static void fail(const char *what, long index, long got, long want)
{
	fprintf(stderr, "mpi_check: rank %d: %s: element %ld is %ld, not %ld\n", rank, what, index,
		got, want);
	MPI_Abort(MPI_COMM_WORLD, 1);
}

/* The value element `i` of a buffer from rank `from` holds in round `round`. */
static int32_t value(int from, int round, long i)
{
	return (int32_t)((from + 1) * 1000003 + round * 7919 + i * 31);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &ranks);
	const long sizes[] = {1, 64, 1024, 16384, 262144};
	int32_t *out = malloc(sizeof(int32_t) * 262144);
	int32_t *in = malloc(sizeof(int32_t) * 262144);
	if (!out || !in) {
		perror("malloc");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	for (int round = 0; round < (int)(sizeof sizes / sizeof sizes[0]); round++) {
		long n = sizes[round];
		int right = (rank + 1) % ranks, left = (rank + ranks - 1) % ranks;
		for (long i = 0; i < n; i++)
			out[i] = value(rank, round, i);
		MPI_Sendrecv(out, (int)n, MPI_INT32_T, right, round, in, (int)n, MPI_INT32_T, left,
			     round, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		for (long i = 0; i < n; i++)
			if (in[i] != value(left, round, i))
				fail("ring", i, in[i], value(left, round, i));

		/* Sums of small values, so that no sum overflows. */
		for (long i = 0; i < n; i++)
			out[i] = (int32_t)((rank + 1) * (i % 1000));
		MPI_Allreduce(out, in, (int)n, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
		long total = (long)ranks * (ranks + 1) / 2;
		for (long i = 0; i < n; i++)
			if (in[i] != total * (i % 1000))
				fail("allreduce", i, in[i], total * (i % 1000));

		int root = ranks - 1;
		for (long i = 0; i < n; i++)
			in[i] = rank == root ? value(root, round + 100, i) : 0;
		MPI_Bcast(in, (int)n, MPI_INT32_T, root, MPI_COMM_WORLD);
		for (long i = 0; i < n; i++)
			if (in[i] != value(root, round + 100, i))
				fail("bcast", i, in[i], value(root, round + 100, i));
	}
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0)
		printf("mpi_check: ok %d ranks\n", ranks);
	free(out);
	free(in);
	MPI_Finalize();
	return 0;
}
