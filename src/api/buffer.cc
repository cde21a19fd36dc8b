// api/buffer.cc — Buffer: construction, the communication thread, and the collective calls (validate on
// the caller's thread, run on the communication thread, return early when async_finish is set).
#include "api/buffer_impl.h"

#include <algorithm>
#include <cstring>

#include "api/arena_allocator.h"
#include "api/event_state.h"
#include "api/setup_log.h"
#include "common/check.h"
#include "common/env.h"
#include "common/log.h"
#include "routing/layout.h"
#include "tensor/output_arena.h"

namespace epcomm {

namespace {
std::atomic<int> g_num_threads{env::num_threads_default()};

// The output reserve a Buffer faults in at creation. In low-latency mode it is at least num_rdma_bytes,
// which get_low_latency_rdma_size_hint sizes for two calls' outputs: the first call's rows land on pages
// that exist, like every later call's. The ascend flavor's low-latency outputs live in its operator group's
// arena instead (docs/low-latency-ascend.md), which gets that reserve.
int64_t output_reserve_bytes(const BufferOptions& o) {
  const bool ll_here = o.low_latency_mode && o.flavor != "ascend";
  return std::max<int64_t>(
      ll_here ? std::max(o.num_output_reserve_bytes, o.num_rdma_bytes) : o.num_output_reserve_bytes, 0);
}

int64_t payload_bytes(const Payload& p) {
  return static_cast<int64_t>(p.data.nbytes() + (p.scales ? p.scales->nbytes() : 0));
}

}  // namespace

// ---- construction -------------------------------------------------------------------------------------

Buffer::Buffer(std::shared_ptr<Group> group, const BufferOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& b = *impl_;
  EPCOMM_CHECK(group != nullptr, "Buffer: group must not be null");
  b.group = group;
  b.options = options;
  const std::string pre = detail::cat("epcomm[rank ", group->rank(), "] Buffer: ");
  try {
    log::level();  // a bad EPCOMM_LOG fails here, not in a call
  } catch (const Error& e) {
    EPCOMM_THROW(InvalidUsage, pre, e.what());
  }
  EPCOMM_CHECK(options.num_combine_input_bytes >= 0, pre,
               "argument: num_combine_input_bytes: expected >= 0, got ", options.num_combine_input_bytes);
  EPCOMM_CHECK(options.num_dispatch_input_bytes >= 0, pre,
               "argument: num_dispatch_input_bytes: expected >= 0, got ", options.num_dispatch_input_bytes);
  EPCOMM_CHECK(options.num_output_reserve_bytes >= 0, pre,
               "argument: num_output_reserve_bytes: expected >= 0, got ", options.num_output_reserve_bytes);
  EPCOMM_CHECK(options.num_output_arena_bytes >= -1, pre,
               "argument: num_output_arena_bytes: expected >= 0, or -1 for auto, got ",
               options.num_output_arena_bytes);
  b.allocator = options.allocator ? options.allocator : default_allocator();

  detail::CommRequest req;
  req.pre = pre;
  req.segment_bytes = options.num_nvl_bytes;
  req.rdma_bytes = options.num_rdma_bytes;
  req.ranks_per_node = options.ranks_per_node ? options.ranks_per_node : env::ranks_per_node();
  req.timeout_s = options.timeout_s ? *options.timeout_s : env::timeout_s();
  req.combine_input_bytes = options.num_combine_input_bytes;
  req.dispatch_input_bytes = options.num_dispatch_input_bytes;
  // Every rank gets an output arena (the reserve is carved from it and mapped by the peers of its node).
  const int64_t reserve = output_reserve_bytes(options);
  req.arena = {detail::arena_bytes_for(options.num_output_arena_bytes), static_cast<size_t>(reserve)};
  req.arena_across_nodes = true;
  req.agree = {{"num_combine_input_bytes", options.num_combine_input_bytes},
               {"num_dispatch_input_bytes", options.num_dispatch_input_bytes},
               {"low_latency_mode", options.low_latency_mode}};
  req.agree_text = {{"flavor", options.flavor}};
  b.open(*group, req);
  if (auto a = b.transport->output_arena())
    b.allocator = std::make_shared<detail::ArenaAllocator>(a, b.allocator);
  if (reserve > 0 && !b.transport->output_arena()) b.allocator->reserve(static_cast<size_t>(reserve));
  b.start_comm_thread();
  try {
    b.run_warm_up([&] { detail::warm_up(*this, options); });
  } catch (...) {  // a peer that failed or vanished during creation: nothing of this Buffer survives
    destroy();
    throw;
  }
  b.counters.reset();  // the counters count the caller's calls only
  b.internode_base = internode_counters();
  EPCOMM_LOG(info, b.rank, "Buffer: ", b.describe());
}

std::string Buffer::Impl::describe() const {
  const auto arena = transport->output_arena();
  return detail::cat(
      detail::describe_ranks(rank, node_of_rank, *transport, network.get()), "; segment ",
      detail::bytes_str(segment_bytes),
      num_nodes > 1 ? detail::cat(", rdma lanes ", detail::bytes_str(options.num_rdma_bytes)) : std::string(),
      "; output arena ", arena ? detail::bytes_str(static_cast<int64_t>(arena->bytes())) : "none",
      ", reserve ", detail::bytes_str(output_reserve_bytes(options)), "; combine input ",
      detail::bytes_str(options.num_combine_input_bytes), ", dispatch input ",
      detail::bytes_str(options.num_dispatch_input_bytes), "; receive order ",
      receive_order_name(options.receive_order), "; timeout ", timeout_s, " s; copy threads ",
      Buffer::num_threads());
}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (...) {
  }
}

void Buffer::destroy() {
  if (!impl_ || impl_->destroyed) return;
  impl_->stop_comm_thread();
  impl_->close();
  impl_->alive.reset();
  impl_->destroyed = true;
}

int Buffer::rank() const {
  return impl_->rank;
}
int Buffer::num_ranks() const {
  return impl_->num_ranks;
}
Buffer::InternodeCounters Buffer::internode_counters() const {
  InternodeCounters c;
  if (!impl_->inter || !impl_->network) return c;
  c.rows = static_cast<int64_t>(impl_->inter->rows_sent);
  c.row_bytes = static_cast<int64_t>(impl_->inter->row_bytes_sent);
  NetworkCounters n = impl_->network->counters();
  c.network_bytes = static_cast<int64_t>(n.payload_bytes);
  c.network_writes = static_cast<int64_t>(n.writes);
  const InternodeCounters& w = impl_->internode_base;  // not the creation's warm-up
  c.rows -= w.rows;
  c.row_bytes -= w.row_bytes;
  c.network_bytes -= w.network_bytes;
  c.network_writes -= w.network_writes;
  return c;
}

double Buffer::measure_link_gbps(int64_t bytes, int iterations) {
  Impl& b = *impl_;
  b.check_usable("measure_link_gbps");
  EPCOMM_CHECK(bytes > 0 && iterations > 0, "measure_link_gbps: bytes and iterations must be positive, got ",
               bytes, " and ", iterations);
  if (!b.network) return 0.0;
  return b.network->measure_link_gbps(b.group->bootstrap(), static_cast<size_t>(bytes), iterations);
}

int Buffer::num_nodes() const {
  return impl_->num_nodes;
}
int Buffer::node_of(int r) const {
  EPCOMM_CHECK(r >= 0 && r < impl_->num_ranks, "node_of: rank ", r, " is out of range [0, ", impl_->num_ranks,
               ")");
  return impl_->node_of_rank[r];
}
ReceiveOrder Buffer::receive_order() const {
  return impl_->options.receive_order;
}
double Buffer::timeout_s() const {
  return impl_->timeout_s;
}
int64_t Buffer::num_nvl_bytes() const {
  return impl_->segment_bytes;
}
int64_t Buffer::num_combine_input_bytes() const {
  return static_cast<int64_t>(impl_->segment.combine_input_bytes);
}

uint8_t* Buffer::Impl::input_area() const {
  return own_segment() + segment.combine_input_offset;
}

uint8_t* Buffer::Impl::dispatch_input_area() const {
  return own_segment() + segment.dispatch_input_offset;
}

int64_t Buffer::num_output_arena_bytes() const {
  const auto arena = impl_->transport ? impl_->transport->output_arena() : nullptr;
  return arena ? static_cast<int64_t>(arena->bytes()) : 0;
}

int64_t Buffer::num_dispatch_input_bytes() const {
  return static_cast<int64_t>(impl_->segment.dispatch_input_bytes);
}

// Empty when rows x cols elements of dtype fit in `area` bytes, else the bytes they need ("more than 2^63"
// when that overflows).
static std::string area_need(int64_t rows, int64_t cols, DType dtype, int64_t area) {
  int64_t row = 0, bytes = 0;
  if (__builtin_mul_overflow(cols, static_cast<int64_t>(dtype_size(dtype)), &row) ||
      __builtin_mul_overflow(rows, row, &bytes))
    return "more than 2^63";
  return bytes <= area ? std::string() : std::to_string(bytes);
}

Tensor Buffer::get_dispatch_input(int64_t num_tokens, int64_t hidden, DType dtype) {
  Impl& b = *impl_;
  b.check_usable("get_dispatch_input");
  const std::string pre = detail::cat("epcomm[rank ", b.rank, "] get_dispatch_input: ");
  EPCOMM_CHECK(dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32, pre,
               "argument: dtype: expected bf16, f16 or f32, got ", dtype_name(dtype));
  EPCOMM_CHECK(num_tokens >= 0, pre, "argument: num_tokens: expected >= 0, got ", num_tokens);
  EPCOMM_CHECK(hidden >= 1, pre, "argument: hidden: expected >= 1, got ", hidden);
  const std::string need = area_need(num_tokens, hidden, dtype, b.dispatch_input_bytes());
  EPCOMM_CHECK(
      need.empty(), pre, "capacity: ", num_tokens, " tokens x ", hidden, " ", dtype_name(dtype), " need ",
      need, " bytes, but num_dispatch_input_bytes = ", b.dispatch_input_bytes(),
      b.dispatch_input_bytes() ? "" : " (BufferOptions::num_dispatch_input_bytes sets the shared area)");
  return Tensor::wrap(b.dispatch_input_area(), dtype, {num_tokens, hidden}, {},
                      std::shared_ptr<void>(b.alive, b.dispatch_input_area()));
}

Buffer::CopyCounters Buffer::copy_counters() const {
  const engine::CopyCounters& c = impl_->counters;
  CopyCounters r;
  r.dispatch_staged_tokens = c.dispatch_staged_tokens.load(std::memory_order_relaxed);
  r.dispatch_in_place_tokens = c.dispatch_in_place_tokens.load(std::memory_order_relaxed);
  r.dispatch_pushed_tokens = c.dispatch_pushed_tokens.load(std::memory_order_relaxed);
  r.combine_copied_rows = c.combine_copied_rows.load(std::memory_order_relaxed);
  r.combine_in_place_rows = c.combine_in_place_rows.load(std::memory_order_relaxed);
  r.combine_direct_tokens = c.combine_direct_tokens.load(std::memory_order_relaxed);
  r.combine_shared_tokens = c.combine_shared_tokens.load(std::memory_order_relaxed);
  return r;
}

Tensor Buffer::get_combine_input(const Handle& handle, DType dtype, int64_t hidden) {
  Impl& b = *impl_;
  b.check_usable("get_combine_input");
  const std::string pre = detail::cat("epcomm[rank ", b.rank, "] get_combine_input: ");
  const Handle::Impl& hd = handle.impl();
  EPCOMM_CHECK(dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32, pre,
               "argument: dtype: expected bf16, f16 or f32, got ", dtype_name(dtype));
  EPCOMM_CHECK(hidden >= 0, pre, "argument: hidden: expected >= 0, got ", hidden);
  const int64_t H = hidden ? hidden : hd.hidden;
  const std::string need = area_need(hd.num_rows, H, dtype, b.input_bytes());
  EPCOMM_CHECK(need.empty(), pre, "capacity: ", hd.num_rows, " rows x ", H, " ", dtype_name(dtype), " need ",
               need, " bytes, but num_combine_input_bytes = ", b.input_bytes(),
               b.input_bytes() ? "" : " (BufferOptions::num_combine_input_bytes sets the shared area)");
  // The owner is the Buffer's liveness token (aliased): a view, never a copy, for wrappers that copy
  // ownerless memory (the torch bridge); the area itself lives until destroy().
  return Tensor::wrap(b.input_area(), dtype, {hd.num_rows, H}, {},
                      std::shared_ptr<void>(b.alive, b.input_area()));
}

int Buffer::num_threads() {
  return g_num_threads.load();
}
void Buffer::set_num_threads(int n) {
  EPCOMM_CHECK(n >= 0, "Buffer.set_num_threads: expected >= 0, got ", n);
  g_num_threads = n;
}
Config Buffer::get_dispatch_config(int num_ranks) {
  EPCOMM_CHECK(num_ranks >= 1, "get_dispatch_config: num_ranks: expected >= 1, got ", num_ranks);
  Config c;
  c.num_threads = num_threads();
  return c;
}
Config Buffer::get_combine_config(int num_ranks) {
  return get_dispatch_config(num_ranks);
}

// ---- communication thread ----------------------------------------------------------------------------

void Buffer::Impl::start_comm_thread() {
  comm = std::thread([this] {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(qm);
        qcv.wait(lk, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;  // stop requested and drained
        task = std::move(queue.front());
      }
      task();
      // Popped only now: an empty queue means this thread is idle (see run_inline_when_idle).
      std::lock_guard<std::mutex> lk(qm);
      queue.pop_front();
    }
  });
}

void Buffer::Impl::stop_comm_thread() noexcept {
  {
    std::lock_guard<std::mutex> lk(qm);
    stop = true;
  }
  qcv.notify_all();
  if (comm.joinable()) comm.join();
}

void Buffer::Impl::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(qm);
    queue.push_back(std::move(task));
  }
  qcv.notify_one();
}

std::string Buffer::Impl::prefix(const char* op, uint64_t s) const {
  return detail::cat("epcomm[rank ", rank, "] ", op, "#", shown_seq(s), warming_up ? " (warm-up)" : "", ": ");
}

void Buffer::Impl::check_usable(const char* op) {
  EPCOMM_CHECK(!destroyed, "epcomm[rank ", rank, "] ", op, ": argument: the Buffer was destroyed");
  std::string f = failed();
  if (!f.empty()) EPCOMM_THROW(Aborted, "epcomm[rank ", rank, "] ", op, ": the Buffer failed earlier: ", f);
}

// A synchronous call runs on the caller's thread when the communication thread has nothing queued or
// running: order is kept (nothing earlier is pending, and the caller issues nothing else until it
// returns), and the two hand-offs (a condition-variable wake-up each way, tens of µs on a busy host)
// disappear from small calls.
static bool comm_thread_idle(Buffer::Impl& b) {
  std::lock_guard<std::mutex> lk(b.qm);
  return b.queue.empty();
}

// Runs `body` for sequence number `s` on the communication thread (on the caller's thread when `sync` and
// the communication thread is idle), under the failure policy of detail::run_call. A call this rank cannot
// run (`failed_message` set by validation, or a failed previous_event) publishes a failed header instead.
std::shared_ptr<detail::EventState> launch(Buffer::Impl& b, uint64_t s, engine::OpKind kind,
                                           std::optional<EventOverlap> previous, std::string failed_message,
                                           bool sync, OpBody body, std::shared_ptr<detail::EventState> st) {
  if (!st) st = std::make_shared<detail::EventState>();
  auto task = [&b, s, kind, previous, failed_message, body, st]() mutable {
    engine::OpContext ctx = b.op_context(s, kind, b.timeout_s);
    try {
      detail::run_call(b, ctx, [&](const std::function<void()>& moving) {
        if (previous && failed_message.empty()) {
          try {
            previous->wait();
          } catch (const std::exception& e) {
            failed_message = detail::cat(ctx.prefix(), "previous_event failed: ", e.what());
          }
        }
        if (!failed_message.empty()) {
          ctx.publish_failed_header(kind, failed_message);
          throw Error(ErrorCode::Aborted, failed_message);
        }
        const bool debug = log::enabled(log::Level::debug);
        const auto t0 = debug ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
        const detail::CounterSnapshot before =
            debug ? detail::snapshot(b.counters) : detail::CounterSnapshot{};
        const int64_t bytes = body(ctx, [&] {
          moving();
          st->shapes_known();
        });
        if (debug)
          EPCOMM_LOG(debug, -1, ctx.prefix(), detail::describe_path(before, detail::snapshot(b.counters)),
                     "; ", detail::bytes_str(bytes), " of outputs; ", detail::elapsed_ms(t0));
      });
      st->complete(nullptr);
    } catch (...) {
      st->complete(std::current_exception());
    }
  };
  if (sync && comm_thread_idle(b))
    task();
  else
    b.enqueue(std::move(task));
  return st;
}

// ---- get_dispatch_layout -------------------------------------------------------------------------------

LayoutResult Buffer::get_dispatch_layout(const Tensor& topk_idx, int num_experts,
                                         std::optional<EventOverlap> previous_event, bool, bool) {
  Impl& b = *impl_;
  b.check_usable("get_dispatch_layout");
  if (previous_event) previous_event->wait();
  const std::string pre = detail::cat("epcomm[rank ", b.rank, "] get_dispatch_layout: ");
  try {
    EPCOMM_CHECK(topk_idx.defined() && topk_idx.dim() == 2,
                 "argument: topk_idx: expected a 2-D [num_tokens, num_topk] tensor, got ",
                 topk_idx.defined() ? shape_str(topk_idx.shape()) : std::string("None"));
    EPCOMM_CHECK(topk_idx.dtype() == DType::i64 || topk_idx.dtype() == DType::i32,
                 "argument: topk_idx: dtype ", dtype_name(topk_idx.dtype()), ", expected i64 or i32");
    EPCOMM_CHECK(topk_idx.is_contiguous(), "argument: topk_idx must be contiguous");
    EPCOMM_CHECK(num_experts >= 1 && num_experts % b.num_ranks == 0, "argument: num_experts = ", num_experts,
                 " must be a positive multiple of the number of ranks ", b.num_ranks);
  } catch (const Error& e) {
    throw Error(e.code(), pre + e.what());
  }
  const int64_t T = topk_idx.size(0);
  const int K = static_cast<int>(topk_idx.size(1));
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  try {
    routing::normalize_topk_ids(topk_idx.data(), topk_idx.dtype() == DType::i64, T, K, num_experts,
                                ids.data());
  } catch (const Error& e) {
    throw Error(e.code(), pre + e.what());
  }
  routing::ExpertMap map{num_experts, b.num_ranks, num_experts / b.num_ranks};
  auto lay = routing::compute_layout(ids.data(), T, K, map, b.node_of_rank, b.num_nodes);
  LayoutResult r;
  Allocator* a = b.allocator.get();
  r.num_tokens_per_rank = a->allocate(DType::i32, {b.num_ranks});
  std::copy(lay.num_tokens_per_rank.begin(), lay.num_tokens_per_rank.end(),
            r.num_tokens_per_rank.data_as<int32_t>());
  if (b.num_nodes > 1) {
    r.num_tokens_per_rdma_rank = a->allocate(DType::i32, {b.num_nodes});
    std::copy(lay.num_tokens_per_node.begin(), lay.num_tokens_per_node.end(),
              r.num_tokens_per_rdma_rank->data_as<int32_t>());
  }
  r.num_tokens_per_expert = a->allocate(DType::i32, {num_experts});
  std::copy(lay.num_tokens_per_expert.begin(), lay.num_tokens_per_expert.end(),
            r.num_tokens_per_expert.data_as<int32_t>());
  r.is_token_in_rank = a->allocate(DType::boolean, {T, b.num_ranks});
  std::copy(lay.is_token_in_rank.begin(), lay.is_token_in_rank.end(), r.is_token_in_rank.data_as<uint8_t>());
  return r;
}

// ---- dispatch ------------------------------------------------------------------------------------------

static void allocate_dispatch_outputs(Buffer::Impl& b, const engine::DispatchInput& in,
                                      engine::DispatchOutput& out) {
  const int64_t rows = in.cached ? in.handle->num_rows : in.num_worst_tokens;
  const auto& f = in.format;
  Allocator& a = *b.allocator;
  out.recv_x.data = a.allocate(f.data_dtype, {rows, f.data_cols});
  if (f.scale_row_bytes) {
    using SS = engine::RowFormat::ScaleShape;
    Shape ss = f.scale_shape == SS::vec   ? Shape{rows}
               : f.scale_shape == SS::mat ? Shape{rows, f.scale_cols}
                                          : Shape{rows * f.scale_cols};
    out.recv_x.scales = a.allocate(f.scale_dtype, ss);
  }
  if (in.cached) return;
  if (in.num_topk > 0) {
    out.recv_topk_idx = a.allocate(in.idx_dtype, {rows, in.num_topk});
    out.recv_topk_weights = a.allocate(DType::f32, {rows, in.num_topk});
  }
  out.handle->recv_src_rank = a.allocate(DType::i32, {rows});
  out.handle->recv_src_token = a.allocate(DType::i32, {rows});
  out.handle->recv_src_slot = a.allocate(DType::i32, {rows});
}

DispatchResult Buffer::dispatch(const DispatchArgs& a) {
  Impl& b = *impl_;
  b.check_usable("dispatch");
  const uint64_t s = ++b.seq;
  const bool cached = a.handle != nullptr;
  const char* opname = cached ? "dispatch(cached)" : "dispatch";
  auto in = std::make_shared<engine::DispatchInput>();
  ReceiveOrder order = b.options.receive_order;
  std::optional<Error> verr;
  try {
    prepare_dispatch(b, a, *in, order);
    check_worst_case_outputs(*in);
  } catch (const Error& e) {
    verr = Error(e.code(), b.prefix(opname, s) + e.what());
  }
  auto out = std::make_shared<engine::DispatchOutput>();
  // Outputs whose shapes are known now are allocated here, so that async_finish can return at once.
  const bool early = !verr && (cached || in->num_worst_tokens > 0);
  if (!verr) {
    in->allocator = b.allocator.get();
    in->poison = b.poison;
    in->workers = &b.workers;
    in->counters = &b.counters;
    if (!cached) {
      out->handle = std::make_shared<Handle::Impl>();
      out->handle->buffer_key = &b;
      out->handle->buffer_alive = b.alive;
    }
    if (early) allocate_dispatch_outputs(b, *in, *out);
  }
  auto st =
      launch(b, s, cached ? engine::OpKind::cached_dispatch : engine::OpKind::dispatch, a.previous_event,
             verr ? std::string(verr->what()) : std::string(), !a.async_finish || verr.has_value(),
             [in, out](engine::OpContext& ctx, const std::function<void()>& on_shapes) {
               engine::run_dispatch(ctx, *in, *out, on_shapes);
               return payload_bytes(out->recv_x);
             });
  if (verr) {
    st->wait();
    throw *verr;
  }
  if (!cached)
    out->handle->wait_shapes = [st] {
      if (auto e = st->wait_shapes()) std::rethrow_exception(e);
    };
  if (!a.async_finish) {
    if (auto e = st->wait()) std::rethrow_exception(e);
  } else if (!early) {
    if (auto e = st->wait_shapes()) std::rethrow_exception(e);
  }
  DispatchResult r;
  r.recv_x = out->recv_x;
  r.recv_topk_idx = out->recv_topk_idx;
  r.recv_topk_weights = out->recv_topk_weights;
  if (!cached) {
    // With async_finish and outputs allocated up front the communication thread may still be writing
    // out->list: that result has an empty list (never a copy taken while it is written).
    if (a.async_finish && early)
      r.num_recv_tokens_per_expert_list = std::vector<int64_t>{};
    else
      r.num_recv_tokens_per_expert_list = out->list;
    r.handle = std::make_shared<const Handle>(out->handle);
  }
  r.event = EventOverlap(st);
  return r;
}

void Buffer::fail_call(const std::string& op, ErrorCode code, const std::string& message) {
  Impl& b = *impl_;
  engine::OpKind kind = engine::OpKind::dispatch;
  const char* opname = "dispatch";
  if (op == "cached_dispatch") {
    kind = engine::OpKind::cached_dispatch;
    opname = "dispatch(cached)";
  } else if (op == "combine") {
    kind = engine::OpKind::combine;
    opname = "combine";
  } else if (op == "low_latency_dispatch" || op == "low_latency_combine") {
    kind = op == "low_latency_dispatch" ? engine::OpKind::low_latency_dispatch
                                        : engine::OpKind::low_latency_combine;
    opname = engine::op_kind_name(kind);
  } else {
    EPCOMM_CHECK(
        op == "dispatch", "epcomm[rank ", b.rank,
        "] fail_call: argument: op: expected dispatch, cached_dispatch, combine, low_latency_dispatch "
        "or low_latency_combine, got '",
        op, "'");
  }
  b.check_usable(opname);
  const uint64_t s = ++b.seq;
  const Error error(code, b.prefix(opname, s) + message);
  const bool low_latency =
      kind == engine::OpKind::low_latency_dispatch || kind == engine::OpKind::low_latency_combine;
  if (low_latency && fail_low_latency_among_live(b, s, kind, error.what())) throw error;
  auto st = launch(b, s, kind, std::nullopt, error.what(), true,
                   [](engine::OpContext&, const std::function<void()>&) { return int64_t{0}; });
  st->wait();
  throw error;
}

// ---- combine -------------------------------------------------------------------------------------------

std::shared_ptr<detail::EventState> launch_combine(Buffer::Impl& b, uint64_t s, engine::OpKind kind,
                                                   std::optional<EventOverlap> previous,
                                                   const std::optional<Error>& verr, bool async_finish,
                                                   std::shared_ptr<engine::CombineInput> in,
                                                   std::shared_ptr<engine::CombineOutput> out) {
  auto st = launch(b, s, kind, std::move(previous), verr ? std::string(verr->what()) : std::string(),
                   !async_finish || verr.has_value(),
                   [in, out](engine::OpContext& ctx, const std::function<void()>& on_shapes) {
                     engine::run_combine(ctx, *in, *out, on_shapes);
                     return static_cast<int64_t>(out->combined_x.nbytes());
                   });
  await_launch(st, verr, async_finish);
  return st;
}

void await_launch(const std::shared_ptr<detail::EventState>& st, const std::optional<Error>& verr,
                  bool async_finish) {
  if (verr) {
    st->wait();
    throw *verr;
  }
  if (!async_finish)
    if (auto e = st->wait()) std::rethrow_exception(e);
}

CombineResult Buffer::combine(const CombineArgs& a) {
  Impl& b = *impl_;
  b.check_usable("combine");
  const uint64_t s = ++b.seq;
  auto in = std::make_shared<engine::CombineInput>();
  auto out = std::make_shared<engine::CombineOutput>();
  std::optional<Error> verr;
  try {
    prepare_combine(b, a, *in);
  } catch (const Error& e) {
    verr = Error(e.code(), b.prefix("combine", s) + e.what());
  }
  if (!verr) {
    const Handle::Impl& hd = *in->handle;
    in->poison = b.poison;
    in->workers = &b.workers;
    in->counters = &b.counters;
    out->combined_x = b.allocator->allocate(in->dtype, {hd.num_tokens, in->hidden});
    if (hd.order == ReceiveOrder::expert_major || in->has_recv_weights)
      out->combined_topk_weights = b.allocator->allocate(DType::f32, {hd.num_tokens, hd.num_topk});
  }
  auto st = launch_combine(b, s, engine::OpKind::combine, a.previous_event, verr, a.async_finish, in, out);
  CombineResult r;
  r.combined_x = out->combined_x;
  r.combined_topk_weights = out->combined_topk_weights;
  r.event = EventOverlap(st);
  return r;
}

}  // namespace epcomm
