"""What the baselines (torch_ep.py, flashinfer_ep.py, torch_gemm.py) share: the model table, the
sweep's arguments, the round plan, statistics, floors, the table's cells, the ceilings and the
JSON writer; and, given torch (passed in: importing this module needs none), the weights, the
routing, the grouped GEMM and the barrier that carries a flag.

Each script puts its own folder first on sys.path and imports this module, so it works as
`python3 tools/baselines/X.py` and under `python3 -m torch.distributed.run ... X.py` alike."""

import json
import math
import os
import sys

MODELS = {  # hidden, moe intermediate, routed experts, experts per token (as tools' models.cpp)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "tiny": (64, 64, 16, 4),
}

TRAFFIC_KEYS = ("weight_bytes", "pairs", "flops", "nvlink_bytes", "dispatched_rows",
                "returned_rows", "hbm_floor_ms", "compute_floor_ms", "nvlink_floor_ms")

EP_CEILINGS = ("hbm_gbps", "peer_gbps", "matmul_tflops")


# ---- arguments ----

def add_model_args(p, models, experts=0):
    """--models and --experts, with these defaults."""
    p.add_argument("--models", default=models,
                   help="comma list of NAME[:EXPERTS]; names: " + ", ".join(MODELS))
    p.add_argument("--experts", type=int, default=experts,
                   help="cap every model without :EXPERTS at this many experts (0 = the model's)")


def add_tokens_worlds_args(p, tokens_help="comma list of T (tokens per rank)"):
    p.add_argument("--tokens", default="0,1,16,64,128,512,2048,8192", help=tokens_help)
    p.add_argument("--worlds", default="auto",
                   help="comma list of world sizes <= the processes; auto = all of them, then 1")


def add_timing_args(p, what="rounds"):
    """--warmup, --rounds, --max-point-s, --budget-s; `what`: what a round is called."""
    p.add_argument("--warmup", type=int, default=2, help=f"untimed {what} per point")
    p.add_argument("--rounds", type=int, default=10, help=f"timed {what} per point")
    p.add_argument("--max-point-s", type=float, default=8.0,
                   help="time one point may take: fewer rounds (>= 3) or skipped beyond it")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="wall time of the whole sweep; later points are skipped (0 = none)")


def add_ceilings_arg(p, source="an `epmoe bench --json` file",
                     ceilings="HBM / peer / matmul ceilings"):
    p.add_argument("--ceilings-from", default="",
                   help=f"{source}: its measured {ceilings} give this run's floors")


def parse_models(text, experts_cap):
    out = []
    for spec in [s for s in text.split(",") if s]:
        name, _, e = spec.partition(":")
        if name not in MODELS:
            sys.exit(f"--models: {name}: must be one of {', '.join(MODELS)}")
        h, i, n, k = MODELS[name]
        experts = n
        if e:
            experts = min(int(e), n)
        elif experts_cap > 0:
            experts = min(experts_cap, n)
        out.append(dict(name=name, hidden=h, intermediate=i, experts=experts, model_experts=n,
                        top_k=k))
    return out


def worlds_of(args, nproc):
    """--worlds as a list, largest first, each in [1, nproc]."""
    if args.worlds == "auto":
        worlds = {nproc, 1}
    else:
        try:
            worlds = {int(w) for w in args.worlds.split(",") if w.strip()}
        except ValueError:
            sys.exit(f"--worlds {args.worlds!r}: 'auto' or a comma list of integers")
    return sorted((w for w in worlds if 1 <= w <= nproc), reverse=True)


def model_label(m):
    """A model's name, with E<experts>/<the model's> where capped; m: a model or a point."""
    name = m["name"] if "name" in m else m["model"]
    return name if m["experts"] == m["model_experts"] else \
        f'{name} E{m["experts"]}/{m["model_experts"]}'


# ---- rounds, statistics, floors ----

def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(len(v) - 1, lo + 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def plan_rounds(args, last_ms, scale, what="forward"):
    """(warmup, rounds, skip note or None) of a point whose previous point took last_ms (None:
    none yet) and is `scale` times smaller: every round, fewer (>= 3 timed, 1 warm-up) to fit
    --max-point-s, or a skip; `epmoe bench`'s rule (tools/sweep.cpp, plan_rounds)."""
    warmup, rounds = args.warmup, args.rounds
    if last_ms is None:
        return warmup, rounds, None
    est_s = last_ms * max(1.0, scale) * 1e-3
    if est_s * (warmup + rounds) <= args.max_point_s:
        return warmup, rounds, None
    warmup = min(warmup, 1)
    rounds = max(3, int(args.max_point_s / est_s) - warmup)
    if est_s * (warmup + rounds) > 1.5 * args.max_point_s:
        return warmup, rounds, (f"estimated {est_s:.2f} s per {what} exceeds "
                                f"--max-point-s={args.max_point_s:g}")
    return warmup, rounds, None


def traffic_floors(tr, ceilings, hbm_bytes, flops, link_bytes, world):
    """Sets tr's hbm / compute / nvlink floors (ms) from the busiest rank's weight bytes, flops
    and link bytes (None where that ceiling is unknown)."""
    c = ceilings
    tr["hbm_floor_ms"] = (hbm_bytes / (c["hbm_gbps"] * 1e9) * 1e3
                          if c.get("hbm_gbps") else None)
    tr["compute_floor_ms"] = (flops / (c["matmul_tflops"] * 1e12) * 1e3
                              if c.get("matmul_tflops") else None)
    if world == 1:
        tr["nvlink_floor_ms"] = 0.0
    elif c.get("peer_gbps"):
        tr["nvlink_floor_ms"] = link_bytes / (c["peer_gbps"] * 1e9) * 1e3
    else:
        tr["nvlink_floor_ms"] = None
    return tr


def finish_point(p, lat, traffic, world, rounds_wanted):
    """An EP point's statistics, mean traffic, efficiencies and bound from its latencies (ms,
    the slowest rank's per round) and per-round traffic."""
    p.update(status="ok", rounds=len(lat), latency_ms=lat,
             latency_ms_p50=percentile(lat, 0.5), latency_ms_p90=percentile(lat, 0.9),
             latency_ms_min=min(lat))
    if len(lat) < rounds_wanted:
        p["note"] = f"stopped after {len(lat)} rounds (--max-point-s)"
    for key in traffic[0]:
        vals = [tr[key] for tr in traffic]
        p[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    sec = p["latency_ms_p50"] * 1e-3
    p["eff_tbps"] = p["weight_bytes"] / world / sec / 1e12 if sec > 0 else None
    p["eff_tflops"] = p["flops"] / world / sec / 1e12 if sec > 0 else None
    floors = {"hbm": p["hbm_floor_ms"], "mma": p["compute_floor_ms"],
              "nvl": p["nvlink_floor_ms"]}
    floors = {n: v for n, v in floors.items() if v}
    p["bound"] = max(floors, key=floors.get) if floors else ""
    p["floor_ms"] = floors[p["bound"]] if floors else None


# ---- output ----

def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def print_ep_table(points, modes=False):
    """The EP baselines' table; `modes`: with a column eager / graph."""
    mode_head = f"{'mode':5} " if modes else ""
    print(f"\n{'model':22} {'W':>2} {mode_head}{'T':>5} {'p50 ms':>9} {'p90 ms':>9} {'wt GB':>8} "
          f"{'TB/s':>6} {'TFLOPS':>7} {'NVL MB':>8} {'floor ms':>9} bound  check")
    for p in points:
        mode = f"{'graph' if p['graph'] else 'eager':5} " if modes else ""
        head = f"{model_label(p):22} {p['world']:>2} {mode}{p['tokens_per_rank']:>5} "
        if p["status"] != "ok":
            print(head + f"{p['status']}: {p['note']}")
            continue
        gb = None if p["weight_bytes"] is None else p["weight_bytes"] / 1e9
        mb = None if p["nvlink_bytes"] is None else p["nvlink_bytes"] / 1e6
        print(head + f"{fmt(p['latency_ms_p50']):>9} {fmt(p['latency_ms_p90']):>9} "
              f"{fmt(gb):>8} {fmt(p['eff_tbps'], '.2f'):>6} {fmt(p['eff_tflops'], '.1f'):>7} "
              f"{fmt(mb, '.2f'):>8} {fmt(p['floor_ms']):>9} {p['bound'] or '-':5}  {p['check']}")


def read_ceilings(path, keys=EP_CEILINGS, tag="from"):
    """The ceilings `keys` of an `epmoe bench [gemm] --json` file (None each where there is no
    file), with the file's path under `tag`."""
    c = {key: None for key in keys}
    if path and os.path.exists(path):
        with open(path) as f:
            got = json.load(f).get("ceilings", {})
        c.update({key: got.get(key) for key in keys})
        c[tag] = path
    return c


def write_json(path, doc):
    """doc to path, whole or not at all (a temporary file, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# ---- with torch (the module, and the device, passed in) ----

def init_rank_env(port):
    """(rank, world size, local rank) from torchrun's variables; a plain `python3 X.py` is a
    world of one on 127.0.0.1:`port` (MASTER_PORT overrides)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def make_weights(torch, device, hidden, inter, e_local, seed):
    """w13 [E, 2I, H] and w2 [E, H, I] in bf16, as a checkpoint has them: U(-1, 1)/sqrt(fan_in),
    drawn expert by expert (no fp32 copy of the whole layer)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(e_local, 2 * inter, hidden, device=device, dtype=torch.bfloat16)
    w2 = torch.empty(e_local, hidden, inter, device=device, dtype=torch.bfloat16)
    for e in range(e_local):
        w13[e] = (torch.rand(2 * inter, hidden, device=device, generator=g) * 2 - 1) / \
            math.sqrt(hidden)
        w2[e] = (torch.rand(hidden, inter, device=device, generator=g) * 2 - 1) / \
            math.sqrt(inter)
    return w13, w2


def make_routing(torch, device, t, experts, k, seed):
    """ids [t, k] int64 (uniform top-k, distinct experts, 5 % of slots -1), weights [t, k] fp32
    (0.1 + U(0, 1), 0 where dropped, normalised)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(t, experts, device=device, generator=g).topk(k, dim=1).indices
    drop = torch.rand(t, k, device=device, generator=g) < 0.05
    ids = ids.masked_fill(drop, -1)
    w = (0.1 + torch.rand(t, k, device=device, generator=g)).masked_fill(drop, 0.0)
    return ids, w / w.sum(1, keepdim=True).clamp_min(1e-30)


def any_rank(torch, dist, device, flag, group):
    """True on every rank of the group if `flag` is on any; also a barrier (all-reduce, sync)."""
    v = torch.tensor([1 if flag else 0], device=device, dtype=torch.int32)
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    return bool(v.item())


def slowest_rank(torch, dist, device, mine, world, group):
    """Per round, the largest of the group's latencies (a list of floats)."""
    lat = torch.tensor(mine, device=device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(lat, op=dist.ReduceOp.MAX, group=group)
    return lat.cpu().tolist()


def loop_mm(a, b, offs):
    """a [M, K], b [E, K, N], offs [E] cumulative row ends -> [M, N]."""
    out = a.new_empty(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def pick_grouped_mm(torch, device, log):
    """(f(a, b, offs), name): torch._grouped_mm where it exists and passes a probe, else
    loop_mm; `log` says why not."""
    if not hasattr(torch, "_grouped_mm"):
        log("torch._grouped_mm does not exist in this torch: per-expert matmul loop")
        return loop_mm, "per-expert matmul loop"
    try:
        g = torch.Generator(device=device).manual_seed(5)
        a = torch.randn(48, 64, device=device, generator=g).to(torch.bfloat16)
        b = torch.randn(3, 32, 64, device=device, generator=g).to(torch.bfloat16)
        bt = b.transpose(1, 2)  # [E, K, N] as a view of [E, N, K], like the weights
        offs = torch.tensor([16, 16, 48], device=device, dtype=torch.int32)  # one empty
        got = torch._grouped_mm(a, bt, offs=offs).float()
        want = loop_mm(a, bt, offs).float()
        err = ((got - want).norm() / want.norm()).item()
        if err < 1e-2:
            return (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)), "torch._grouped_mm"
        log(f"torch._grouped_mm probe: rel err {err:.3g}; per-expert matmul loop")
    except Exception as e:  # noqa: BLE001 - any failure means: use the loop
        log(f"torch._grouped_mm unusable ({e}); per-expert matmul loop")
    return loop_mm, "per-expert matmul loop"
