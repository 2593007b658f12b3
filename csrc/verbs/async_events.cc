#include "verbs/async_events.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <vector>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::verbs {

std::string AsyncEvent::describe() const {
  std::string s = ibv_event_type_str(type);
  if (s.rfind("IBV_EVENT_", 0) != 0) {  // rdma-core names them "local catastrophic error" etc.
    static const std::map<int, const char*> kNames = {
        {IBV_EVENT_CQ_ERR, "IBV_EVENT_CQ_ERR"},
        {IBV_EVENT_QP_FATAL, "IBV_EVENT_QP_FATAL"},
        {IBV_EVENT_QP_REQ_ERR, "IBV_EVENT_QP_REQ_ERR"},
        {IBV_EVENT_QP_ACCESS_ERR, "IBV_EVENT_QP_ACCESS_ERR"},
        {IBV_EVENT_COMM_EST, "IBV_EVENT_COMM_EST"},
        {IBV_EVENT_SQ_DRAINED, "IBV_EVENT_SQ_DRAINED"},
        {IBV_EVENT_PATH_MIG, "IBV_EVENT_PATH_MIG"},
        {IBV_EVENT_PATH_MIG_ERR, "IBV_EVENT_PATH_MIG_ERR"},
        {IBV_EVENT_DEVICE_FATAL, "IBV_EVENT_DEVICE_FATAL"},
        {IBV_EVENT_PORT_ACTIVE, "IBV_EVENT_PORT_ACTIVE"},
        {IBV_EVENT_PORT_ERR, "IBV_EVENT_PORT_ERR"},
        {IBV_EVENT_LID_CHANGE, "IBV_EVENT_LID_CHANGE"},
        {IBV_EVENT_PKEY_CHANGE, "IBV_EVENT_PKEY_CHANGE"},
        {IBV_EVENT_SM_CHANGE, "IBV_EVENT_SM_CHANGE"},
        {IBV_EVENT_SRQ_ERR, "IBV_EVENT_SRQ_ERR"},
        {IBV_EVENT_SRQ_LIMIT_REACHED, "IBV_EVENT_SRQ_LIMIT_REACHED"},
        {IBV_EVENT_QP_LAST_WQE_REACHED, "IBV_EVENT_QP_LAST_WQE_REACHED"},
        {IBV_EVENT_CLIENT_REREGISTER, "IBV_EVENT_CLIENT_REREGISTER"},
        {IBV_EVENT_GID_CHANGE, "IBV_EVENT_GID_CHANGE"},
        {IBV_EVENT_WQ_FATAL, "IBV_EVENT_WQ_FATAL"},
    };
    auto it = kNames.find(int(type));
    s = (it != kNames.end() ? std::string(it->second) : "IBV_EVENT_" + std::to_string(int(type))) + " (" + s + ")";
  }
  char elem[48];
  if (qp_num) std::snprintf(elem, sizeof elem, " on QP 0x%x", qp_num);
  else if (port) std::snprintf(elem, sizeof elem, " on port %d", port);
  else elem[0] = 0;
  return s + elem;
}

bool AsyncEvent::is_qp_error() const {
  return type == IBV_EVENT_QP_FATAL || type == IBV_EVENT_QP_REQ_ERR || type == IBV_EVENT_QP_ACCESS_ERR ||
         type == IBV_EVENT_PATH_MIG_ERR;
}

bool AsyncEvent::is_port_error() const { return type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_DEVICE_FATAL; }

AsyncEvents::AsyncEvents(ibv_context* ctx, std::string device) : ctx_(ctx), device_(std::move(device)) {
  const int flags = ::fcntl(ctx_->async_fd, F_GETFL);
  if (flags < 0 || ::fcntl(ctx_->async_fd, F_SETFL, flags | O_NONBLOCK) < 0)
    throw_errno(CallDesc("fcntl(O_NONBLOCK)").arg("device", device_).arg("async_fd", ctx_->async_fd).str(), errno);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) throw_errno("eventfd", errno);
  reader_ = std::thread([this] { run(); });
}

AsyncEvents::~AsyncEvents() {
  uint64_t one = 1;
  ssize_t n = ::write(stop_fd_, &one, sizeof one);
  (void)n;
  if (reader_.joinable()) reader_.join();
  ::close(stop_fd_);
}

uint64_t AsyncEvents::subscribe(Handler h) {
  std::lock_guard<std::mutex> g(mu_);
  handlers_[next_id_] = std::move(h);
  return next_id_++;
}

void AsyncEvents::unsubscribe(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  handlers_.erase(id);
}

void AsyncEvents::dispatch(const AsyncEvent& ev) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [id, h] : handlers_) {
    (void)id;
    try {
      h(ev);
    } catch (const std::exception& e) {
      log::warn("device " + device_ + ": handling " + ev.describe() + ": " + e.what());
    }
  }
}

void AsyncEvents::run() {
  pollfd pfds[2] = {{ctx_->async_fd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  for (;;) {
    int rc = ::poll(pfds, 2, -1);
    if (rc < 0) {
      if (errno == EINTR) continue;
      log::error("device " + device_ + ": poll on the async event fd: " + errno_str(errno) + "; no more async events");
      return;
    }
    if (pfds[1].revents) return;
    for (;;) {  // every event queued now
      ibv_async_event e{};
      if (ibv_get_async_event(ctx_, &e) != 0) break;  // EAGAIN: none left
      AsyncEvent ev;
      ev.type = e.event_type;
      if (ev.is_qp_error() || ev.type == IBV_EVENT_COMM_EST || ev.type == IBV_EVENT_SQ_DRAINED ||
          ev.type == IBV_EVENT_PATH_MIG || ev.type == IBV_EVENT_QP_LAST_WQE_REACHED)
        ev.qp_num = e.element.qp ? e.element.qp->qp_num : 0;
      else if (ev.type == IBV_EVENT_PORT_ERR || ev.type == IBV_EVENT_PORT_ACTIVE || ev.type == IBV_EVENT_LID_CHANGE ||
               ev.type == IBV_EVENT_PKEY_CHANGE || ev.type == IBV_EVENT_SM_CHANGE || ev.type == IBV_EVENT_GID_CHANGE ||
               ev.type == IBV_EVENT_CLIENT_REREGISTER)
        ev.port = e.element.port_num;
      ibv_ack_async_event(&e);
      (ev.is_qp_error() || ev.is_port_error() ? log::warn : log::info)("device " + device_ + ": async event " +
                                                                      ev.describe());
      dispatch(ev);
    }
  }
}

}  // namespace hixl::verbs
