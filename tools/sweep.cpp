// The parts `epmoe bench` and `epmoe bench gemm` share (tools/sweep.hpp).
#include "sweep.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "epmoe/models.hpp"
#include "executor.hpp"
#include "harness/rank_threads.hpp"

#if defined(EPMOE_HAS_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "harness/device_batch.hpp"
#endif

namespace epmoe::tools::sweep {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

// ---- options ----

void add_sweep_options(CLI::App& cmd, SweepOptions& o) {
  cmd.add_option("--models", o.models,
                 "comma list of NAME[:EXPERTS] (qwen3-30b-a3b, deepseek-v3, gpt-oss-120b, "
                 "mixtral-8x7b, tiny); :EXPERTS keeps that many of the model's experts")
      ->capture_default_str();
  cmd.add_option("--experts", o.experts,
                 "cap every model (without :EXPERTS) at this many experts (0 = the model's)")
      ->capture_default_str();
  cmd.add_option("--precisions", o.precisions,
                 "comma list of bf16, mxfp8, nvfp4, fp8_block128, mxfp4")
      ->capture_default_str();
  cmd.add_option("--math", o.maths,
                 "comma list of expert math: exact, tensor_core (bf16 mma.sync, fp32 "
                 "accumulation), wgmma (Hopper TMA + WGMMA grouped GEMMs: bf16, or E4M3 for "
                 "fp8_block128); the CPU executor always computes exactly")
      ->capture_default_str();
  cmd.add_option("--executor", o.executor, "auto | cpu | cuda")->capture_default_str();
  cmd.add_option("--warmup", o.warmup, "untimed rounds per point")->capture_default_str();
  cmd.add_option("--rounds", o.rounds, "timed rounds per point")->capture_default_str();
  cmd.add_option("--max-point-s", o.max_point_s,
                 "time one point may take: fewer rounds (>= 3) or skipped beyond it")
      ->capture_default_str();
  cmd.add_option("--budget-s", o.budget_s,
                 "wall time of the whole sweep; later points are skipped (0 = none)")
      ->capture_default_str();
  cmd.add_option("--check", o.check,
                 "one round per config against the emulating reference: auto (where the host "
                 "reference is quick) | always | never")
      ->capture_default_str();
  cmd.add_flag("--no-check", o.no_check, "same as --check never");
  cmd.add_option("--check-tokens", o.check_tokens, "tokens per rank of the check round")
      ->capture_default_str();
  cmd.add_option("--seed", o.seed, "seed of weights, inputs and routing")->capture_default_str();
  cmd.add_option("--timeout-ms", o.timeout_ms, "bounded-wait timeout of the layer")
      ->capture_default_str();
  cmd.add_option("--json", o.json, "also write every point (and the ceilings) to this file");
  cmd.add_option("--hbm-gbps", o.hbm_gbps, "use this HBM bandwidth instead of measuring it");
  cmd.add_option("--peer-gbps", o.peer_gbps, "use this peer bandwidth instead of measuring it");
  cmd.add_option("--matmul-tflops", o.matmul_tflops,
                 "use this bf16 matmul rate instead of measuring it");
  cmd.add_flag("--no-measure", o.no_measure, "measure no ceilings (floors only from the above)");
}

void validate_sweep_options(const SweepOptions& o) {
  if (o.warmup < 0) reject("--warmup=" + std::to_string(o.warmup) + ": must be >= 0");
  if (o.rounds < 1) reject("--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check != "auto" && o.check != "always" && o.check != "never")
    reject("--check=" + o.check + ": must be auto, always or never");
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(text);
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<bool> parse_megakernel_values(const std::string& text, bool auto_both) {
  if (text == "auto") return auto_both ? std::vector<bool>{false, true} : std::vector<bool>{false};
  std::vector<bool> out;
  for (const std::string& v : split(text)) {
    if (v != "true" && v != "false")
      reject("--megakernel=" + text + ": give auto, or a comma list of true / false");
    out.push_back(v == "true");
  }
  if (out.empty()) reject("--megakernel: give at least one value");
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

std::vector<std::int64_t> parse_counts(const std::string& text, const std::string& option,
                                       std::int64_t min, const std::string& name,
                                       const std::string& unit) {
  std::vector<std::int64_t> out;
  for (const auto& item : split(text)) {
    const std::int64_t v = parse_int(item, option);
    if (v < min) reject(option + ": " + item + " must be >= " + std::to_string(min) + unit);
    out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) reject(option + ": give at least one " + name + unit);
  return out;
}

std::int64_t TokenCounts::max() const {
  return *std::max_element(by_rank.begin(), by_rank.end());
}

std::string TokenCounts::label() const {
  std::string out;
  for (std::size_t r = 0; r < by_rank.size(); ++r)
    out += (r > 0 ? "/" : "") + std::to_string(by_rank[r]);
  return out;
}

std::vector<TokenCounts> parse_token_counts(const std::string& text, const std::string& option,
                                            std::int64_t min) {
  std::vector<TokenCounts> out;
  for (const auto& item : split(text)) {
    TokenCounts t;
    std::size_t at = 0;
    while (true) {
      const std::size_t slash = item.find('/', at);
      const std::string count = item.substr(at, slash == std::string::npos ? slash : slash - at);
      const std::int64_t v = parse_int(count, option);
      if (v < min)
        reject(option + ": " + item + ": " + count + " must be >= " + std::to_string(min));
      t.by_rank.push_back(v);
      if (slash == std::string::npos) break;
      at = slash + 1;
    }
    out.push_back(t);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const TokenCounts& a, const TokenCounts& b) { return a.max() < b.max(); });
  std::vector<TokenCounts> unique;
  for (const TokenCounts& t : out)
    if (std::none_of(unique.begin(), unique.end(),
                     [&](const TokenCounts& u) { return u.by_rank == t.by_rank; }))
      unique.push_back(t);
  if (unique.empty()) reject(option + ": give at least one T");
  return unique;
}

std::vector<Precision> parse_precisions(const std::string& text) {
  std::vector<Precision> out;
  for (const auto& p : split(text)) out.push_back(parse_precision(p, "--precisions"));
  if (out.empty()) reject("--precisions: empty list");
  return out;
}

std::vector<ExpertMath> parse_maths(const std::string& text) {
  std::vector<ExpertMath> out;
  for (const auto& m : split(text)) out.push_back(parse_expert_math(m, "--math"));
  if (out.empty()) reject("--math: empty list");
  return out;
}

// ---- models ----

std::string Model::label() const {
  return shape.num_experts == model_experts ? name
                                            : name + " E" + std::to_string(shape.num_experts) +
                                                  "/" + std::to_string(model_experts);
}

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

std::vector<Model> parse_models(const SweepOptions& o) {
  std::vector<Model> models;
  for (const auto& spec : split(o.models)) models.push_back(parse_model(spec, o.experts));
  if (models.empty()) reject("--models: give at least one model");
  return models;
}

// ---- inputs ----

std::unique_ptr<ModelData> make_model_data(const Model& m, int max_world, std::uint64_t seed) {
  const auto t0 = Clock::now();
  const LayerShape& s = m.shape;
  auto d = std::make_unique<ModelData>();
  const auto h = static_cast<std::size_t>(s.hidden);
  d->weights = harness::make_random_weights(s, seed);
  d->x.resize(static_cast<std::size_t>(max_world));
  for (int r = 0; r < max_world; ++r)
    harness::fill_uniform_bf16(
        d->x[static_cast<std::size_t>(r)],
        static_cast<std::size_t>(std::max<std::int64_t>(s.max_tokens_per_rank, 1)) * h, 1.0,
        seed * 7919 + 17 + static_cast<std::uint64_t>(r));
  std::fprintf(stderr, "[weights] %s: %.2f G bf16 parameters in %.1f s\n", m.label().c_str(),
               3.0 * double(s.num_experts * s.intermediate * s.hidden) / 1e9, seconds_since(t0));
  return d;
}

const ModelData& ModelDataCache::get(std::size_t model) {
  auto& d = data_[model];
  if (!d) d = make_model_data(models_[model], max_world_, seed_ + model);
  return *d;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double min_of(const std::vector<double>& v) {
  return v.empty() ? kNaN : *std::min_element(v.begin(), v.end());
}

namespace {

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

#endif

}  // namespace

#if defined(EPMOE_HAS_CUDA)
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

Ceilings measure_ceilings(const SweepOptions& o, Backend backend) {
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

void print_ceilings(const Ceilings& c) {
  std::printf("ceilings: HBM %s GB/s (%s); peer %s GB/s (%s); bf16 matmul %s TFLOP/s (%s)\n",
              fmt(c.hbm_gbps > 0 ? c.hbm_gbps : kNaN, "%.0f").c_str(),
              c.hbm_how.empty() ? "not measured" : c.hbm_how.c_str(),
              fmt(c.peer_gbps > 0 ? c.peer_gbps : kNaN, "%.0f").c_str(),
              c.peer_how.empty() ? "not measured" : c.peer_how.c_str(),
              fmt(c.matmul_tflops > 0 ? c.matmul_tflops : kNaN, "%.0f").c_str(),
              c.matmul_how.empty() ? "not measured" : c.matmul_how.c_str());
  std::fflush(stdout);
}

std::size_t slowest_rank(const RoundTimes& times, std::size_t round) {
  std::size_t slowest = 0;
  for (std::size_t r = 1; r < times.ms.size(); ++r)
    if (times.ms[r][round] > times.ms[slowest][round]) slowest = r;
  return slowest;
}

std::vector<Routing> uniform_routing(const LayerShape& s, const TokenCounts& tokens, int world,
                                     int rounds, std::uint64_t seed) {
  std::vector<Routing> routing;
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < world; ++r) {
      const std::int64_t t = tokens.of(r);
      harness::Rng rng(seed * 1000003 + static_cast<std::uint64_t>(t) * 7777 +
                       static_cast<std::uint64_t>(i * world + r));
      routing.push_back(harness::make_routing(s, 1, t, harness::Routing::uniform, 0, rng));
    }
  return routing;
}

// Every rank runs `warmup + rounds` forwards of T tokens with a host barrier before each (so a
// rank's host work never counts against its peers); returns per-rank latencies per round.

RoundTimes time_rounds(Cluster& cluster, const std::vector<Routing>& routing, const ModelData& data,
                       const TokenCounts& token_counts, int warmup, int rounds, double cap_s,
                       Backend backend, [[maybe_unused]] bool phases, [[maybe_unused]] bool graph) {
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
    const std::int64_t tokens = token_counts.of(rank);
    try {
      Layer& layer = cluster.layer(rank);
      std::vector<std::uint16_t> y(
          backend == Backend::cpu_threads ? static_cast<std::size_t>(tokens) * h : 0);
#if defined(EPMOE_HAS_CUDA)
      std::unique_ptr<harness::DeviceBatch> dev;
      std::unique_ptr<EventPair> ev;
      std::unique_ptr<harness::CapturedForward> captured;  // declared after dev: freed first
      if (backend == Backend::cuda_nccl) {
        dev = std::make_unique<harness::DeviceBatch>(rank, s);  // sets this thread's device
        ev = std::make_unique<EventPair>();
        cuda_ok(cudaMemcpy(dev->x(tokens).data, data.x[r].data(),
                           static_cast<std::size_t>(tokens) * h * 2, cudaMemcpyHostToDevice),
                "cudaMemcpy x");
        // Capturing runs nothing: no round is used, so the ranks need not meet for it.
        if (graph) captured = std::make_unique<harness::CapturedForward>(layer, *dev, tokens);
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
          if (captured)
            captured->launch();
          else
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

ConfigCluster make_cluster(const LayerShape& s, Precision precision, const LayerOptions& options,
                           int world, const ModelData& data, Backend backend,
                           const Cluster::Tune& tune) {
  ConfigCluster out;
  const auto t0 = Clock::now();
  try {
    out.cluster = std::make_unique<Cluster>(s, precision, options, world, data.weights, backend,
                                            Cluster::LocalWeights{}, tune);
  } catch (const Error& e) {
    out.unsupported = e.code() == ErrorCode::unsupported;
    out.error = std::string("layer creation: ") + e.what();
  } catch (const std::exception& e) {
    out.error = std::string("layer creation: ") + e.what();
  }
  out.prep_s = seconds_since(t0);
  return out;
}

std::string run_check(SweepRun& st, const SweepOptions& o, Cluster& cluster, const LayerShape& s,
                      Precision precision, const LayerOptions& options, int world) {
  if (!check_wanted(o, s, world)) return "skipped";
  std::string check;
  try {
    check = check_config(cluster, s, precision, options,
                         std::min(o.check_tokens, s.max_tokens_per_rank), o.seed);
  } catch (const std::exception& e) {
    check = std::string("error: ") + e.what();
  }
  if (check != "pass") st.any_failure = true;
  return check;
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
    const auto check = reference::check_output(
        y, cluster.reference(rank).forward(batch), options.combine,
        checked_math(cluster.backend(), options.expert_math), precision, s.intermediate);
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

bool check_wanted(const SweepOptions& o, const LayerShape& s, int world) {
  if (o.no_check || o.check == "never" || o.check_tokens < 1) return false;
  if (o.check == "always") return true;
  // auto: only where the host reference is quick (it quantizes every expert it touches and runs
  // in float64): at most ~200 M expert parameters touched.
  const std::int64_t experts =
      std::min(s.num_experts, static_cast<std::int64_t>(world) * o.check_tokens * s.top_k);
  return experts * 3 * s.intermediate * s.hidden <= 200'000'000;
}

// ---- how many rounds a point runs ----

RoundPlan plan_rounds(const SweepOptions& o, double last_ms, double scale) {
  RoundPlan plan{o.warmup, o.rounds, false, ""};
  if (std::isnan(last_ms)) return plan;
  const double est_s = last_ms * std::max(1.0, scale) * 1e-3;
  if (est_s * (plan.warmup + plan.rounds) <= o.max_point_s) return plan;
  plan.warmup = std::min(plan.warmup, 1);
  plan.rounds = std::max(3, static_cast<int>(o.max_point_s / est_s) - plan.warmup);
  if (est_s * (plan.warmup + plan.rounds) > o.max_point_s * 1.5) {
    char note[160];
    std::snprintf(note, sizeof note,
                  "estimated %.2f s per forward: %d forwards exceed --max-point-s=%g", est_s,
                  plan.warmup + plan.rounds, o.max_point_s);
    plan.skip = true;
    plan.note = note;
  }
  return plan;
}

// ---- output ----

std::string fmt(double v, const char* f) {
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

void write_json_head(std::ostream& f, const char* schema, const char* tool, Backend backend,
                     const Ceilings& c) {
  f << "{\n  \"schema\": " << json_str(schema) << ",\n  \"tool\": " << json_str(tool) << ",\n";
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
}

void write_json_file(const std::string& path, const char* schema, const char* tool, Backend backend,
                     const Ceilings& c, const SweepOptions& o, const std::string& settings,
                     double total_s, std::size_t points,
                     const std::function<void(std::ostream&, std::size_t)>& point) {
  std::ofstream f(path);
  if (!f) reject("--json=" + path + ": cannot open for writing");
  write_json_head(f, schema, tool, backend, c);
  f << "  \"settings\": {\"warmup\": " << o.warmup << ", \"rounds\": " << o.rounds
    << ", \"seed\": " << o.seed << settings << "},\n";
  f << "  \"total_s\": " << json_num(total_s) << ",\n  \"points\": [\n";
  for (std::size_t i = 0; i < points; ++i) {
    point(f, i);
    f << (i + 1 < points ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
  if (!f) reject("--json=" + path + ": write failed");
  f.close();
  std::printf("wrote %s\n", path.c_str());
}

void write_point_head(std::ostream& f, const Model& m, Precision precision) {
  const LayerShape& s = m.shape;
  f << "    {\"impl\": \"epmoe\", \"model\": " << json_str(m.name) << ", \"hidden\": " << s.hidden
    << ", \"intermediate\": " << s.intermediate << ", \"experts\": " << s.num_experts
    << ", \"model_experts\": " << m.model_experts << ", \"top_k\": " << s.top_k
    << ", \"precision\": " << json_str(to_string(precision));
}

void write_json_array(std::ostream& f, const std::vector<double>& values) {
  f << "[";
  for (std::size_t j = 0; j < values.size(); ++j) f << (j ? ", " : "") << json_num(values[j]);
  f << "]";
}

Ceilings start_sweep(const SweepOptions& o, Backend backend, const std::string& executor_line) {
  std::printf("%s\n", executor_line.c_str());
  std::fflush(stdout);
  const Ceilings ceilings = measure_ceilings(o, backend);
  print_ceilings(ceilings);
  return ceilings;
}

}  // namespace epmoe::tools::sweep
