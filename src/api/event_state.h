// api/event_state.h — completion state shared by an operation on the communication thread and the
// EventOverlap handed to the caller; also signals "output shapes known" for asynchronous calls.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "epcomm/event.h"

namespace epcomm::detail {

struct EventState {
  void complete(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(m);
    done = shapes = sent = true;
    err = e;
    cv.notify_all();
  }
  void shapes_known() {
    std::lock_guard<std::mutex> lk(m);
    shapes = true;
    cv.notify_all();
  }
  std::exception_ptr wait() { return wait_until(&EventState::done); }
  // A dispatch sent every row of this rank (low-latency return_recv_hook).
  void rows_sent() {
    std::lock_guard<std::mutex> lk(m);
    sent = true;
    cv.notify_all();
  }
  // Waits until this rank's rows are sent or the operation ended; returns the error if it ended with one.
  std::exception_ptr wait_sent() { return wait_until(&EventState::sent); }
  // Waits until shapes are known or the operation ended; returns the error if it ended with one.
  std::exception_ptr wait_shapes() { return wait_until(&EventState::shapes); }
  // Waits until `flag` is set (complete() sets every flag); the error once the operation ended with one.
  // No deadline of its own: the call that sets the flags runs under the engine's deadlines.
  std::exception_ptr wait_until(bool EventState::*flag) {
    std::unique_lock<std::mutex> lk(m);
    cv.wait(lk, [&] { return this->*flag; });
    return done ? err : nullptr;
  }
  bool is_complete() {
    std::lock_guard<std::mutex> lk(m);
    return done;
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> lk(m);
    return err;
  }

  std::mutex m;
  std::condition_variable cv;
  bool done = false, shapes = false, sent = false;
  std::exception_ptr err;
};

}  // namespace epcomm::detail
