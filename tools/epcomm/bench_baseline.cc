// tools/epcomm/bench_baseline.cc — the MPI_Alltoallv baseline (built only when MPI is found; otherwise
// bench_baseline_nompi.cc). Plain user code: index lists first, then whole-row copies, one MPI call per
// array.
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "bench_baseline.h"
#include "epcomm/bootstrap_mpi.h"
#include "epcomm/error.h"
#include "numerics.h"

namespace epcomm::cli {

namespace {

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS)
    throw std::runtime_error(std::string("baseline: ") + what + " failed (MPI error " + std::to_string(rc) +
                             ")");
}

// MPI counts and displacements are int: rows fit (one row type per array), checked anyway.
int as_int(int64_t v, const char* what) {
  if (v < 0 || v > INT32_MAX)
    throw std::runtime_error(std::string("baseline: ") + what + " exceeds MPI's int");
  return static_cast<int>(v);
}

// A contiguous MPI datatype of `bytes` bytes (one row of an array), freed with the baseline.
MPI_Datatype row_type(int64_t bytes) {
  MPI_Datatype t;
  check_mpi(MPI_Type_contiguous(as_int(bytes, "row size"), MPI_BYTE, &t), "MPI_Type_contiguous");
  check_mpi(MPI_Type_commit(&t), "MPI_Type_commit");
  return t;
}

}  // namespace

bool have_mpi() {
  return true;
}

std::unique_ptr<Bootstrap> make_world_bootstrap(std::chrono::milliseconds timeout) {
  return make_mpi_bootstrap(timeout);
}

struct AlltoallvBaseline::State {
  BaselineInputs in;
  int R = 1, L = 1, K = 1;
  int64_t T = 0, row_bytes = 0;
  MPI_Datatype x_type{}, idx_type{}, w_type{};

  // Plan, recomputed by every dispatch from the routing (as user code would).
  // send_count[d * (L + 1) + j]: (token, slot) pairs for local expert j of rank d; [.. + L]: rows to d.
  std::vector<int64_t> send_count, recv_count;
  std::vector<int> sc, sd, rc, rd;  // MPI counts and displacements, in rows
  std::vector<int64_t> send_pos;  // [T*K] (expert_major) or [T*R] (rank_major): row in the send buffer, or -1
  std::vector<int64_t> src_row;   // [T*K] or [T*R]: which token a send row holds, by send position
  std::vector<int64_t> list;      // aligned rows per local expert
  int64_t send_rows = 0, recv_rows = 0, out_rows = 0;

  // The dispatch send buffer doubles as combine's receive buffer and the dispatch receive buffer as
  // combine's send buffer (same layouts), so the baseline holds three row arrays, not five.
  std::vector<std::byte> send_x, recv_x, out_x, combined_x;
  std::vector<int64_t> send_idx, recv_idx, out_idx;
  std::vector<float> send_w, recv_w, out_w, back_w, combined_w;

  // rows_only (dispatch_cached): the rows move; the plan, ids and weights of the last dispatch stay.
  void plan();
  void pack(bool rows_only);
  void exchange_dispatch(bool rows_only);
  void unpack(bool rows_only);
};

AlltoallvBaseline::AlltoallvBaseline(const BaselineInputs& in) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.in = in;
  s.R = in.ranks;
  s.K = in.topk;
  s.L = in.experts / in.ranks;
  s.T = in.tokens;
  s.row_bytes = in.hidden * static_cast<int64_t>(dtype_size(in.dtype));
  s.x_type = row_type(s.row_bytes);
  s.idx_type = row_type(int64_t{8} * s.K);
  s.w_type = row_type(int64_t{4} * s.K);
}

AlltoallvBaseline::~AlltoallvBaseline() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  MPI_Type_free(&s_->x_type);
  MPI_Type_free(&s_->idx_type);
  MPI_Type_free(&s_->w_type);
}

// Counts per (destination, local expert) and rows per destination; every rank learns what it receives.
void AlltoallvBaseline::State::plan() {
  const bool em = in.order == ReceiveOrder::expert_major;
  send_count.assign(static_cast<size_t>(R) * (L + 1), 0);
  const int64_t slots = em ? T * K : T * R;
  send_pos.assign(static_cast<size_t>(slots), -1);
  for (int64_t t = 0; t < T; ++t) {
    bool hit[1024] = {};  // ranks <= 1024 (the tool's limit)
    for (int k = 0; k < K; ++k) {
      const int64_t e = in.ids[t * K + k];
      if (e < 0) continue;
      const int d = static_cast<int>(e / L);
      ++send_count[d * (L + 1) + e % L];
      if (em || !hit[d]) ++send_count[d * (L + 1) + L];
      hit[d] = true;
    }
  }
  recv_count.assign(send_count.size(), 0);
  check_mpi(MPI_Alltoall(send_count.data(), L + 1, MPI_INT64_T, recv_count.data(), L + 1, MPI_INT64_T,
                         MPI_COMM_WORLD),
            "MPI_Alltoall of the counts");
  sc.assign(R, 0), sd.assign(R, 0), rc.assign(R, 0), rd.assign(R, 0);
  send_rows = recv_rows = 0;
  for (int d = 0; d < R; ++d) {
    sd[d] = as_int(send_rows, "send displacement");
    rd[d] = as_int(recv_rows, "receive displacement");
    sc[d] = as_int(send_count[d * (L + 1) + L], "send count");
    rc[d] = as_int(recv_count[d * (L + 1) + L], "receive count");
    send_rows += sc[d];
    recv_rows += rc[d];
  }
  // Send positions: per destination, expert_major by (local expert, token, slot), rank_major by token.
  std::vector<int64_t> cursor(static_cast<size_t>(R) * (L + 1));
  for (int d = 0; d < R; ++d) {
    int64_t at = sd[d];
    for (int j = 0; j < L; ++j) {
      cursor[d * (L + 1) + j] = at;
      if (em) at += send_count[d * (L + 1) + j];
    }
    cursor[d * (L + 1) + L] = sd[d];
  }
  src_row.assign(static_cast<size_t>(send_rows), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t e = in.ids[t * K + k];
      if (e < 0) continue;
      const int d = static_cast<int>(e / L);
      if (em) {
        const int64_t p = cursor[d * (L + 1) + e % L]++;
        send_pos[t * K + k] = p;
        src_row[p] = t;
      } else if (send_pos[t * R + d] < 0) {
        const int64_t p = cursor[d * (L + 1) + L]++;
        send_pos[t * R + d] = p;
        src_row[p] = t;
      }
    }
  // The aligned list and the output rows (expert_major: PAD rows close every block).
  list.assign(L, 0);
  for (int j = 0; j < L; ++j) {
    int64_t cnt = 0;
    for (int s = 0; s < R; ++s) cnt += recv_count[s * (L + 1) + j];
    const int64_t a = in.expert_alignment;
    list[j] = (cnt + a - 1) / a * a;
  }
  out_rows = 0;
  if (em)
    for (int64_t v : list) out_rows += v;
  else
    out_rows = recv_rows;
}

// Rows and their recv_topk_idx / recv_topk_weights rows as the receiver will hold them.
void AlltoallvBaseline::State::pack(bool rows_only) {
  const bool em = in.order == ReceiveOrder::expert_major;
  send_x.resize(static_cast<size_t>(send_rows * row_bytes));
  send_idx.resize(static_cast<size_t>(send_rows * K));
  send_w.resize(static_cast<size_t>(send_rows * K));
  for (int64_t p = 0; p < send_rows; ++p)
    std::memcpy(send_x.data() + p * row_bytes, in.x + src_row[p] * row_bytes, static_cast<size_t>(row_bytes));
  if (rows_only) return;
  std::fill(send_idx.begin(), send_idx.end(), -1);
  std::fill(send_w.begin(), send_w.end(), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t e = in.ids[t * K + k];
      if (e < 0) continue;
      const int64_t d = e / L;
      const int64_t p = em ? send_pos[t * K + k] : send_pos[t * R + d];
      send_idx[p * K + k] = e - d * L;
      send_w[p * K + k] = in.weights[t * K + k];
    }
}

void AlltoallvBaseline::State::exchange_dispatch(bool rows_only) {
  const bool em = in.order == ReceiveOrder::expert_major;
  // rank_major receives straight into the outputs: source rank, then token, is already the order.
  std::vector<std::byte>& rx = em ? recv_x : out_x;
  std::vector<int64_t>& ri = em ? recv_idx : out_idx;
  std::vector<float>& rw = em ? recv_w : out_w;
  rx.resize(static_cast<size_t>(recv_rows * row_bytes));
  ri.resize(static_cast<size_t>(recv_rows * K));
  rw.resize(static_cast<size_t>(recv_rows * K));
  check_mpi(MPI_Alltoallv(send_x.data(), sc.data(), sd.data(), x_type, rx.data(), rc.data(), rd.data(),
                          x_type, MPI_COMM_WORLD),
            "MPI_Alltoallv of the rows");
  if (rows_only) return;
  check_mpi(MPI_Alltoallv(send_idx.data(), sc.data(), sd.data(), idx_type, ri.data(), rc.data(), rd.data(),
                          idx_type, MPI_COMM_WORLD),
            "MPI_Alltoallv of the top-k ids");
  check_mpi(MPI_Alltoallv(send_w.data(), sc.data(), sd.data(), w_type, rw.data(), rc.data(), rd.data(),
                          w_type, MPI_COMM_WORLD),
            "MPI_Alltoallv of the top-k weights");
}

// expert_major: chunks (source s, local expert j) move to block j, source s; PAD rows are zero, ids -1.
void AlltoallvBaseline::State::unpack(bool rows_only) {
  if (in.order != ReceiveOrder::expert_major) return;
  out_x.resize(static_cast<size_t>(out_rows * row_bytes));
  out_idx.resize(static_cast<size_t>(out_rows * K));
  out_w.resize(static_cast<size_t>(out_rows * K));
  int64_t block = 0;
  for (int j = 0; j < L; ++j) {
    int64_t at = block;
    for (int s = 0; s < R; ++s) {
      int64_t from = rd[s];
      for (int jj = 0; jj < j; ++jj) from += recv_count[s * (L + 1) + jj];
      const int64_t n = recv_count[s * (L + 1) + j];
      std::memcpy(out_x.data() + at * row_bytes, recv_x.data() + from * row_bytes,
                  static_cast<size_t>(n * row_bytes));
      if (!rows_only) {
        std::memcpy(out_idx.data() + at * K, recv_idx.data() + from * K, static_cast<size_t>(n * K) * 8);
        std::memcpy(out_w.data() + at * K, recv_w.data() + from * K, static_cast<size_t>(n * K) * 4);
      }
      at += n;
    }
    const int64_t pad = block + list[j] - at;
    std::memset(out_x.data() + at * row_bytes, 0, static_cast<size_t>(pad * row_bytes));
    if (!rows_only) {
      std::fill_n(out_idx.data() + at * K, pad * K, int64_t{-1});
      std::fill_n(out_w.data() + at * K, pad * K, 0.0f);
    }
    block += list[j];
  }
}

void AlltoallvBaseline::dispatch() {
  s_->plan();
  s_->pack(false);
  s_->exchange_dispatch(false);
  s_->unpack(false);
}

void AlltoallvBaseline::dispatch_cached() {
  s_->pack(true);
  s_->exchange_dispatch(true);
  s_->unpack(true);
}

void AlltoallvBaseline::combine(const std::byte* expert_out, const float* recv_weights) {
  State& s = *s_;
  const bool em = s.in.order == ReceiveOrder::expert_major;
  const int64_t H = s.in.hidden, T = s.T, rb = s.row_bytes;
  const int K = s.K, R = s.R, L = s.L;
  // Pack: the reverse of unpack (expert_major); rank_major sends the rows as they are.
  const std::byte* send = expert_out;
  if (em) {
    int64_t block = 0;
    for (int j = 0; j < L; ++j) {
      int64_t at = block;
      for (int r = 0; r < R; ++r) {
        int64_t to = s.rd[r];
        for (int jj = 0; jj < j; ++jj) to += s.recv_count[r * (L + 1) + jj];
        const int64_t n = s.recv_count[r * (L + 1) + j];
        std::memcpy(s.recv_x.data() + to * rb, expert_out + at * rb, static_cast<size_t>(n * rb));
        at += n;
      }
      block += s.list[j];
    }
    send = s.recv_x.data();
  }
  // The reverse exchange lands in the dispatch send buffer's layout.
  check_mpi(MPI_Alltoallv(send, s.rc.data(), s.rd.data(), s.x_type, s.send_x.data(), s.sc.data(), s.sd.data(),
                          s.x_type, MPI_COMM_WORLD),
            "MPI_Alltoallv of the expert outputs");
  if (!em) {
    s.back_w.resize(static_cast<size_t>(s.send_rows * K));
    check_mpi(MPI_Alltoallv(recv_weights, s.rc.data(), s.rd.data(), s.w_type, s.back_w.data(), s.sc.data(),
                            s.sd.data(), s.w_type, MPI_COMM_WORLD),
              "MPI_Alltoallv of the top-k weights");
  }
  // docs/normal-mode.md: per token, +0.0 plus each contribution in canonical order (slot k, or destination
  // rank d), f32 with no FMA (the build forbids contraction), one rounding to the dtype.
  s.combined_x.resize(static_cast<size_t>(T * rb));
  s.combined_w.resize(static_cast<size_t>(T * K));
  // Across nodes: per node in ascending order, a partial from +0.0, added to the total (never rounded).
  const std::vector<int>& node_of = s.in.node_of_rank;
  const int M = node_of.empty() ? 1 : *std::max_element(node_of.begin(), node_of.end()) + 1;
  auto node = [&](int rank) { return node_of.empty() ? 0 : node_of[rank]; };
  std::vector<float> acc(static_cast<size_t>(H)), part(static_cast<size_t>(H)), row(static_cast<size_t>(H));
  std::vector<float> wacc(static_cast<size_t>(K)), wpart(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(wacc.begin(), wacc.end(), 0.0f);
    float* cw = s.combined_w.data() + t * K;
    for (int n = 0; n < M; ++n) {
      std::fill(part.begin(), part.end(), 0.0f);
      std::fill(wpart.begin(), wpart.end(), 0.0f);
      bool any = false;
      if (em) {
        for (int k = 0; k < K; ++k) {
          const int64_t p = s.send_pos[t * K + k];
          if (p < 0 || node(static_cast<int>(s.in.ids[t * K + k] / L)) != n) continue;
          any = true;
          load_row(s.in.dtype, s.send_x.data() + p * rb, H, row.data());
          const float w = s.in.weights[t * K + k];
          for (int64_t h = 0; h < H; ++h) part[h] = part[h] + w * row[h];
        }
      } else {
        for (int d = 0; d < R; ++d) {
          const int64_t p = s.send_pos[t * R + d];
          if (p < 0 || node(d) != n) continue;
          any = true;
          load_row(s.in.dtype, s.send_x.data() + p * rb, H, row.data());
          for (int64_t h = 0; h < H; ++h) part[h] = part[h] + row[h];
          for (int k = 0; k < K; ++k) wpart[k] = wpart[k] + s.back_w[p * K + k];
        }
      }
      if (!any) continue;
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + part[h];
      for (int k = 0; k < K; ++k) wacc[k] = wacc[k] + wpart[k];
    }
    if (em)
      for (int k = 0; k < K; ++k) cw[k] = s.send_pos[t * K + k] < 0 ? 0.0f : s.in.weights[t * K + k];
    else
      std::copy(wacc.begin(), wacc.end(), cw);
    store_row(s.in.dtype, acc.data(), H, s.combined_x.data() + t * rb);
  }
}

int64_t AlltoallvBaseline::num_rows() const {
  return s_->out_rows;
}
const std::byte* AlltoallvBaseline::recv_x() const {
  return s_->out_x.data();
}
const int64_t* AlltoallvBaseline::recv_topk_idx() const {
  return s_->out_idx.data();
}
const float* AlltoallvBaseline::recv_topk_weights() const {
  return s_->out_w.data();
}
const std::vector<int64_t>& AlltoallvBaseline::num_recv_tokens_per_expert_list() const {
  return s_->list;
}
const std::byte* AlltoallvBaseline::combined_x() const {
  return s_->combined_x.data();
}
const float* AlltoallvBaseline::combined_topk_weights() const {
  return s_->combined_w.data();
}

}  // namespace epcomm::cli
