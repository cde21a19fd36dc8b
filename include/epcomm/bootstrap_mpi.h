// epcomm/bootstrap_mpi.h — a Bootstrap over an MPI communicator (library `epcomm_mpi`, built when Open MPI
// is installed). This header carries no <mpi.h>: the communicator is passed by address.
#pragma once

#include <chrono>
#include <memory>

#include "epcomm/bootstrap.h"

namespace epcomm {

// Uses MPI_COMM_WORLD; calls MPI_Init first when MPI is not initialized yet (and MPI_Finalize at exit then).
// Collective over all MPI ranks. Waits poll nonblocking MPI calls, so they end at `timeout` with Timeout.
std::unique_ptr<Bootstrap> make_mpi_bootstrap(std::chrono::milliseconds timeout = std::chrono::seconds(100));

// Uses the communicator at `mpi_comm` (an `MPI_Comm*`), which must stay valid while the Bootstrap lives.
// MPI must be initialized. Collective over that communicator.
std::unique_ptr<Bootstrap> make_mpi_bootstrap(const void* mpi_comm,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(100));

}  // namespace epcomm
