// epcomm/event.h — EventOverlap: completion of an operation running on a Buffer's communication thread.
// Copyable handle to shared state; wait() may be called from any thread, any number of times.
#pragma once

#include <exception>
#include <memory>

namespace epcomm {

namespace detail {
struct EventState;
}

class EventOverlap {
 public:
  EventOverlap();  // a completed event
  explicit EventOverlap(std::shared_ptr<detail::EventState> state);

  // Blocks until the operation completed; rethrows its error (every time it is called).
  void wait() const;
  void current_stream_wait() const { wait(); }
  bool is_complete() const;
  // The failure, or nullptr; only meaningful once is_complete().
  std::exception_ptr error() const;

  const std::shared_ptr<detail::EventState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::EventState> state_;
};

}  // namespace epcomm
