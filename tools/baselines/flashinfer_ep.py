#!/usr/bin/env python3
"""FlashInfer's SM90 expert-parallel MoE layer, timed the way tools/baselines/torch_ep.py and
`epmoe bench` time theirs: the peer on our own GPUs (issue 12, point 5).

What runs: flashinfer-python 0.6.18's `flashinfer.moe_ep.MoEEpLayer` with
`MegaConfig(megakernel=Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(I, K))`, kernel
`sm90_fp8_fp8_bf16_push_cuda`, its defaults: the bf16 weights are quantized by the layer to E4M3
with one fp32 scale per 128 x 128 block; activations are quantized 1 x 128 at the source; dispatch
pushes one FP8 row per (token, destination rank) over NVLink into the peers' symmetric windows
(dedup_dispatch); DeepGEMM-style FP8 block-scaled grouped GEMMs for FC1 and FC2 with SwiGLU
(silu(gate) * up; w13 rows are [gate | up], as in epmoe and torch_ep) and the 1 x 128 requantization
between them; the expert outputs go home as FP8 rows with scales, one per (token, source rank)
(grouped_combine), and are reduced there into bf16. One process per GPU (torchrun); the layer rides
on the torch.distributed process group this script creates (NCCL), through
`BootstrapConfig(process_group=...)`. Rank r holds experts [r * E / W, (r + 1) * E / W).

Same shapes, T, seeds and timing as torch_ep.py, so both see the SAME weights, x and routing
(torch CUDA generators seeded alike; `epmoe bench` draws the same distributions with its own
generator): weights U(-1, 1)/sqrt(fan_in) in bf16, x U(-1, 1) in bf16, routing uniform top-k with
distinct experts per token, 5 % of slots dropped (id -1, which FlashInfer masks), weights 0.1 +
U(0, 1) normalised; ids are passed as int32 (the layer's validator rejects int64). Per point:
--warmup rounds then --rounds timed rounds, an all-reduce barrier before each, CUDA events around
`forward()` on each rank, a round's latency is the slowest rank's, p50 / p90 over rounds. Each T
is timed eagerly and then (unless --no-graph) as a CUDA graph of one forward captured at that T
and replayed with fresh routing copied into its input buffers before each round.

Numerics (the "check" of each point): one extra forward per point (eager, and one replay of the
graph) on real routing; for the first --check-tokens tokens of every rank the dense fp32 forward
that torch_ep.py's check computes (sum over slots of weight * w2 @ (silu(w13_gate @ x) *
(w13_up @ x)), fp32 over the bf16 weights; each rank adds its own experts' share, all-reduced) is
the reference; rel_l2 = |y - ref| / |ref| per rank, the largest over ranks, must be <= 0.10 (the
bound `epmoe run` applies to fp8_block128 against its unquantized forward).

JIT: the first layer compiles two modules with nvcc (sm90_push_a2a: one .cu; sm90_push_fp8_moe_gemm:
the binding .cu and five nv_internal sources) into $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/
0.6.18/90a/cached_ops/, and every new (model, world, max T) compiles FC1's and FC2's DeepGEMM
kernels with nvcc into $TRTLLM_DG_CACHE_DIR. Both variables are set from --jit-cache
(default build/flashinfer-jit, which survives between calls on a warm GPU machine), so one cache
serves every rank and every later run. Cold: minutes (--prepare-only compiles everything the
sweep needs and times nothing).

Wheels: flashinfer-python 0.6.18 (py3-none-any) and apache-tvm-ffi 0.1.15.post2 (cp312 for the
GPU machine's Python 3.12), kept in .gpu_deps/wheels/ (git-ignored; carried to the GPU machine).
`--install` puts them into --site (default build/flashinfer-site) with pip --no-deps --no-index;
nothing else of flashinfer's dependency list is needed for this backend (torch, numpy, filelock,
jinja2, nvidia-ml-py, cuda-bindings, ninja: already on the GPU image).

Output JSON: the schema of `epmoe bench --json` and torch_ep.py (impl "flashinfer_sm90",
precision "fp8_block128", combine "push_fp8", graph false / true, baseline "flashinfer_sm90"),
so bench/plot.py and ../shared/scoreboard.py read it.

  python3 tools/baselines/flashinfer_ep.py --install
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
      tools/baselines/flashinfer_ep.py --prepare-only   # compile all the default sweep needs
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
      tools/baselines/flashinfer_ep.py --json fi.json
  python3 tools/baselines/flashinfer_ep.py --dry-run --json plan.json   # no torch, no GPU
"""

import argparse
import math
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import common  # noqa: E402  (stdlib only at import)
from common import MODELS, TRAFFIC_KEYS, model_label, parse_models, worlds_of  # noqa: E402,F401

FLASHINFER_VERSION = "0.6.18"
TVM_FFI_VERSION = "0.1.15.post2"
KERNEL = "sm90_fp8_fp8_bf16_push_cuda"
IMPL = "flashinfer_sm90"
PRECISION = "fp8_block128"
COMBINE = "push_fp8"
REL_L2_BOUND = 0.10
# Bytes per expert parameter as the layer keeps its weights: E4M3 + one fp32 per 128 x 128 block.
WEIGHT_BYTES_PER_PARAM = 1.0 + 4.0 / (128 * 128)


def default_path(env, *parts):
    return os.environ.get(env) or os.path.join(REPO, *parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="FlashInfer's SM90 EP MoE layer (flashinfer-python %s, %s), timed like "
        "tools/baselines/torch_ep.py. Run one process per GPU: python3 -m torch.distributed.run "
        "--nproc-per-node=N tools/baselines/flashinfer_ep.py ..." % (FLASHINFER_VERSION, KERNEL),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common.add_model_args(p, "qwen3-30b-a3b,deepseek-v3")
    common.add_tokens_worlds_args(p, "comma list of T (tokens per rank); the largest is the "
                                  "layer's max_tokens_per_rank")
    common.add_timing_args(p)
    p.add_argument("--shape-timeout-s", type=float, default=900.0,
                   help="one (model, world) may take this long, layer build and JIT included; "
                   "past it the script writes its JSON (that shape's points as errors) and exits "
                   "124 instead of hanging (0 = no limit)")
    p.add_argument("--hard-limit-s", type=float, default=0.0,
                   help="the same for the whole run (0 = none); bench/run_all.sh sets it")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-graph", action="store_true", help="time eager forwards only")
    p.add_argument("--check-tokens", type=int, default=16,
                   help="tokens per rank checked against the dense fp32 forward, per point "
                   "(0 = no check)")
    common.add_ceilings_arg(p)
    p.add_argument("--json", default="", help="write the points here (rank 0)")
    p.add_argument("--jit-cache", default=default_path("FLASHINFER_EP_JIT", "build",
                                                       "flashinfer-jit"),
                   help="FlashInfer's JIT cache (FLASHINFER_WORKSPACE_BASE) and DeepGEMM's "
                   "(TRTLLM_DG_CACHE_DIR = JIT/deepgemm); env FLASHINFER_EP_JIT")
    p.add_argument("--site", default=default_path("FLASHINFER_EP_SITE", "build",
                                                  "flashinfer-site"),
                   help="where --install puts the wheels; put first on sys.path when it exists; "
                   "env FLASHINFER_EP_SITE")
    p.add_argument("--wheels", default=default_path("FLASHINFER_EP_WHEELS", ".gpu_deps",
                                                    "wheels"),
                   help="folder of the flashinfer-python and apache-tvm-ffi wheels; env "
                   "FLASHINFER_EP_WHEELS")
    p.add_argument("--install", action="store_true",
                   help="install the wheels into --site (pip --no-deps --no-index; one process, "
                   "before torchrun) and exit; a no-op when the right versions are there")
    p.add_argument("--prepare-only", action="store_true",
                   help="build every (model, world) layer and run one forward (all JIT "
                   "compilation), time nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="no torch, no GPU: the plan (every point, skipped with its reason) as "
                   "table and JSON")
    args = p.parse_args(argv)
    if args.check_tokens < 0:
        p.error("--check-tokens must be >= 0")
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    try:
        args.token_list = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: a comma list of integers")
    if not args.token_list or args.token_list[0] < 0:
        p.error("--tokens: at least one T, none negative")
    return args


def unsupported(m, world):
    """Why the sm90_fp8_fp8_bf16_push_cuda backend refuses this shape at this world ('' = runs).
    Its rules (flashinfer 0.6.18: backend.py validate_init, validate_mega_fleet_params,
    Sm90PushWeights): hidden and intermediate multiples of 128, intermediate <= 16384 (the unfused
    FC1 epilogue), top_k in {1, 2, 4, 6, 8}, experts divisible by the world, world <= 32, one
    node."""
    h, i, e, k = m["hidden"], m["intermediate"], m["experts"], m["top_k"]
    if h % 128:
        return f"hidden {h} is not a multiple of 128 ({KERNEL})"
    if i % 128:
        return f"intermediate {i} is not a multiple of 128 ({KERNEL})"
    if i > 16384:
        return f"intermediate {i} > 16384 ({KERNEL}, unfused FC1 epilogue)"
    if k not in (1, 2, 4, 6, 8):
        return f"top_k {k} not in (1, 2, 4, 6, 8) ({KERNEL})"
    if e % world:
        return f"{e} experts do not split over {world}"
    if world > 32:
        return f"world {world} > 32 ({KERNEL} is single-node, at most 32 ranks)"
    return ""


def base_point(m, world, graph, check):
    p = dict(impl=IMPL, baseline=IMPL, model=m["name"], hidden=m["hidden"],
             intermediate=m["intermediate"], experts=m["experts"],
             model_experts=m["model_experts"], top_k=m["top_k"], precision=PRECISION,
             combine=COMBINE, graph=graph, mode="cuda_graph" if graph else "eager", world=world,
             check=check, rel_l2=None, warmup=0, rounds=0, latency_ms=[], latency_ms_p50=None,
             latency_ms_p90=None, latency_ms_min=None, bound="", floor_ms=None, eff_tbps=None,
             eff_tflops=None)
    p.update({key: None for key in TRAFFIC_KEYS})
    return p


def settings_of(args):
    return dict(warmup=args.warmup, rounds=args.rounds, seed=args.seed,
                routing="uniform top-k, 5% slots dropped (the seeds of torch_ep.py)",
                gemm="FlashInfer sm90 push: DeepGEMM FP8 block-scaled grouped GEMMs (nvcc JIT)",
                dispatch="one FP8 row (1x128 scales) per (token, destination rank); FP8 grouped "
                "combine, one row per (token, source rank)",
                kernel=KERNEL, kernel_config=dict(capacity_factor=1.0, dedup_dispatch=True,
                                                  grouped_combine=True, fuse_fc1_epilogue=False,
                                                  payload_dtype="fp8", combine_dtype="fp8"),
                graph=not args.no_graph, check_tokens=args.check_tokens,
                check_rule=f"rel_l2 <= {REL_L2_BOUND} vs the dense fp32 forward",
                max_point_s=args.max_point_s, flashinfer_python=FLASHINFER_VERSION,
                apache_tvm_ffi=TVM_FFI_VERSION, jit_cache=os.path.abspath(args.jit_cache))


def write_json(path, doc):
    common.write_json(path, doc)


def print_table(points):
    common.print_ep_table(points, modes=True)


# ---------------------------------------------------------------------------------------------
# --install and --dry-run: no torch


def installed_versions(site):
    """(flashinfer, tvm_ffi) versions installed in `site` ('' where absent), from dist-info."""
    found = {"flashinfer_python": "", "apache_tvm_ffi": ""}
    if os.path.isdir(site):
        for name in os.listdir(site):
            if name.endswith(".dist-info"):
                dist, _, ver = name[: -len(".dist-info")].partition("-")
                if dist in found:
                    found[dist] = ver
    return found["flashinfer_python"], found["apache_tvm_ffi"]


def install(args):
    fi, tvm = installed_versions(args.site)
    if fi == FLASHINFER_VERSION and tvm == TVM_FFI_VERSION and \
            os.path.isdir(os.path.join(args.site, "flashinfer")):
        print(f"flashinfer_ep: flashinfer-python {fi} and apache-tvm-ffi {tvm} already in "
              f"{args.site}")
        return 0
    if not os.path.isdir(args.wheels):
        print(f"flashinfer_ep: no wheel folder {args.wheels}; here (with network): pip download "
              f"--no-deps flashinfer-python=={FLASHINFER_VERSION} apache-tvm-ffi=={TVM_FFI_VERSION}"
              f" --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d "
              f"{args.wheels}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--no-index", "--no-compile", "--upgrade", "--target", args.site,
           "--find-links", args.wheels, f"flashinfer-python=={FLASHINFER_VERSION}",
           f"apache-tvm-ffi=={TVM_FFI_VERSION}"]
    print("flashinfer_ep: " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"flashinfer_ep: pip install failed (rc {rc}); the folder {args.wheels} holds: "
              f"{sorted(os.listdir(args.wheels))} (apache-tvm-ffi needs the wheel of this "
              f"Python, cp{sys.version_info[0]}{sys.version_info[1]})", file=sys.stderr)
        return 2
    print(f"flashinfer_ep: installed into {args.site} in {time.monotonic() - t0:.1f} s")
    return 0


def dry_run(args):
    models = parse_models(args.models, args.experts)
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    points = []
    for world in worlds_of(args, nproc):
        for m in models:
            for graph in ([False] if args.no_graph else [False, True]):
                why = unsupported(m, world)
                for t in args.token_list:
                    p = base_point(m, world, graph, "skipped")
                    p.update(tokens_per_rank=t, status="skipped",
                             note=why or "dry run (no GPU touched)")
                    points.append(p)
    print_table(points)
    if args.json:
        write_json(args.json, {
            "schema": "epmoe-bench/1", "tool": "flashinfer_ep",
            "executor": f"dry run: flashinfer-python {FLASHINFER_VERSION} ({KERNEL}) not imported",
            "gpus": [], "ceilings": common.read_ceilings(""),
            "settings": settings_of(args), "prepare": [], "total_s": 0.0, "points": points})
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------
# The GPU run


class ShapeTimeout:
    """A watchdog: past the deadline of the current shape (or of the whole run) it dumps every
    thread's stack, lets rank 0 write the JSON with the unfinished points as errors, and ends the
    process with 124, so torchrun stops the others: a peer that died or a device-side wait that
    never ends cannot hang the run."""

    def __init__(self, owner, hard_limit_s):
        self.owner = owner
        self.t0 = time.monotonic()
        self.hard = hard_limit_s
        self.deadline = None
        self.what = ""
        self.lock = threading.Lock()
        threading.Thread(target=self.loop, daemon=True).start()

    def arm(self, seconds, what):
        with self.lock:
            self.deadline = time.monotonic() + seconds if seconds > 0 else None
            self.what = what

    def loop(self):
        import faulthandler

        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self.lock:
                shape = self.deadline is not None and now > self.deadline
                whole = self.hard > 0 and now - self.t0 > self.hard
                what = self.what
            if not (shape or whole):
                continue
            why = (f"--hard-limit-s={self.hard:g} passed" if whole else
                   f"--shape-timeout-s passed in {what}")
            print(f"[flashinfer_ep] rank {self.owner.rank}: {why}; stacks follow, exiting 124",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            try:
                self.owner.write_doc(final=False, note=why)
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                print(f"[flashinfer_ep] could not write the JSON: {e}", file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(124)


class FlashInferEP:
    def __init__(self, args):
        self.args = args
        self.t_start = time.monotonic()
        # Never NVLink multicast on these machines; the push backend does not ask for it either
        # (SymmDeviceMemory(enable_multicast=False)).
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)
        jit = os.path.abspath(args.jit_cache)
        os.makedirs(jit, exist_ok=True)
        # Read by flashinfer at import (jit/env.py) and by DeepGEMM's JIT at first use.
        os.environ["FLASHINFER_WORKSPACE_BASE"] = jit
        os.environ["TRTLLM_DG_CACHE_DIR"] = os.path.join(jit, "deepgemm")
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
            import shutil

            nvcc = shutil.which("nvcc")
            cuda_home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
            os.environ["CUDA_HOME"] = cuda_home
        if os.path.isdir(os.path.join(args.site, "flashinfer")):
            sys.path.insert(0, os.path.abspath(args.site))

        import datetime

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        self.torch, self.dist, self.F = torch, dist, F
        if not torch.cuda.is_available():
            sys.exit("flashinfer_ep.py needs CUDA GPUs (one process per GPU under torchrun); "
                     "--dry-run runs without")
        self.rank, self.nproc, self.local = common.init_rank_env(29534)
        self.device = torch.device("cuda", self.local)
        torch.cuda.set_device(self.device)
        cap = torch.cuda.get_device_capability(self.device)
        if cap != (9, 0):
            sys.exit(f"flashinfer_ep.py: {KERNEL} needs an SM90 (Hopper) GPU; "
                     f"{torch.cuda.get_device_name(self.device)} is sm_{cap[0]}{cap[1]}")
        self.fi = self.import_flashinfer()
        dist.init_process_group("nccl", device_id=self.device,
                                timeout=datetime.timedelta(minutes=60))
        self.points, self.prepare, self.current = [], [], []
        self.models, self.tokens = [], []
        self.ceilings = common.read_ceilings("")
        self.gpus = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())]
        self.watchdog = ShapeTimeout(self, args.hard_limit_s)

    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def import_flashinfer(self):
        t0 = time.monotonic()
        try:
            import flashinfer
            from flashinfer import moe_ep
        except Exception as e:  # noqa: BLE001 - any failure: say what and how to fix it
            sys.exit(f"flashinfer_ep.py: cannot import flashinfer ({type(e).__name__}: {e}). "
                     f"Install the wheels first: python3 {os.path.relpath(__file__)} --install "
                     f"(from {self.args.wheels} into {self.args.site}); sys.path[0] = "
                     f"{sys.path[0]}")
        names = ("MoEEpLayer", "BootstrapConfig", "FleetParams", "MoEWeightPack", "MegaConfig",
                 "MoEEpTensors", "Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig")
        missing = [n for n in names if not hasattr(moe_ep, n)]
        if missing:
            sys.exit(f"flashinfer_ep.py: flashinfer {flashinfer.__version__} "
                     f"({flashinfer.__file__}) lacks flashinfer.moe_ep.{', '.join(missing)}; "
                     f"this script is written against {FLASHINFER_VERSION}")
        self.fi_version = flashinfer.__version__
        if self.fi_version != FLASHINFER_VERSION and int(os.environ.get("RANK", "0")) == 0:
            print(f"[flashinfer_ep] warning: flashinfer {self.fi_version} imported from "
                  f"{flashinfer.__file__}, written against {FLASHINFER_VERSION}", flush=True)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[flashinfer_ep] flashinfer {self.fi_version} from "
                  f"{os.path.dirname(flashinfer.__file__)} imported in "
                  f"{time.monotonic() - t0:.1f} s; JIT cache "
                  f"{os.environ['FLASHINFER_WORKSPACE_BASE']}, CUDA_HOME "
                  f"{os.environ.get('CUDA_HOME')}", flush=True)
        return moe_ep

    # ---- the same draws as torch_ep.py (same seeds, same generator, same order) ----
    def make_weights(self, hidden, inter, e_local, seed):
        return common.make_weights(self.torch, self.device, hidden, inter, e_local, seed)

    def make_routing(self, t, experts, k, seed):
        """ids [t, k] int32 (-1 = dropped slot), contiguous; weights [t, k] fp32."""
        ids, w = common.make_routing(self.torch, self.device, t, experts, k, seed)
        return ids.to(self.torch.int32).contiguous(), w.contiguous()

    def agree(self, flag, group):
        """True on every rank of the group if any rank's flag is; also a barrier."""
        return common.any_rank(self.torch, self.dist, self.device, flag, group)

    # ---- the layer ----
    def build_layer(self, m, world, group, w13, w2):
        fi = self.fi
        boot = fi.BootstrapConfig(world_size=world, rank=self.rank, device=self.local,
                                  process_group=group)
        fleet = fi.FleetParams(num_experts=m["experts"],
                               max_tokens_per_rank=max(self.tokens[-1], 1),
                               token_hidden_size=m["hidden"])
        kernel = fi.Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(intermediate_size=m["intermediate"],
                                                              top_k=m["top_k"])
        return fi.MoEEpLayer(boot, fleet, fi.MoEWeightPack(w13, w2),
                             backend=fi.MegaConfig(megakernel=kernel))

    def forward(self, layer, x, ids, wts):
        return layer.forward(self.fi.MoEEpTensors(hidden_states=x, topk_ids=ids,
                                                  topk_weights=wts))

    # ---- numerics: the dense fp32 forward of the first c tokens of every rank ----
    def reference_rel_l2(self, y, x, ids, wts, w13, w2, e_local, world, group, c):
        """rel_l2 of y[:c] against the dense fp32 forward, the largest over the group's ranks.
        Each rank computes its own experts' share for every rank's first c tokens; an all-reduce
        sums the shares."""
        torch, dist, F = self.torch, self.dist, self.F
        h, k = x.shape[1], ids.shape[1]
        inter = w2.shape[2]
        xs, ids_s, ws = x[:c].contiguous(), ids[:c].long().contiguous(), wts[:c].contiguous()
        if world > 1:
            ax = [torch.empty_like(xs) for _ in range(world)]
            ai = [torch.empty_like(ids_s) for _ in range(world)]
            aw = [torch.empty_like(ws) for _ in range(world)]
            dist.all_gather(ax, xs, group=group)
            dist.all_gather(ai, ids_s, group=group)
            dist.all_gather(aw, ws, group=group)
            xs, ids_s, ws = torch.cat(ax), torch.cat(ai), torch.cat(aw)
        me = dist.get_rank(group)
        ref = torch.zeros(xs.shape[0], h, device=self.device, dtype=torch.float32)
        flat = ids_s.reshape(-1)
        lo = me * e_local
        mine = ((flat >= lo) & (flat < lo + e_local)).nonzero().squeeze(1)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            for e in torch.unique(flat[mine]).tolist():
                sel = mine[flat[mine] == e]
                tok = sel // k
                xe = xs[tok].float()
                hh = xe @ w13[e - lo].float().t()
                a = F.silu(hh[:, :inter]) * hh[:, inter:]
                out = a @ w2[e - lo].float().t()
                ref.index_add_(0, tok, out * ws.reshape(-1)[sel].unsqueeze(1))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if world > 1:
            dist.all_reduce(ref, group=group)
        want = ref[me * c:(me + 1) * c]
        got = y[:c].float()
        den = want.norm()
        err = ((got - want).norm() / den) if float(den) > 0 else (got - want).norm()
        err = err.reshape(1).to(torch.float64)
        if world > 1:
            dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
        return float(err.item())

    def check_text(self, err):
        if err is None:
            return "skipped"
        if not math.isfinite(err):
            return f"fail (rel_l2 {err} vs dense fp32)"
        verdict = "pass" if err <= REL_L2_BOUND else "fail"
        return f"{verdict} (rel_l2 {err:.2g} vs dense fp32, bound {REL_L2_BOUND:g})"

    # ---- what one round moves, for the floors (as torch_ep.py / epmoe bench count it) ----
    def round_traffic(self, ids, m, world, e_local, group):
        torch, dist = self.torch, self.dist
        h, inter, experts = m["hidden"], m["intermediate"], m["experts"]
        t = ids.shape[0]
        flat = ids.reshape(-1).long()
        valid = flat >= 0
        counts = torch.bincount(flat[valid], minlength=experts)  # this rank's slots per expert
        slots_per_owner = counts.view(world, e_local).sum(1)
        # tokens per destination rank: FlashInfer sends a token once per rank that owns one of
        # its experts (dedup_dispatch) and gets one combined row back per such rank.
        owner = torch.where(ids.long() >= 0, ids.long() // e_local, torch.full_like(ids.long(),
                                                                                  world))
        hit = torch.zeros(t, world + 1, device=self.device, dtype=torch.int64)
        hit.scatter_(1, owner, 1)
        tokens_per_owner = hit[:, :world].sum(0)
        if world > 1:
            both = torch.stack([slots_per_owner, tokens_per_owner])  # [2, world]
            rows = [torch.empty_like(both) for _ in range(world)]
            dist.all_gather(rows, both, group=group)
            mat = torch.stack(rows).double().cpu()  # [src, 2, dst]
            slots_to, toks_to = mat[:, 0, :], mat[:, 1, :]
            dist.all_reduce(counts, group=group)
        else:
            slots_to = slots_per_owner.double().cpu().reshape(1, 1)
            toks_to = tokens_per_owner.double().cpu().reshape(1, 1)
        counts = counts.double().cpu()
        expert_bytes = 3.0 * inter * h * WEIGHT_BYTES_PER_PARAM
        touched = (counts > 0).double().view(world, e_local).sum(1)
        pairs = slots_to.sum(0)
        row = h + 4.0 * (h // 128)  # an E4M3 row and its 1 x 128 fp32 scales
        meta = 16.0  # one routing record per (token, slot) sent
        rt, rs = toks_to.clone(), slots_to.clone()
        rt.fill_diagonal_(0.0)
        rs.fill_diagonal_(0.0)
        out = rt.sum(1) * row + rs.sum(1) * meta + rt.sum(0) * row
        inn = rt.sum(0) * row + rs.sum(0) * meta + rt.sum(1) * row
        tr = dict(weight_bytes=float(touched.sum()) * expert_bytes, pairs=float(pairs.sum()),
                  flops=float(pairs.sum()) * 6.0 * inter * h,
                  nvlink_bytes=float(rt.sum()) * 2 * row + float(rs.sum()) * meta,
                  dispatched_rows=float(rt.sum()), returned_rows=float(rt.sum()))
        return common.traffic_floors(tr, self.ceilings, float(touched.max()) * expert_bytes,
                                     float(pairs.max()) * 6.0 * inter * h,
                                     max(float(out.max()), float(inn.max())), world)

    finish_point = staticmethod(common.finish_point)

    # ---- one model at one world size ----
    def sweep_model(self, m, mi, world, group):
        torch, args = self.torch, self.args
        label = model_label(m)
        modes = [False] if args.no_graph else [False, True]
        points = {g: [dict(base_point(m, world, g, "skipped"), tokens_per_rank=t,
                           status="pending", note="") for t in self.tokens] for g in modes}
        ordered = [p for t_i in range(len(self.tokens)) for g in modes for p in [points[g][t_i]]]
        self.current = ordered
        why = unsupported(m, world)
        if why:
            for p in ordered:
                p.update(status="skipped", note=why)
            return ordered
        if args.budget_s > 0 and self.agree(time.monotonic() - self.t_start > args.budget_s,
                                            group):
            for p in ordered:
                p.update(status="skipped", note="over --budget-s")
            return ordered
        self.watchdog.arm(args.shape_timeout_s, f"{label} W={world}")
        for p in ordered:  # what the JSON says if this shape never finishes
            p.update(status="error", note="did not finish (timeout or crash in this shape)")
        self.write_doc(final=False)
        for p in ordered:
            p.update(status="pending", note="")
        e_local = m["experts"] // world
        h, inter, k = m["hidden"], m["intermediate"], m["top_k"]
        t0 = time.monotonic()
        w13, w2 = self.make_weights(h, inter, e_local, args.seed * 1000 + mi * 100 + self.rank)
        g = torch.Generator(device=self.device).manual_seed(args.seed * 7919 + self.rank)
        x_all = ((torch.rand(max(self.tokens[-1], 1), h, device=self.device, generator=g) * 2 - 1)
                 .to(torch.bfloat16))
        layer, err = None, ""

        def failed(stage):
            """Whether `stage` failed on any rank: then every point an error, the layer freed."""
            if not self.agree(bool(err), group):
                return False
            msg = err or "failed on another rank"
            print(f"[flashinfer_ep] rank {self.rank}: {label} W={world}: {stage}: {msg}",
                  file=sys.stderr, flush=True)
            for p in ordered:
                p.update(status="error", note=f"{stage}: {msg}"[:500])
            self.cleanup(layer, group)
            return True

        try:
            layer = self.build_layer(m, world, group, w13, w2)
        except Exception as e:  # noqa: BLE001 - reported in the points, the run goes on
            err = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
        build_s = time.monotonic() - t0
        if failed("layer"):
            return ordered
        # First forward: the symmetric window (collective) and module loads; then every rank
        # knows the layer works. Its own warmup() builds int64 ids that its validator rejects.
        t1 = time.monotonic()
        t_first = min(self.tokens[-1], 16)
        try:
            ids, wts = self.make_routing(t_first, m["experts"], k, args.seed * 99991 + self.rank)
            self.forward(layer, x_all[:t_first], ids, wts)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        first_s = time.monotonic() - t1
        if failed("first forward"):
            return ordered
        self.prepare.append(dict(model=m["name"], experts=m["experts"], world=world,
                                 max_tokens_per_rank=max(self.tokens[-1], 1),
                                 layer_s=round(build_s, 2), first_forward_s=round(first_s, 2)))
        self.log(f"[flashinfer_ep] {label} W={world}: layer (weights drawn, quantized, JIT) in "
                 f"{build_s:.1f} s, first forward {first_s:.1f} s")
        if args.prepare_only:
            for p in ordered:
                p.update(status="skipped", note="--prepare-only")
            self.cleanup(layer, group)
            return ordered

        start_ev = torch.cuda.Event(enable_timing=True)
        stop_ev = torch.cuda.Event(enable_timing=True)
        last = {False: None, True: None}  # (p50 ms, T) per mode
        broken = ""
        for ti, t in enumerate(self.tokens):
            over = args.budget_s > 0 and time.monotonic() - self.t_start > args.budget_s
            if self.agree(over, group):
                for p in ordered:
                    if p["status"] == "pending":
                        p.update(status="skipped", note="over --budget-s")
                break
            x = x_all[:t]
            for graph in modes:
                p = points[graph][ti]
                if broken:
                    p.update(status="error", note=broken)
                    continue
                last_ms, last_t = last[graph] or (None, 0)
                warmup, rounds, skip = common.plan_rounds(
                    args, last_ms, t / last_t if last_t > 0 else float(t))
                if skip:
                    p.update(status="skipped", note=skip)
                    continue
                try:
                    res = self.time_point(layer, m, world, group, e_local, x, t, warmup, rounds,
                                          graph, start_ev, stop_ev, w13, w2)
                except Exception as e:  # noqa: BLE001
                    res = f"{type(e).__name__}: {e}"
                if self.agree(isinstance(res, str), group):
                    msg = res if isinstance(res, str) else "failed on another rank"
                    print(f"[flashinfer_ep] rank {self.rank}: {label} W={world} T={t} "
                          f"{'graph' if graph else 'eager'}: {msg}", file=sys.stderr, flush=True)
                    p.update(status="error", note=msg[:500])
                    if not graph:  # a failed capture leaves eager running (a poisoned layer
                        # fails its next eager round, which ends the shape)
                        broken = f"layer unusable after an error at T={t}: {msg}"[:500]
                    continue
                lat, traffic, rel = res
                p["warmup"] = warmup
                p["rel_l2"] = rel
                p["check"] = self.check_text(rel)
                self.finish_point(p, lat, traffic, world, rounds)
                last[graph] = (p["latency_ms_p50"], t)
                self.log(f"[flashinfer_ep] {label} W={world} T={t} "
                         f"{'graph' if graph else 'eager'}: {p['latency_ms_p50']:.3f} ms, "
                         f"check {p['check']}")
        self.cleanup(layer, group)
        del w13, w2, x_all
        torch.cuda.empty_cache()
        return ordered

    def time_point(self, layer, m, world, group, e_local, x, t, warmup, rounds, graph, start_ev,
                   stop_ev, w13, w2):
        """(latencies of the slowest rank, traffic per round, rel_l2 or None)."""
        torch, args = self.torch, self.args
        k = m["top_k"]
        seed = args.seed * 1000003 + t * 7777
        cg = static = None
        if graph:
            ids, wts = self.make_routing(t, m["experts"], k, seed + self.rank)
            static = (x, ids.clone(), wts.clone())
            cg = torch.cuda.CUDAGraph()
            err = ""
            self.agree(False, group)
            try:
                with torch.cuda.graph(cg):
                    y_static = self.forward(layer, *static)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                err = f"CUDA graph capture: {type(e).__name__}: {e}"
            if self.agree(bool(err), group):
                return err or "CUDA graph capture failed on another rank"
        mine, traffic = [], []
        t0 = time.monotonic()
        y = last = None  # the output of the last round that ran, and its inputs
        for i in range(warmup + rounds):
            ids, wts = self.make_routing(t, m["experts"], k, seed + i * world + self.rank)
            stop = i > warmup + 2 and time.monotonic() - t0 > args.max_point_s
            if self.agree(stop, group):  # also the barrier before the round
                break
            if graph:
                static[1].copy_(ids)
                static[2].copy_(wts)
            start_ev.record()
            if graph:
                cg.replay()
                y = y_static
            else:
                y = self.forward(layer, x, ids, wts)
            stop_ev.record()
            stop_ev.synchronize()
            last = (x, ids, wts)
            if i >= warmup:
                mine.append(start_ev.elapsed_time(stop_ev))
                traffic.append(self.round_traffic(ids, m, world, e_local, group))
        lat = common.slowest_rank(torch, self.dist, self.device, mine, world, group)
        rel = None
        c = min(t, args.check_tokens)
        if c > 0 and last is not None:  # the last round's output against its inputs
            rel = self.reference_rel_l2(y, last[0], last[1], last[2], w13, w2, e_local, world,
                                        group, c)
        if graph:
            del cg
        return lat, traffic, rel

    def cleanup(self, layer, group):
        """Every rank of the group done with the layer, then its window and buffers freed."""
        torch = self.torch
        torch.cuda.synchronize()
        self.agree(False, group)  # the group's barrier (a rank outside it waits elsewhere)
        if layer is not None:
            try:
                layer.destroy()
            except Exception as e:  # noqa: BLE001
                print(f"[flashinfer_ep] rank {self.rank}: layer.destroy(): {e}", file=sys.stderr)
        torch.cuda.synchronize()

    def write_doc(self, final, note=""):
        if self.rank != 0 or not self.args.json:
            return
        pts = list(self.points)
        for p in self.current:
            if p["status"] == "pending" and note:
                p = dict(p, status="error", note=note)
            pts.append(p)
        torch = self.torch
        doc = {
            "schema": "epmoe-bench/1",
            "tool": "flashinfer_ep",
            "executor": f"flashinfer-python {self.fi_version} ({KERNEL}: E4M3, 128x128 weight / "
            f"1x128 activation scales, FP8 dispatch and combine), torch {torch.__version__}, "
            "one process per GPU",
            "gpus": self.gpus,
            "ceilings": self.ceilings,
            "settings": settings_of(self.args),
            "prepare": self.prepare,
            "complete": final,
            "total_s": time.monotonic() - self.t_start,
            "points": pts,
        }
        write_json(self.args.json, doc)

    def run(self):
        args = self.args
        self.models = parse_models(args.models, args.experts)
        self.tokens = args.token_list
        worlds = worlds_of(args, self.nproc)
        if args.ceilings_from and os.path.exists(args.ceilings_from):
            self.ceilings = common.read_ceilings(args.ceilings_from)
        for world in worlds:
            group = self.dist.new_group(ranks=list(range(world)))  # every process calls it
            if self.rank < world:
                for mi, m in enumerate(self.models):
                    self.points += self.sweep_model(m, mi, world, group)
                    self.current = []
                    self.watchdog.arm(0, "")
                    self.write_doc(final=False)
            else:
                self.watchdog.arm(args.shape_timeout_s * max(1, len(self.models)),
                                  f"waiting for world {world}")
            self.dist.barrier()
            self.watchdog.arm(0, "")
        if self.rank == 0:
            print_table(self.points)
            self.write_doc(final=True)
            if args.json:
                print(f"wrote {args.json}")
        self.dist.destroy_process_group()
        bad = any(p["check"].startswith("fail") or p["status"] == "error" for p in self.points)
        return 1 if bad else 0


def main(argv=None):
    args = parse_args(argv)
    if args.install:
        return install(args)
    if args.dry_run:
        return dry_run(args)
    return FlashInferEP(args).run()


if __name__ == "__main__":
    sys.exit(main())
