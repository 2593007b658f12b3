// The device's asynchronous events (ibv_get_async_event): a queue pair in the error state (QP fatal,
// access or request errors), a port that went down, a device that failed. One reader per device
// context, started by the first subscriber: a thread asleep in poll() on the context's async fd and
// an eventfd (never spinning), which acknowledges each event at once and hands a copy to every
// subscriber. Events nobody acts on (COMM_EST, PORT_ACTIVE, ...) are handed on too.
//
// Lock: `mu_` (leaf; held while a handler runs, so that unsubscribe() returns only once no handler
// of that subscriber runs or will run).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace hixl::verbs {

struct AsyncEvent {
  ibv_event_type type = IBV_EVENT_DEVICE_FATAL;
  uint32_t qp_num = 0;  // QP events
  int port = 0;         // port events
  // The event's name and its element: "IBV_EVENT_PORT_ERR (port 1)", "IBV_EVENT_QP_FATAL (QP 0x11)".
  std::string describe() const;
  bool is_qp_error() const;    // this QP cannot move data any more
  bool is_port_error() const;  // no QP on this port (or device) can
};

class AsyncEvents {
 public:
  using Handler = std::function<void(const AsyncEvent&)>;
  // device: for log messages.
  AsyncEvents(ibv_context* ctx, std::string device);
  ~AsyncEvents();  // stops the reader
  AsyncEvents(const AsyncEvents&) = delete;
  AsyncEvents& operator=(const AsyncEvents&) = delete;

  // Handlers run on the reader thread, one event at a time; they must not (un)subscribe.
  uint64_t subscribe(Handler h);
  void unsubscribe(uint64_t id);
  // Hands an event to the subscribers as if the device had reported it (tests of the subscribers).
  void dispatch(const AsyncEvent& ev);

 private:
  void run();

  ibv_context* ctx_;
  std::string device_;
  int stop_fd_ = -1;
  std::thread reader_;
  std::mutex mu_;
  std::map<uint64_t, Handler> handlers_;
  uint64_t next_id_ = 1;
};

}  // namespace hixl::verbs
