// api/event.cc — EventOverlap and its shared completion state.
#include "api/event_state.h"

namespace epcomm {

EventOverlap::EventOverlap() : state_(std::make_shared<detail::EventState>()) { state_->complete(nullptr); }
EventOverlap::EventOverlap(std::shared_ptr<detail::EventState> state) : state_(std::move(state)) {}

void EventOverlap::wait() const {
  if (!state_) return;
  std::exception_ptr e = state_->wait();
  if (e) std::rethrow_exception(e);
}

bool EventOverlap::is_complete() const { return !state_ || state_->is_complete(); }

std::exception_ptr EventOverlap::error() const { return state_ ? state_->error() : nullptr; }

}  // namespace epcomm
