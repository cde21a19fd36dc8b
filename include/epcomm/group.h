// epcomm/group.h — Group: the ranks that create Buffers and run the operators together (a bootstrap plus
// the host of every rank). Created collectively; shared by everything built on it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epcomm {

namespace moe {
struct GroupContext;  // the operator family's communication context (epcomm/moe/distribute_v2.h)
}

// The communicator: a bootstrap plus what was learnt from it (rank, size, host of every rank).
// Created collectively; shared by the Buffers built on it.
class Group {
 public:
  static std::shared_ptr<Group> create(std::unique_ptr<Bootstrap> bootstrap);
  int rank() const { return rank_; }
  int size() const { return size_; }
  Bootstrap& bootstrap() { return *bootstrap_; }
  const std::vector<std::string>& hosts() const { return hosts_; }
  // Numbers the Buffers created on this group (equal on every rank, since creation is collective).
  uint64_t next_instance() { return next_instance_++; }
  // The dispatch_v2/combine_v2 context of this group (internal; created by its first such call).
  std::shared_ptr<moe::GroupContext>& moe_context() { return moe_context_; }

 private:
  Group() = default;
  std::unique_ptr<Bootstrap> bootstrap_;
  std::shared_ptr<moe::GroupContext> moe_context_;  // released before the bootstrap
  uint64_t next_instance_ = 0;
  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;
};

}  // namespace epcomm
