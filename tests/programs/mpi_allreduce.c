/* An MPI program for `job.launcher: mpirun` tests: every rank adds rank + 1 in an allreduce,
 * prints the sum (3 ranks: 6), then sleeps argv[1] seconds (0 if not given) and ends.
 *
 *     mpicc -o mpi_allreduce tests/programs/mpi_allreduce.c && mpirun -np 3 ./mpi_allreduce 0
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, size, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d of %d: allreduce sum %d (env rank %s)\n", rank, size, sum, getenv("OMPI_COMM_WORLD_RANK"));
    fflush(stdout);
    if (argc > 1) sleep(atoi(argv[1]));
    MPI_Finalize();
    return 0;
}
