// epcomm/bootstrap_mpi.h — a Bootstrap over an MPI communicator (library `epcomm_mpi`, CMake target
// epcomm::mpi, built when Open MPI is installed). This header carries no <mpi.h>: the communicator is taken
// by value as a template argument and passed on as its bytes.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <type_traits>

#include "epcomm/bootstrap.h"

namespace epcomm {

// Uses MPI_COMM_WORLD; calls MPI_Init_thread first when MPI is not initialized yet (and MPI_Finalize at exit
// then). Collective over all MPI ranks. Waits poll nonblocking MPI calls, so they end at `timeout` with
// Timeout.
std::unique_ptr<Bootstrap> make_mpi_bootstrap(std::chrono::milliseconds timeout = std::chrono::seconds(100));

namespace detail {
// `comm_bytes` points to an MPI_Comm of `comm_size` bytes (checked against the library's sizeof(MPI_Comm)).
std::unique_ptr<Bootstrap> make_mpi_bootstrap_from(const void* comm_bytes, std::size_t comm_size,
                                                   std::chrono::milliseconds timeout);
// An MPI_Comm is a handle: a pointer to an opaque struct (Open MPI) or an integer (MPICH). A pointer to a
// pointer, or any class type (a std::chrono duration), is not one.
template <class Comm>
inline constexpr bool is_mpi_comm_v =
    std::is_trivially_copyable_v<Comm> &&
    (std::is_integral_v<Comm> ||
     std::is_pointer_v<Comm>)&&!std::is_pointer_v<std::remove_cv_t<std::remove_pointer_t<Comm>>> &&
    !std::is_void_v<std::remove_cv_t<std::remove_pointer_t<Comm>>>;
}  // namespace detail

// Uses `comm` (pass the communicator itself: make_mpi_bootstrap(MPI_COMM_WORLD) or a communicator from
// MPI_Comm_split), which must stay valid while the Bootstrap lives. MPI must be initialized. Collective over
// that communicator. Throws Error(InvalidUsage) when MPI is not initialized or when `comm` is not the size of
// the library's MPI_Comm (epcomm was built against another MPI).
template <class Comm, std::enable_if_t<detail::is_mpi_comm_v<Comm>, int> = 0>
std::unique_ptr<Bootstrap> make_mpi_bootstrap(Comm comm,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(100)) {
  return detail::make_mpi_bootstrap_from(&comm, sizeof comm, timeout);
}

}  // namespace epcomm
