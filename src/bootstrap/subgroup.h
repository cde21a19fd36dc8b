// bootstrap/subgroup.h — a Bootstrap over some ranks of a parent Bootstrap (the ranks of one node).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epcomm {

// Ranks `members` (ascending parent ranks, this rank among them) as ranks 0..n-1. Every collective is a
// collective of the *parent*: all parent ranks must make the same sequence of calls with equal lengths at the
// same time (as when every node builds its own subgroup side by side). unique_id() is the parent's plus
// `suffix`. The parent must outlive the subgroup.
std::unique_ptr<Bootstrap> make_subgroup_bootstrap(Bootstrap& parent, std::vector<int> members,
                                                   const std::string& suffix);

}  // namespace epcomm
