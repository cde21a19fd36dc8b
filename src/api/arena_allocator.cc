// api/arena_allocator.cc — the output-arena size option.
#include "api/arena_allocator.h"

#include <unistd.h>

#include <algorithm>

#include "common/env.h"

namespace epcomm::detail {

size_t arena_bytes_for(int64_t option) {
  int64_t n = option >= 0 ? option : env::output_arena_bytes();
  if (n < 0) n = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  return static_cast<size_t>(std::max<int64_t>(n, 0));
}

}  // namespace epcomm::detail
