// bootstrap/subgroup.cc — a view of a parent Bootstrap restricted to some of its ranks.
#include "bootstrap/subgroup.h"

#include <algorithm>

#include "common/check.h"

namespace epcomm {
namespace {

class SubgroupBootstrap final : public Bootstrap {
 public:
  SubgroupBootstrap(Bootstrap& parent, std::vector<int> members, const std::string& suffix)
      : parent_(parent), members_(std::move(members)), id_(parent.unique_id() + suffix) {
    auto it = std::find(members_.begin(), members_.end(), parent.rank());
    EPCOMM_CHECK(it != members_.end(), "subgroup: parent rank ", parent.rank(), " is not a member");
    rank_ = static_cast<int>(it - members_.begin());
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) override {
    std::vector<std::byte> all = parent_.all_gather(bytes);
    std::vector<std::byte> mine(members_.size() * bytes.size());
    for (size_t i = 0; i < members_.size(); ++i)
      std::copy_n(all.begin() + static_cast<ptrdiff_t>(members_[i] * bytes.size()), bytes.size(),
                  mine.begin() + static_cast<ptrdiff_t>(i * bytes.size()));
    return mine;
  }
  void barrier() override { parent_.barrier(); }
  const std::string& unique_id() const override { return id_; }

 private:
  Bootstrap& parent_;
  std::vector<int> members_;
  std::string id_;
  int rank_ = 0;
};

}  // namespace

std::unique_ptr<Bootstrap> make_subgroup_bootstrap(Bootstrap& parent, std::vector<int> members,
                                                   const std::string& suffix) {
  return std::make_unique<SubgroupBootstrap>(parent, std::move(members), suffix);
}

}  // namespace epcomm
