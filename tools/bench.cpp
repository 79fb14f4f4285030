// `epmoe bench`: latency of the layer against the floors of the machine it runs on.
//
// Sweeps model shape × precision × combine × expert math × world × T (tokens per rank). For every
// point: warm-up rounds, then timed rounds with uniform random top-k routing; a round's latency is
// the slowest rank's forward (CUDA events around forward() on each rank's stream; wall clock on the
// CPU executor), and a point reports the median and p90 of that over its rounds. Next to each
// latency: the bytes of the experts the round touched (in the layer's precision), the FLOPs, the
// bytes that crossed NVLink, and the floors those give over the HBM bandwidth, bf16 matmul rate and
// peer bandwidth measured at the start of the same run. With --phases, each rank's layer also
// stamps the phases of its rounds on the GPU (Layer::set_phase_timing) and a point reports the p50
// of each phase on the slowest rank. docs/bench.md has the definitions.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "executor.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "progress.hpp"
#include "subcommands.hpp"

#if defined(EPMOE_HAS_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "harness/device_batch.hpp"
#endif

namespace epmoe::tools {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

struct BenchOptions {
  std::string models = "qwen3-30b-a3b,deepseek-v3";
  std::int64_t experts = 0;  // cap on every model's experts (0 = none)
  std::string tokens = "0,1,16,64,128,512,2048,8192";
  std::string precisions = "bf16,mxfp8,nvfp4";
  std::string combines = "staged,in_kernel_reduce";
  std::string maths = "exact,tensor_core";  // LayerOptions::expert_math
  std::string worlds = "auto";
  std::string executor = "auto";
  int warmup = 2;
  int rounds = 10;
  double max_point_s = 8.0;
  double budget_s = 0.0;
  std::string check = "auto";
  bool no_check = false;
  std::int64_t check_tokens = 1;
  std::uint64_t seed = 1;
  std::uint32_t timeout_ms = 60'000;
  std::string json;
  double hbm_gbps = 0.0, peer_gbps = 0.0, matmul_tflops = 0.0;  // 0 = measure
  bool no_measure = false;
  bool phases = false;  // Layer::set_phase_timing on every rank; per-phase p50 columns
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(text);
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::int64_t parse_int(const std::string& text, const std::string& what) {
  try {
    std::size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::logic_error&) {
  }
  reject(what + "=" + text + ": not an integer");
}

// ---- models: NAME[:EXPERTS], NAME a known model or `tiny` ----

struct Model {
  std::string name;
  std::int64_t model_experts = 0;  // the real model's expert count
  LayerShape shape;                // num_experts possibly reduced; max_tokens set later
  std::string label() const {
    return shape.num_experts == model_experts ? name
                                              : name + " E" + std::to_string(shape.num_experts) +
                                                    "/" + std::to_string(model_experts);
  }
};

Model parse_model(const std::string& spec, std::int64_t experts_cap) {
  const std::size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  Model m;
  m.name = name;
  if (name == "tiny") {
    m.shape = LayerShape{64, 64, 16, 4, 0};
  } else {
    const ModelShape& known = find_model(name);
    m.shape = known.layer_shape(0);
  }
  m.model_experts = m.shape.num_experts;
  if (colon != std::string::npos) {
    const std::int64_t e = parse_int(spec.substr(colon + 1), "--models " + name + ":EXPERTS");
    if (e < 1) reject("--models=" + spec + ": the expert count must be >= 1");
    m.shape.num_experts = std::min(e, m.model_experts);
  } else if (experts_cap > 0) {
    m.shape.num_experts = std::min(experts_cap, m.model_experts);
  }
  return m;
}

// ---- inputs ----

// Weights (harness::make_random_weights) and x rows (U(-1, 1)) for each rank at the largest T;
// both kept for every config of the model.
struct ModelData {
  reference::LayerWeights weights;
  std::vector<std::vector<std::uint16_t>> x;  // per rank: [max_tokens, H]
};

std::unique_ptr<ModelData> make_model_data(const LayerShape& s, int max_world, std::uint64_t seed) {
  auto d = std::make_unique<ModelData>();
  const auto h = static_cast<std::size_t>(s.hidden);
  d->weights = harness::make_random_weights(s, seed);
  d->x.resize(static_cast<std::size_t>(max_world));
  for (int r = 0; r < max_world; ++r)
    harness::fill_uniform_bf16(
        d->x[static_cast<std::size_t>(r)],
        static_cast<std::size_t>(std::max<std::int64_t>(s.max_tokens_per_rank, 1)) * h, 1.0,
        seed * 7919 + 17 + static_cast<std::uint64_t>(r));
  return d;
}

// Uniform random top-k, drawn as harness::make_random_batch draws it.
using Routing = harness::RoutingTable;

Routing make_routing(const LayerShape& s, std::int64_t tokens, std::uint64_t seed) {
  harness::Rng rng(seed);
  return harness::make_routing(s, 1, tokens, harness::Routing::uniform, 0, rng);
}

// ---- what a round must move, and its floors ----

double weight_bytes_per_param(Precision p) {
  switch (p) {
    case Precision::bf16:
      return 2.0;
    case Precision::mxfp8:
      return 1.0 + 1.0 / 32;  // E4M3 + one E8M0 per 32
    case Precision::nvfp4:
      return 0.5 + 1.0 / 16;  // E2M1 + one E4M3 per 16 (the fp32 tensor scale is noise)
    case Precision::fp8_block128:
      return 1.0 + 4.0 / (128 * 128);  // E4M3 + one fp32 per 128 x 128 tile
    case Precision::mxfp4:
      return 0.5 + 1.0 / 32;  // E2M1 + one E8M0 per 32
  }
  return 0.0;
}

struct Ceilings {
  double hbm_gbps = 0.0;       // device-to-device copy, bytes read + written
  double peer_gbps = 0.0;      // GPU 0 -> GPU 1, one direction
  double matmul_tflops = 0.0;  // bf16 x bf16 -> fp32 accumulate
  std::string hbm_how, peer_how, matmul_how;
};

struct Traffic {
  double weight_bytes = 0, flops = 0, pairs = 0, nvlink_bytes = 0;
  double dispatched_rows = 0, returned_rows = 0;
  double hbm_floor_ms = kNaN, compute_floor_ms = kNaN, nvlink_floor_ms = kNaN;
};

// One round: `ids[r]` is rank r's [T, K] routing.
Traffic round_traffic(const std::vector<const std::vector<std::int32_t>*>& ids, const LayerShape& s,
                      int world, Precision p, Combine c, const Ceilings& ceil) {
  const std::int64_t e_local = s.num_experts / world;
  const auto k = static_cast<std::size_t>(s.top_k);
  std::vector<char> touched(static_cast<std::size_t>(s.num_experts), 0);
  std::vector<double> pairs(static_cast<std::size_t>(world), 0.0),
      out(static_cast<std::size_t>(world), 0.0), in(static_cast<std::size_t>(world), 0.0);
  const double row = static_cast<double>(harness::wire_row_bytes(p, s.hidden, s.top_k));
  const double back = static_cast<double>(s.hidden) * (c == Combine::staged ? 2.0 : 4.0);
  Traffic t;
  std::vector<char> dest(static_cast<std::size_t>(world));
  for (int src = 0; src < world; ++src) {
    const auto& rids = *ids[static_cast<std::size_t>(src)];
    for (std::size_t tok = 0; tok < rids.size() / k; ++tok) {
      std::fill(dest.begin(), dest.end(), 0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t e = rids[tok * k + j];
        if (e < 0) continue;
        touched[static_cast<std::size_t>(e)] = 1;
        const auto owner = static_cast<std::size_t>(e / e_local);
        pairs[owner] += 1;
        dest[owner] = 1;
        if (static_cast<int>(owner) != src) {  // the FC2 row (or its fp32 adds) comes home
          t.returned_rows += 1;
          out[owner] += back;
          in[static_cast<std::size_t>(src)] += back;
        }
      }
      for (int d = 0; d < world; ++d)
        if (d != src && dest[static_cast<std::size_t>(d)]) {  // once per destination rank
          t.dispatched_rows += 1;
          out[static_cast<std::size_t>(src)] += row;
          in[static_cast<std::size_t>(d)] += row;
        }
    }
  }
  const double expert_bytes =
      3.0 * static_cast<double>(s.intermediate * s.hidden) * weight_bytes_per_param(p);
  const double pair_flops = 6.0 * static_cast<double>(s.intermediate * s.hidden);
  double max_rank_bytes = 0, max_rank_pairs = 0, max_link = 0;
  for (int r = 0; r < world; ++r) {
    double n = 0;
    for (std::int64_t e = r * e_local; e < (r + 1) * e_local; ++e)
      n += touched[static_cast<std::size_t>(e)];
    t.weight_bytes += n * expert_bytes;
    max_rank_bytes = std::max(max_rank_bytes, n * expert_bytes);
    max_rank_pairs = std::max(max_rank_pairs, pairs[static_cast<std::size_t>(r)]);
    t.pairs += pairs[static_cast<std::size_t>(r)];
    max_link =
        std::max({max_link, out[static_cast<std::size_t>(r)], in[static_cast<std::size_t>(r)]});
  }
  t.flops = t.pairs * pair_flops;
  t.nvlink_bytes = t.dispatched_rows * row + t.returned_rows * back;
  if (ceil.hbm_gbps > 0) t.hbm_floor_ms = max_rank_bytes / (ceil.hbm_gbps * 1e9) * 1e3;
  if (ceil.matmul_tflops > 0)
    t.compute_floor_ms = max_rank_pairs * pair_flops / (ceil.matmul_tflops * 1e12) * 1e3;
  if (world == 1)
    t.nvlink_floor_ms = 0.0;
  else if (ceil.peer_gbps > 0)
    t.nvlink_floor_ms = max_link / (ceil.peer_gbps * 1e9) * 1e3;
  return t;
}

// ---- results ----

struct Point {
  const Model* model = nullptr;
  int world = 1;
  Precision precision = Precision::bf16;
  Combine combine = Combine::staged;
  ExpertMath math = ExpertMath::exact;
  std::int64_t tokens = 0;
  std::string status = "pending";  // ok | skipped | error
  std::string note;
  std::string check = "skipped";  // pass | fail | skipped (per config, repeated on its points)
  int warmup = 0;
  std::vector<double> latency_ms;  // per timed round: the slowest rank
  double p50 = kNaN, p90 = kNaN, min = kNaN;
  Traffic traffic;                 // mean over the timed rounds
  std::size_t resident_bytes = 0;  // Layer::resident_weight_bytes() of rank 0 (every rank alike)
  double floor_ms = kNaN;
  std::string bound;
  // --phases: per phase, the p50 over timed rounds of its duration on the round's slowest rank
  // (Layer::last_phase_times); NaN where no round stamped it.
  std::array<double, kRoundPhases> phase_p50_us;
  Point() { phase_p50_us.fill(kNaN); }
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

void finish_point(Point& pt) {
  pt.p50 = percentile(pt.latency_ms, 0.5);
  pt.p90 = percentile(pt.latency_ms, 0.9);
  pt.min =
      pt.latency_ms.empty() ? kNaN : *std::min_element(pt.latency_ms.begin(), pt.latency_ms.end());
  const Traffic& t = pt.traffic;
  double best = kNaN;
  const std::pair<double, const char*> floors[] = {
      {t.hbm_floor_ms, "hbm"}, {t.compute_floor_ms, "mma"}, {t.nvlink_floor_ms, "nvl"}};
  for (const auto& [ms, name] : floors)
    if (!std::isnan(ms) && ms > 0 && (std::isnan(best) || ms > best)) {  // 0: no bound
      best = ms;
      pt.bound = name;
    }
  pt.floor_ms = best;
}

// ---- a barrier the rank threads can leave when one of them failed ----

class RoundBarrier {
 public:
  explicit RoundBarrier(int n) : n_(n) {}
  // false once abort() was called: the caller stops.
  bool wait() {
    std::unique_lock lock(mu_);
    if (aborted_) return false;
    const std::uint64_t gen = generation_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    return generation_ != gen;
  }
  void abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
};

// ---- CUDA: ceilings and per-rank device timing ----

#if defined(EPMOE_HAS_CUDA)
void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(ErrorCode::internal, std::string(what) + ": " + cudaGetErrorString(status));
}
void cublas_ok(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::internal,
                std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(status)));
}

// Device buffers freed on every path.
struct DeviceBuffer {
  int device = 0;
  void* ptr = nullptr;
  DeviceBuffer(int dev, std::size_t bytes) : device(dev) {
    cuda_ok(cudaSetDevice(dev), "cudaSetDevice");
    cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc");
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  double ms() const {
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float v = 0;
    cuda_ok(cudaEventElapsedTime(&v, start, stop), "cudaEventElapsedTime");
    return v;
  }
};

// Times `reps` calls of `op` on `stream` after `warm` untimed ones; returns ms per call.
template <class Op>
double time_on_stream(cudaStream_t stream, int warm, int reps, Op op) {
  EventPair ev;
  for (int i = 0; i < warm; ++i) op();
  cuda_ok(cudaEventRecord(ev.start, stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) op();
  cuda_ok(cudaEventRecord(ev.stop, stream), "cudaEventRecord");
  return ev.ms() / reps;
}

double measure_hbm_gbps(int device, std::size_t bytes) {
  DeviceBuffer a(device, bytes), b(device, bytes);
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  cuda_ok(cudaMemset(a.ptr, 0x3c, bytes), "cudaMemset (HBM probe)");
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const double ms = time_on_stream(s, 2, 10, [&] {
    cuda_ok(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
  });
  cudaStreamDestroy(s);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;  // read + write
}

double measure_peer_gbps(int src, int dst, std::size_t bytes, std::string& how) {
  int can = 0;
  cuda_ok(cudaDeviceCanAccessPeer(&can, src, dst), "cudaDeviceCanAccessPeer");
  bool enabled = false;
  if (can) {
    cuda_ok(cudaSetDevice(src), "cudaSetDevice");
    const cudaError_t e = cudaDeviceEnablePeerAccess(dst, 0);
    if (e == cudaSuccess)
      enabled = true;
    else if (e == cudaErrorPeerAccessAlreadyEnabled)
      cudaGetLastError();
    else
      cuda_ok(e, "cudaDeviceEnablePeerAccess");
  }
  double gbps = 0;
  {
    DeviceBuffer a(src, bytes), b(dst, bytes);
    cuda_ok(cudaSetDevice(src), "cudaSetDevice");
    cuda_ok(cudaMemset(a.ptr, 0x3c, bytes), "cudaMemset");
    cudaStream_t s = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    const double ms = time_on_stream(s, 2, 10, [&] {
      cuda_ok(cudaMemcpyPeerAsync(b.ptr, dst, a.ptr, src, bytes, s), "cudaMemcpyPeerAsync");
    });
    cudaStreamDestroy(s);
    gbps = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  }
  if (enabled) {  // leave the peer state as we found it
    cuda_ok(cudaSetDevice(src), "cudaSetDevice");
    cudaDeviceDisablePeerAccess(dst);
  }
  how = "cudaMemcpyPeer " + std::to_string(bytes >> 20) + " MiB GPU " + std::to_string(src) +
        " -> " + std::to_string(dst) + (can ? " (peer access)" : " (no peer access: staged)");
  return gbps;
}

double measure_matmul_tflops(int device, int n) {
  const auto elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::vector<std::uint16_t> host;
  DeviceBuffer a(device, elems * 2), b(device, elems * 2), c(device, elems * 2);
  harness::fill_uniform_bf16(host, elems, 1.0, 101);  // random, not zeros (zeros run faster)
  cuda_ok(cudaMemcpy(a.ptr, host.data(), elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  harness::fill_uniform_bf16(host, elems, 1.0, 202);
  cuda_ok(cudaMemcpy(b.ptr, host.data(), elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  cublasHandle_t handle = nullptr;
  cublas_ok(cublasCreate(&handle), "cublasCreate");
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  double ms = 0;
  try {
    cublas_ok(cublasSetStream(handle, s), "cublasSetStream");
    const float alpha = 1.0f, beta = 0.0f;
    ms = time_on_stream(s, 3, 10, [&] {
      cublas_ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF,
                             n, b.ptr, CUDA_R_16BF, n, &beta, c.ptr, CUDA_R_16BF, n,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx");
    });
  } catch (...) {
    cublasDestroy(handle);
    cudaStreamDestroy(s);
    throw;
  }
  cublasDestroy(handle);
  cudaStreamDestroy(s);
  const double nn = n;
  return 2.0 * nn * nn * nn / (ms * 1e-3) / 1e12;
}

std::vector<std::string> gpu_names() {
  std::vector<std::string> names;
  for (int d = 0; d < cuda_device_count(); ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) names.emplace_back(prop.name);
  }
  return names;
}
#else
std::vector<std::string> gpu_names() {
  return {};
}
#endif

Ceilings measure_ceilings(const BenchOptions& o, Backend backend) {
  Ceilings c;
  c.hbm_gbps = o.hbm_gbps;
  c.peer_gbps = o.peer_gbps;
  c.matmul_tflops = o.matmul_tflops;
  if (c.hbm_gbps > 0) c.hbm_how = "given (--hbm-gbps)";
  if (c.peer_gbps > 0) c.peer_how = "given (--peer-gbps)";
  if (c.matmul_tflops > 0) c.matmul_how = "given (--matmul-tflops)";
#if defined(EPMOE_HAS_CUDA)
  if (backend == Backend::cuda_nccl && !o.no_measure) {
    std::fprintf(stderr, "[ceilings] measuring HBM copy, peer copy and bf16 matmul on GPU 0...\n");
    // A probe that fails leaves its ceiling unmeasured (its floors print as "-"); the sweep runs.
    auto attempt = [](const char* what, auto&& fn) {
      try {
        fn();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[ceilings] %s not measured: %s\n", what, e.what());
      }
    };
    if (c.hbm_gbps <= 0)
      attempt("HBM bandwidth", [&] {
        c.hbm_gbps = measure_hbm_gbps(0, std::size_t{2} << 30);
        c.hbm_how = "cudaMemcpy D2D 2 GiB on GPU 0, read + write";
      });
    if (c.peer_gbps <= 0 && cuda_device_count() >= 2)
      attempt("peer bandwidth",
              [&] { c.peer_gbps = measure_peer_gbps(0, 1, std::size_t{1} << 30, c.peer_how); });
    if (c.matmul_tflops <= 0)
      attempt("bf16 matmul rate", [&] {
        c.matmul_tflops = measure_matmul_tflops(0, 8192);
        c.matmul_how = "cublasGemmEx 8192^3 bf16, fp32 accumulate, GPU 0";
      });
  }
#else
  (void)backend;
#endif
  return c;
}

// ---- one config (model, world, precision, combine, math): a cluster and its T sweep ----

struct SweepState {
  const BenchOptions* o = nullptr;
  Backend backend = Backend::cpu_threads;
  Ceilings ceilings;
  Clock::time_point start;
  Progress* progress = nullptr;
  std::int64_t done = 0;
  bool any_failure = false;
  std::map<std::string, double> prep_s;  // layer preparation time x world, per model/precision
};

// Every rank runs `warmup + rounds` forwards of T tokens with a host barrier before each (so a
// rank's host work never counts against its peers); returns per-rank latencies per round.
struct RoundTimes {
  std::vector<std::vector<double>> ms;          // [rank][round]
  std::vector<std::vector<PhaseTimes>> phases;  // [rank][round] (--phases; else empty times)
  int timed = 0;  // rounds actually timed (may stop early: --max-point-s)
};

RoundTimes time_rounds(Cluster& cluster, const std::vector<Routing>& routing /* [round*W+r] */,
                       const ModelData& data, std::int64_t tokens, int warmup, int rounds,
                       double cap_s, Backend backend,
                       [[maybe_unused]] bool phases /* CUDA only */) {
  const int world = cluster.world();
  const LayerShape& s = cluster.layer(0).config().shape();
  RoundTimes out;
  out.ms.assign(static_cast<std::size_t>(world),
                std::vector<double>(static_cast<std::size_t>(warmup + rounds), kNaN));
  out.phases.assign(static_cast<std::size_t>(world),
                    std::vector<PhaseTimes>(static_cast<std::size_t>(warmup + rounds)));
  RoundBarrier barrier(world);
  std::atomic<bool> stop{false};
  std::atomic<int> timed{0};
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  const auto t0 = Clock::now();
  const auto h = static_cast<std::size_t>(s.hidden);
  run_on_rank_threads(world, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    try {
      Layer& layer = cluster.layer(rank);
      std::vector<std::uint16_t> y(
          backend == Backend::cpu_threads ? static_cast<std::size_t>(tokens) * h : 0);
#if defined(EPMOE_HAS_CUDA)
      std::unique_ptr<harness::DeviceBatch> dev;
      std::unique_ptr<EventPair> ev;
      if (backend == Backend::cuda_nccl) {
        dev = std::make_unique<harness::DeviceBatch>(rank, s);  // sets this thread's device
        ev = std::make_unique<EventPair>();
        cuda_ok(cudaMemcpy(dev->x(tokens).data, data.x[r].data(),
                           static_cast<std::size_t>(tokens) * h * 2, cudaMemcpyHostToDevice),
                "cudaMemcpy x");
      }
#endif
      for (int i = 0; i < warmup + rounds; ++i) {
        const Routing& rt = routing[static_cast<std::size_t>(i * world + rank)];
#if defined(EPMOE_HAS_CUDA)
        if (dev) {
          auto st = static_cast<cudaStream_t>(dev->stream());
          cuda_ok(cudaMemcpyAsync(dev->topk_ids(tokens).data, rt.topk_ids.data(),
                                  rt.topk_ids.size() * 4, cudaMemcpyHostToDevice, st),
                  "cudaMemcpyAsync ids");
          cuda_ok(cudaMemcpyAsync(dev->topk_weights(tokens).data, rt.topk_weights.data(),
                                  rt.topk_weights.size() * 4, cudaMemcpyHostToDevice, st),
                  "cudaMemcpyAsync weights");
          cuda_ok(cudaStreamSynchronize(st), "cudaStreamSynchronize");
        }
#endif
        // Rank 0 decides, before the barrier, whether this round still runs: every rank reads the
        // same answer after it.
        if (rank == 0 && i > warmup + 2 && seconds_since(t0) > cap_s) stop = true;
        if (!barrier.wait()) return;
        if (stop) break;
#if defined(EPMOE_HAS_CUDA)
        if (dev) {
          auto st = static_cast<cudaStream_t>(dev->stream());
          cuda_ok(cudaEventRecord(ev->start, st), "cudaEventRecord");
          layer.forward(dev->x(tokens), dev->topk_ids(tokens), dev->topk_weights(tokens),
                        dev->y(tokens), Stream{dev->stream()});
          cuda_ok(cudaEventRecord(ev->stop, st), "cudaEventRecord");
          out.ms[r][static_cast<std::size_t>(i)] = ev->ms();
          // After the round's stop event: reading the record is not timed.
          if (phases) out.phases[r][static_cast<std::size_t>(i)] = layer.last_phase_times();
          if (rank == 0 && i >= warmup) ++timed;
          continue;
        }
#endif
        const auto begin = Clock::now();
        layer.forward(view(data.x[r].data(), DType::bf16, {tokens, s.hidden}),
                      view(rt.topk_ids.data(), DType::i32, {tokens, s.top_k}),
                      view(rt.topk_weights.data(), DType::f32, {tokens, s.top_k}),
                      view(y.data(), DType::bf16, {tokens, s.hidden}));
        out.ms[r][static_cast<std::size_t>(i)] = seconds_since(begin) * 1e3;
        if (rank == 0 && i >= warmup) ++timed;
      }
    } catch (const std::exception& e) {
      errors[r] = e.what();
      barrier.abort();
    }
  });
  for (int r = 0; r < world; ++r)
    if (!errors[static_cast<std::size_t>(r)].empty())
      throw Error(ErrorCode::internal,
                  "rank " + std::to_string(r) + ": " + errors[static_cast<std::size_t>(r)]);
  out.timed = timed;
  return out;
}

// One round on check_tokens tokens per rank against the emulating reference, with the rule of the
// layer's combine and expert math (reference::check_output).
std::string check_config(Cluster& cluster, const LayerShape& s, Precision precision,
                         const LayerOptions& options, std::int64_t tokens, std::uint64_t seed) {
  const int world = cluster.world();
  std::vector<std::string> result(static_cast<std::size_t>(world));
  run_on_rank_threads(world, [&](int rank) {
    const reference::Batch batch =
        harness::make_random_batch(s, world, tokens, harness::Routing::uniform, 0,
                                   seed * 104729 + static_cast<std::uint64_t>(rank));
    const auto y = cluster.forward(rank, batch);
    const auto check = reference::check_output(y, cluster.reference(rank).forward(batch),
                                               options.combine, options.expert_math, precision);
    char rel_l2[32];
    std::snprintf(rel_l2, sizeof rel_l2, "%.3g", check.stats.rel_l2);
    result[static_cast<std::size_t>(rank)] =
        check.pass
            ? "pass"
            : "fail (rank " + std::to_string(rank) + ": " + std::to_string(check.stats.mismatches) +
                  " elements outside tolerance, rel_l2 " + rel_l2 + "; " + check.rule + ")";
  });
  for (const auto& r : result)
    if (r != "pass") return r;
  return "pass";
}

bool check_wanted(const BenchOptions& o, const LayerShape& s, int world) {
  if (o.no_check || o.check == "never" || o.check_tokens < 1) return false;
  if (o.check == "always") return true;
  // auto: only where the host reference is quick (it quantizes every expert it touches and runs
  // in float64): at most ~200 M expert parameters touched.
  const std::int64_t experts =
      std::min(s.num_experts, static_cast<std::int64_t>(world) * o.check_tokens * s.top_k);
  return experts * 3 * s.intermediate * s.hidden <= 200'000'000;
}

void run_config(SweepState& st, const Model& model, const ModelData& data, int world,
                Precision precision, Combine combine, ExpertMath math,
                std::vector<Point*>& points) {
  const BenchOptions& o = *st.o;
  const LayerShape& s = model.shape;
  const std::string what = model.label() + " W=" + std::to_string(world) + " " +
                           to_string(precision) + " " + to_string(combine) + " " + to_string(math);
  auto skip_rest = [&](std::size_t from, const std::string& status, const std::string& note) {
    for (std::size_t i = from; i < points.size(); ++i) {
      points[i]->status = status;
      points[i]->note = note;
      st.progress->update(++st.done, what);
    }
  };
  // Preparing a layer (each rank copies its experts' bf16 weights up and prepares them on its
  // GPU) is a large part of a config's cost: skip it when the time the same model and precision
  // took before, scaled by the experts each rank prepares (1 / world), no longer fits the budget.
  const std::string prep_key = model.label() + "/" + to_string(precision);
  const double prep_est = st.prep_s.count(prep_key) ? st.prep_s[prep_key] / world : 0.0;
  if (o.budget_s > 0 && seconds_since(st.start) + prep_est > o.budget_s) {
    skip_rest(0, "skipped", "over --budget-s");
    return;
  }
  LayerOptions options;
  options.combine = combine;
  options.expert_math = math;
  options.timeout_ms = o.timeout_ms;
  std::unique_ptr<Cluster> cluster;
  const auto t_prep = Clock::now();
  try {
    cluster = std::make_unique<Cluster>(s, precision, options, world, data.weights, st.backend);
  } catch (const std::exception& e) {
    st.any_failure = true;
    skip_rest(0, "error", std::string("layer creation: ") + e.what());
    return;
  }
  const double prep_s = seconds_since(t_prep);
  st.prep_s[prep_key] = prep_s * world;

  std::string check = "skipped";
  if (check_wanted(o, s, world)) {
    try {
      check = check_config(*cluster, s, precision, options,
                           std::min(o.check_tokens, s.max_tokens_per_rank), o.seed);
    } catch (const std::exception& e) {
      check = std::string("error: ") + e.what();
    }
    if (check != "pass") st.any_failure = true;
  }
  const std::size_t resident_bytes = cluster->layer(0).resident_weight_bytes();
  for (Point* p : points) {
    p->check = check;
    p->resident_bytes = resident_bytes;
  }
  std::fprintf(stderr, "[config] %s: layer ready in %.1f s, check %s\n", what.c_str(), prep_s,
               check.c_str());
  if (o.phases)
    for (int r = 0; r < world; ++r) cluster->layer(r).set_phase_timing(true);

  double last_ms = kNaN;
  std::int64_t last_t = 0;
  for (std::size_t pi = 0; pi < points.size(); ++pi) {
    Point& pt = *points[pi];
    const std::int64_t T = pt.tokens;
    if (o.budget_s > 0 && seconds_since(st.start) > o.budget_s) {
      skip_rest(pi, "skipped", "over --budget-s");
      return;
    }
    // Estimate this point from the last one (latency grows at most linearly in T here).
    int warmup = o.warmup, rounds = o.rounds;
    if (!std::isnan(last_ms)) {
      const double est_ms =
          last_ms * std::max(1.0, last_t > 0 ? double(T) / double(last_t) : double(T));
      const double est_s = est_ms * 1e-3;
      if (est_s * (warmup + rounds) > o.max_point_s) {
        warmup = std::min(warmup, 1);
        rounds = std::max(3, static_cast<int>(o.max_point_s / est_s) - warmup);
        if (est_s * (warmup + rounds) > o.max_point_s * 1.5) {
          char note[160];
          std::snprintf(note, sizeof note,
                        "estimated %.2f s per forward: %d forwards exceed --max-point-s=%g", est_s,
                        warmup + rounds, o.max_point_s);
          skip_rest(pi, "skipped", note);
          return;
        }
      }
    }
    std::vector<Routing> routing;
    for (int i = 0; i < warmup + rounds; ++i)
      for (int r = 0; r < world; ++r)
        routing.push_back(make_routing(s, T,
                                       o.seed * 1000003 + static_cast<std::uint64_t>(T) * 7777 +
                                           static_cast<std::uint64_t>(i * world + r)));
    try {
      const RoundTimes times = time_rounds(*cluster, routing, data, T, warmup, rounds,
                                           o.max_point_s, st.backend, o.phases);
      pt.warmup = warmup;
      std::vector<Traffic> per_round;
      std::array<std::vector<double>, kRoundPhases> phase_us;  // per phase, the timed rounds'
      for (int i = warmup; i < warmup + times.timed; ++i) {
        const auto round = static_cast<std::size_t>(i);
        std::size_t slowest = 0;
        std::vector<const std::vector<std::int32_t>*> ids;
        for (int r = 0; r < world; ++r) {
          if (times.ms[static_cast<std::size_t>(r)][round] > times.ms[slowest][round])
            slowest = static_cast<std::size_t>(r);
          ids.push_back(&routing[static_cast<std::size_t>(i * world + r)].topk_ids);
        }
        pt.latency_ms.push_back(times.ms[slowest][round]);
        per_round.push_back(round_traffic(ids, s, world, precision, combine, st.ceilings));
        const PhaseTimes& phases = times.phases[slowest][round];
        for (std::size_t ph = 0; ph < phase_us.size(); ++ph)
          if (phases.spans[ph].stamped) phase_us[ph].push_back(phases.spans[ph].us());
      }
      for (std::size_t ph = 0; ph < phase_us.size(); ++ph)
        pt.phase_p50_us[ph] = percentile(phase_us[ph], 0.5);
      const double n = static_cast<double>(per_round.size());
      Traffic& m = pt.traffic;
      m.hbm_floor_ms = m.compute_floor_ms = m.nvlink_floor_ms = 0;
      for (const Traffic& t : per_round) {
        m.weight_bytes += t.weight_bytes / n;
        m.flops += t.flops / n;
        m.pairs += t.pairs / n;
        m.nvlink_bytes += t.nvlink_bytes / n;
        m.dispatched_rows += t.dispatched_rows / n;
        m.returned_rows += t.returned_rows / n;
        m.hbm_floor_ms += t.hbm_floor_ms / n;  // NaN (not measured) stays NaN
        m.compute_floor_ms += t.compute_floor_ms / n;
        m.nvlink_floor_ms += t.nvlink_floor_ms / n;
      }
      pt.status = "ok";
      if (times.timed < rounds)
        pt.note = "stopped after " + std::to_string(times.timed) + " rounds (--max-point-s)";
      finish_point(pt);
      last_ms = pt.p50;
      last_t = T;
      char detail[200];
      std::snprintf(detail, sizeof detail, "%s T=%lld: %.3f ms", what.c_str(),
                    static_cast<long long>(T), pt.p50);
      st.progress->update(++st.done, detail);
    } catch (const std::exception& e) {
      st.any_failure = true;
      pt.status = "error";
      pt.note = e.what();
      st.progress->update(++st.done, what);
      skip_rest(pi + 1, "error", "the layer failed at an earlier T of this config");
      return;
    }
  }
}

// ---- output ----

std::string fmt(double v, const char* f = "%.3f") {
  if (std::isnan(v)) return "-";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string json_num(double v) {
  if (std::isnan(v) || std::isinf(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The phase columns of --phases (p50 us), in RoundPhase order.
constexpr const char* kPhaseColumns[kRoundPhases] = {"disp", "route", "w.cnt", "fc1",
                                                     "fc2",  "comb",  "w.done"};

void print_table(const std::vector<Point>& points, bool phases) {
  std::printf("\n%-22s %2s %-5s %-16s %-11s %5s %9s %9s %8s %6s %7s %8s %9s %-5s %7s %8s ", "model",
              "W", "prec", "combine", "math", "T", "p50 ms", "p90 ms", "wt GB", "TB/s", "TFLOPS",
              "NVL MB", "floor ms", "bound", "x floor", "res GB");
  if (phases)
    for (const char* column : kPhaseColumns) std::printf("%7s ", column);
  std::printf("check\n");
  for (const Point& p : points) {
    std::printf("%-22s %2d %-5s %-16s %-11s %5lld ", p.model->label().c_str(), p.world,
                to_string(p.precision), to_string(p.combine), to_string(p.math),
                static_cast<long long>(p.tokens));
    if (p.status != "ok") {
      std::printf("%s: %s\n", p.status.c_str(), p.note.c_str());
      continue;
    }
    const double sec = p.p50 * 1e-3;
    const double tbps = p.traffic.weight_bytes / p.world / sec / 1e12;
    const double tflops = p.traffic.flops / p.world / sec / 1e12;
    std::printf("%9s %9s %8s %6s %7s %8s %9s %-5s %7s %8s ", fmt(p.p50).c_str(), fmt(p.p90).c_str(),
                fmt(p.traffic.weight_bytes / 1e9, "%.3f").c_str(), fmt(tbps, "%.2f").c_str(),
                fmt(tflops, "%.1f").c_str(), fmt(p.traffic.nvlink_bytes / 1e6, "%.2f").c_str(),
                fmt(p.floor_ms).c_str(), p.bound.empty() ? "-" : p.bound.c_str(),
                fmt(p.p50 / p.floor_ms, "%.1f").c_str(),
                fmt(static_cast<double>(p.resident_bytes) / 1e9, "%.3f").c_str());
    if (phases)
      for (double us : p.phase_p50_us) std::printf("%7s ", fmt(us, "%.1f").c_str());
    std::printf("%s%s%s\n", p.check.c_str(), p.note.empty() ? "" : "  ", p.note.c_str());
  }
}

void write_json(const std::string& path, const BenchOptions& o, Backend backend, const Ceilings& c,
                const std::vector<Point>& points, double total_s) {
  std::ofstream f(path);
  if (!f) reject("--json=" + path + ": cannot open for writing");
  f << "{\n  \"schema\": \"epmoe-bench/1\",\n  \"tool\": \"epmoe bench\",\n";
  f << "  \"executor\": " << json_str(backend == Backend::cuda_nccl ? "cuda" : "cpu") << ",\n";
  f << "  \"gpus\": [";
  const auto names = gpu_names();
  for (std::size_t i = 0; i < names.size(); ++i) f << (i ? ", " : "") << json_str(names[i]);
  f << "],\n  \"ceilings\": {\"hbm_gbps\": " << json_num(c.hbm_gbps > 0 ? c.hbm_gbps : kNaN)
    << ", \"hbm_how\": " << json_str(c.hbm_how)
    << ", \"peer_gbps\": " << json_num(c.peer_gbps > 0 ? c.peer_gbps : kNaN)
    << ", \"peer_how\": " << json_str(c.peer_how)
    << ", \"matmul_tflops\": " << json_num(c.matmul_tflops > 0 ? c.matmul_tflops : kNaN)
    << ", \"matmul_how\": " << json_str(c.matmul_how) << "},\n";
  f << "  \"settings\": {\"warmup\": " << o.warmup << ", \"rounds\": " << o.rounds
    << ", \"seed\": " << o.seed << ", \"routing\": \"uniform top-k, 5% slots dropped\""
    << ", \"max_point_s\": " << json_num(o.max_point_s)
    << ", \"phases\": " << (o.phases ? "true" : "false") << "},\n";
  f << "  \"total_s\": " << json_num(total_s) << ",\n  \"points\": [\n";
  for (std::size_t i = 0; i < points.size(); ++i) {
    const Point& p = points[i];
    const LayerShape& s = p.model->shape;
    const double sec = p.p50 * 1e-3;
    f << "    {\"impl\": \"epmoe\", \"model\": " << json_str(p.model->name)
      << ", \"hidden\": " << s.hidden << ", \"intermediate\": " << s.intermediate
      << ", \"experts\": " << s.num_experts << ", \"model_experts\": " << p.model->model_experts
      << ", \"top_k\": " << s.top_k << ", \"precision\": " << json_str(to_string(p.precision))
      << ", \"combine\": " << json_str(to_string(p.combine))
      << ", \"math\": " << json_str(to_string(p.math)) << ", \"world\": " << p.world
      << ", \"tokens_per_rank\": " << p.tokens << ", \"status\": " << json_str(p.status)
      << ", \"note\": " << json_str(p.note) << ", \"check\": " << json_str(p.check)
      << ", \"warmup\": " << p.warmup << ", \"rounds\": " << p.latency_ms.size()
      << ", \"latency_ms_p50\": " << json_num(p.p50) << ", \"latency_ms_p90\": " << json_num(p.p90)
      << ", \"latency_ms_min\": " << json_num(p.min)
      << ", \"weight_bytes\": " << json_num(p.traffic.weight_bytes)
      << ", \"resident_weight_bytes_per_rank\": "
      << (p.resident_bytes > 0 ? std::to_string(p.resident_bytes) : std::string("null"))
      << ", \"flops\": " << json_num(p.traffic.flops)
      << ", \"pairs\": " << json_num(p.traffic.pairs)
      << ", \"nvlink_bytes\": " << json_num(p.traffic.nvlink_bytes)
      << ", \"dispatched_rows\": " << json_num(p.traffic.dispatched_rows)
      << ", \"returned_rows\": " << json_num(p.traffic.returned_rows)
      << ", \"eff_tbps\": " << json_num(p.traffic.weight_bytes / p.world / sec / 1e12)
      << ", \"eff_tflops\": " << json_num(p.traffic.flops / p.world / sec / 1e12)
      << ", \"hbm_floor_ms\": " << json_num(p.traffic.hbm_floor_ms)
      << ", \"compute_floor_ms\": " << json_num(p.traffic.compute_floor_ms)
      << ", \"nvlink_floor_ms\": " << json_num(p.traffic.nvlink_floor_ms)
      << ", \"floor_ms\": " << json_num(p.floor_ms) << ", \"bound\": " << json_str(p.bound);
    if (o.phases) {
      f << ", \"phases_us_p50\": {";
      for (int ph = 0; ph < kRoundPhases; ++ph)
        f << (ph ? ", " : "") << json_str(to_string(static_cast<RoundPhase>(ph))) << ": "
          << json_num(p.phase_p50_us[static_cast<std::size_t>(ph)]);
      f << "}";
    }
    f << ", \"latency_ms\": [";
    for (std::size_t j = 0; j < p.latency_ms.size(); ++j)
      f << (j ? ", " : "") << json_num(p.latency_ms[j]);
    f << "]}" << (i + 1 < points.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
  if (!f) reject("--json=" + path + ": write failed");
}

int bench(const BenchOptions& o) {
  const auto start = Clock::now();
  if (o.warmup < 0) reject("--warmup=" + std::to_string(o.warmup) + ": must be >= 0");
  if (o.rounds < 1) reject("--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check != "auto" && o.check != "always" && o.check != "never")
    reject("--check=" + o.check + ": must be auto, always or never");

  std::vector<std::int64_t> tokens;
  for (const auto& t : split(o.tokens)) {
    const std::int64_t v = parse_int(t, "--tokens");
    if (v < 0) reject("--tokens: " + t + " must be >= 0");
    tokens.push_back(v);
  }
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  if (tokens.empty()) reject("--tokens: give at least one T");
  const std::int64_t max_tokens = std::max<std::int64_t>(1, tokens.back());

  std::vector<Model> models;
  for (const auto& spec : split(o.models)) models.push_back(parse_model(spec, o.experts));
  if (models.empty()) reject("--models: give at least one model");
  std::vector<Precision> precisions;
  for (const auto& p : split(o.precisions))
    precisions.push_back(parse_precision(p, "--precisions"));
  std::vector<Combine> combines;
  for (const auto& c : split(o.combines)) combines.push_back(parse_combine(c, "--combines"));
  std::vector<ExpertMath> maths;
  for (const auto& m : split(o.maths)) maths.push_back(parse_expert_math(m, "--math"));
  if (precisions.empty() || combines.empty() || maths.empty())
    reject("--precisions / --combines / --math: empty list");

  // Worlds: auto = 2 and 1 (largest first), clipped to the GPUs on the CUDA executor.
  std::vector<int> worlds;
  if (o.worlds == "auto") {
    worlds = {2, 1};
  } else {
    for (const auto& w : split(o.worlds)) {
      const std::int64_t v = parse_int(w, "--worlds");
      if (v < 1 || v > kMaxWorld) reject("--worlds: " + w + " must be in [1, 64]");
      worlds.push_back(static_cast<int>(v));
    }
  }
  if (worlds.empty()) reject("--worlds: give at least one world size");
  const Backend backend = choose_backend(o.executor, 1);  // auto: the GPUs when there is one
  if (o.phases && backend != Backend::cuda_nccl)
    reject("--phases: per-phase timing stamps the GPU clock; the CPU executor has none");
  if (backend == Backend::cuda_nccl) {
    const int gpus = cuda_device_count();
    std::vector<int> fit;
    for (int w : worlds)
      if (w <= gpus)
        fit.push_back(w);
      else
        std::fprintf(stderr, "epmoe bench: world %d skipped: %d GPU(s) visible\n", w, gpus);
    worlds = fit;
    if (worlds.empty()) reject("--worlds: no world size fits the visible GPUs");
  }
  const int data_world = *std::max_element(worlds.begin(), worlds.end());

  for (Model& m : models) {
    m.shape.max_tokens_per_rank = max_tokens;
    for (int w : worlds) make_config(m.shape, Precision::bf16, 0, w);  // validate before work
  }

  std::printf("epmoe bench: executor %s\n", describe_backend(backend, data_world).c_str());
  std::fflush(stdout);
  const Ceilings ceilings = measure_ceilings(o, backend);
  std::printf("ceilings: HBM %s GB/s (%s); peer %s GB/s (%s); bf16 matmul %s TFLOP/s (%s)\n",
              fmt(ceilings.hbm_gbps > 0 ? ceilings.hbm_gbps : kNaN, "%.0f").c_str(),
              ceilings.hbm_how.empty() ? "not measured" : ceilings.hbm_how.c_str(),
              fmt(ceilings.peer_gbps > 0 ? ceilings.peer_gbps : kNaN, "%.0f").c_str(),
              ceilings.peer_how.empty() ? "not measured" : ceilings.peer_how.c_str(),
              fmt(ceilings.matmul_tflops > 0 ? ceilings.matmul_tflops : kNaN, "%.0f").c_str(),
              ceilings.matmul_how.empty() ? "not measured" : ceilings.matmul_how.c_str());
  std::fflush(stdout);

  // Points, in the order they run: world (largest first), precision, combine, math, model, T. A
  // --budget-s cut therefore drops the least central configs first.
  struct Config {
    std::size_t model;
    int world;
    Precision precision;
    Combine combine;
    ExpertMath math;
    std::vector<std::size_t> points;
  };
  std::vector<Point> points;
  std::vector<Config> configs;
  for (int w : worlds)
    for (Precision p : precisions)
      for (Combine c : combines)
        for (ExpertMath x : maths)
          for (std::size_t m = 0; m < models.size(); ++m) {
            // The CUDA mma.sync backend refuses fp8_block128 (its fp32 block scales are not
            // exact in bf16; docs/formats.md): that config is left out, not failed.
            if (backend == Backend::cuda_nccl && p == Precision::fp8_block128 &&
                x == ExpertMath::tensor_core)
              continue;
            Config cfg{m, w, p, c, x, {}};
            for (std::int64_t t : tokens) {
              Point pt;
              pt.model = &models[m];
              pt.world = w;
              pt.precision = p;
              pt.combine = c;
              pt.math = x;
              pt.tokens = t;
              cfg.points.push_back(points.size());
              points.push_back(pt);
            }
            configs.push_back(cfg);
          }

  std::map<std::size_t, std::unique_ptr<ModelData>> data;
  Progress progress("bench", static_cast<std::int64_t>(points.size()));
  SweepState st;
  st.o = &o;
  st.backend = backend;
  st.ceilings = ceilings;
  st.start = start;
  st.progress = &progress;
  for (Config& cfg : configs) {
    const Model& m = models[cfg.model];
    if (!data.count(cfg.model)) {
      const auto t0 = Clock::now();
      data[cfg.model] = make_model_data(m.shape, data_world, o.seed + cfg.model);
      std::fprintf(stderr, "[weights] %s: %.2f G bf16 parameters in %.1f s\n", m.label().c_str(),
                   3.0 * double(m.shape.num_experts * m.shape.intermediate * m.shape.hidden) / 1e9,
                   seconds_since(t0));
    }
    std::vector<Point*> pts;
    for (std::size_t i : cfg.points) pts.push_back(&points[i]);
    run_config(st, m, *data[cfg.model], cfg.world, cfg.precision, cfg.combine, cfg.math, pts);
  }
  progress.finish();
  const double total_s = seconds_since(start);

  print_table(points, o.phases);
  std::printf(
      "\nW = ranks (GPUs); T = tokens per rank; p50/p90 over rounds of the slowest rank's forward; "
      "wt GB = expert weights the round touched (layer precision); TB/s, TFLOPS per GPU; NVL MB = "
      "bytes across ranks; floor = max(hbm, mma, nvl) floors; total %.0f s\n",
      total_s);
  if (o.phases)
    std::printf(
        "phases (--phases): p50 us over rounds on the round's slowest rank, from its GPU clock: "
        "disp = dispatch, route (holds w.cnt = the wait for counts), fc1, fc2, comb = combine "
        "(holds w.done = the wait for dones)\n");
  if (!o.json.empty()) {
    write_json(o.json, o, backend, ceilings, points, total_s);
    std::printf("wrote %s\n", o.json.c_str());
  }
  return st.any_failure ? 1 : 0;
}

}  // namespace

Subcommand add_bench_command(CLI::App& parent) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = parent.add_subcommand(
      "bench",
      "time the layer over model shape x precision x combine x expert math x world x T, next to "
      "the floors of this machine (HBM, bf16 matmul, NVLink) measured in the same run");
  cmd->footer(
      "Each point: --warmup rounds, then --rounds timed rounds (uniform random top-k); a round's "
      "latency is the\nslowest rank's forward (CUDA events); p50/p90 over rounds. Points whose "
      "estimated time exceeds\n--max-point-s run fewer rounds or are skipped (and say so). "
      "docs/bench.md defines every column.\nExit status: 0 ok, 1 a check failed or a point "
      "errored, 2 bad options.");
  cmd->add_option("--models", o->models,
                  "comma list of NAME[:EXPERTS] (qwen3-30b-a3b, deepseek-v3, gpt-oss-120b, "
                  "mixtral-8x7b, tiny); :EXPERTS keeps that many of the model's experts")
      ->capture_default_str();
  cmd->add_option("--experts", o->experts,
                  "cap every model (without :EXPERTS) at this many experts (0 = the model's)")
      ->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "comma list of T (tokens per rank)")
      ->capture_default_str();
  cmd->add_option("--precisions", o->precisions,
                  "comma list of bf16, mxfp8, nvfp4, fp8_block128, mxfp4")
      ->capture_default_str();
  cmd->add_option("--combines", o->combines, "comma list of staged, in_kernel_reduce")
      ->capture_default_str();
  cmd->add_option(
         "--math", o->maths,
         "comma list of expert math: exact, tensor_core (bf16 mma.sync, fp32 accumulation), "
         "wgmma (Hopper TMA + WGMMA grouped GEMMs: bf16, or E4M3 for fp8_block128); the "
         "CPU executor always computes exactly")
      ->capture_default_str();
  cmd->add_option("--worlds", o->worlds,
                  "comma list of ranks (GPUs); auto = 2,1 clipped to the visible GPUs")
      ->capture_default_str();
  cmd->add_option("--executor", o->executor, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed rounds per point")->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "timed rounds per point")->capture_default_str();
  cmd->add_option("--max-point-s", o->max_point_s,
                  "time one point may take: fewer rounds (>= 3) or skipped beyond it")
      ->capture_default_str();
  cmd->add_option("--budget-s", o->budget_s,
                  "wall time of the whole sweep; later points are skipped (0 = none)")
      ->capture_default_str();
  cmd->add_option("--check", o->check,
                  "one round per config against the emulating reference: auto (where the host "
                  "reference is quick) | always | never")
      ->capture_default_str();
  cmd->add_flag("--no-check", o->no_check, "same as --check never");
  cmd->add_option("--check-tokens", o->check_tokens, "tokens per rank of the check round")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, inputs and routing")->capture_default_str();
  cmd->add_option("--timeout-ms", o->timeout_ms, "bounded-wait timeout of the layer")
      ->capture_default_str();
  cmd->add_option("--json", o->json, "also write every point (and the ceilings) to this file");
  cmd->add_option("--hbm-gbps", o->hbm_gbps, "use this HBM bandwidth instead of measuring it");
  cmd->add_option("--peer-gbps", o->peer_gbps, "use this peer bandwidth instead of measuring it");
  cmd->add_option("--matmul-tflops", o->matmul_tflops,
                  "use this bf16 matmul rate instead of measuring it");
  cmd->add_flag("--no-measure", o->no_measure, "measure no ceilings (floors only from the above)");
  cmd->add_flag("--phases", o->phases,
                "also time each phase of a round on the GPU (Layer::set_phase_timing): p50 us "
                "columns per phase on the slowest rank, and phases_us_p50 in the JSON (CUDA only)");
  return Subcommand{cmd, [o] { return bench(*o); }};
}

}  // namespace epmoe::tools
