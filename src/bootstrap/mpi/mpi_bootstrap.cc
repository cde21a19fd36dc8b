// bootstrap/mpi/mpi_bootstrap.cc — Bootstrap over MPI: nonblocking collectives polled against a deadline,
// so a missing rank ends in Timeout instead of a hang. The only file that includes <mpi.h>.
#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/check.h"
#include "epcomm/bootstrap_mpi.h"

namespace epcomm {
namespace {

class MpiBootstrap final : public Bootstrap {
 public:
  MpiBootstrap(MPI_Comm comm, std::chrono::milliseconds timeout) : comm_(comm), timeout_(timeout) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // A host-unique id equal on all ranks: rank 0's pid and clock, broadcast.
    long long id[2] = {static_cast<long long>(getpid()),
                       static_cast<long long>(std::chrono::steady_clock::now().time_since_epoch().count())};
    MPI_Request req;
    MPI_Ibcast(id, 2, MPI_LONG_LONG, 0, comm_, &req);
    complete(req, "bootstrap broadcast");
    unique_id_ = detail::cat("mpi-", id[0], "-", id[1] % 1000000007);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& unique_id() const override { return unique_id_; }

  std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) override {
    // Every rank must contribute the same length: check it first, so a mismatch is an error, not garbage.
    long long mine = static_cast<long long>(bytes.size());
    std::vector<long long> lens(size_);
    MPI_Request req;
    MPI_Iallgather(&mine, 1, MPI_LONG_LONG, lens.data(), 1, MPI_LONG_LONG, comm_, &req);
    complete(req, "bootstrap all_gather");
    for (int r = 0; r < size_; ++r)
      EPCOMM_CHECK(lens[r] == mine, "bootstrap all_gather: rank ", r, " contributed ", lens[r],
                   " bytes but rank ", rank_, " contributed ", mine);
    std::vector<std::byte> out(bytes.size() * size_);
    MPI_Iallgather(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, out.data(),
                   static_cast<int>(bytes.size()), MPI_BYTE, comm_, &req);
    complete(req, "bootstrap all_gather");
    return out;
  }

  void barrier() override {
    MPI_Request req;
    MPI_Ibarrier(comm_, &req);
    complete(req, "bootstrap barrier");
  }

 private:
  // Polls `req` until it completes; sleeps between polls so waiting ranks leave the cores to the others.
  void complete(MPI_Request& req, const char* what) {
    auto deadline = std::chrono::steady_clock::now() + timeout_;
    int done = 0;
    for (int spins = 0;; ++spins) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        MPI_Cancel(&req);
        EPCOMM_THROW(Timeout, what, " over MPI (rank ", rank_, " of ", size_, "): not complete after ",
                     timeout_.count() / 1000.0, " s; a rank did not make the same call");
      }
      if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  std::string unique_id_;
};

}  // namespace

std::unique_ptr<Bootstrap> make_mpi_bootstrap(std::chrono::milliseconds timeout) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    });
  }
  return std::make_unique<MpiBootstrap>(MPI_COMM_WORLD, timeout);
}

namespace detail {

std::unique_ptr<Bootstrap> make_mpi_bootstrap_from(const void* comm_bytes, std::size_t comm_size,
                                                   std::chrono::milliseconds timeout) {
  EPCOMM_CHECK(comm_bytes != nullptr, "make_mpi_bootstrap: comm: expected an MPI_Comm, got a null pointer");
  EPCOMM_CHECK(comm_size == sizeof(MPI_Comm), "make_mpi_bootstrap: comm: expected an MPI_Comm of ",
               sizeof(MPI_Comm), " bytes (the MPI epcomm was built with), got ", comm_size,
               " bytes: pass the communicator itself, built with the same MPI");
  int initialized = 0;
  MPI_Initialized(&initialized);
  EPCOMM_CHECK(initialized,
               "make_mpi_bootstrap: MPI is not initialized (call MPI_Init first, or use the overload without "
               "a communicator)");
  MPI_Comm comm;
  std::memcpy(&comm, comm_bytes, sizeof comm);
  EPCOMM_CHECK(comm != MPI_COMM_NULL, "make_mpi_bootstrap: comm: expected a communicator, got MPI_COMM_NULL");
  return std::make_unique<MpiBootstrap>(comm, timeout);
}

}  // namespace detail

}  // namespace epcomm
