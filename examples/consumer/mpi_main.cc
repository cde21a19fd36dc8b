// examples/consumer/mpi_main.cc — the same round trip with ranks started by mpirun (`mpirun -n 2
// ./consumer_mpi`): the Bootstrap comes from the communicator, passed by value.
#include <mpi.h>

#include "epcomm/bootstrap_mpi.h"
#include "round_trip.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rc = 1;
  try {
    rc = round_trip(epcomm::make_mpi_bootstrap(MPI_COMM_WORLD));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
