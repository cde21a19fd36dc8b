// engine/combine_direct.h — direct combine (docs/design.md, "One collective call", step 4): used when
// every header of a combine says kReadRowsInPlace.
#pragma once

#include "engine/combine.h"
#include "engine/op_context.h"

namespace epcomm::engine {

// Every origin reduces its tokens from the copies in their holders' x (handle send_rows), in canonical
// order; ranks done early help reduce other origins' tokens. Call after the header exchange.
void run_direct(OpContext& ctx, const CombineInput& in, CombineOutput& out);

}  // namespace epcomm::engine
