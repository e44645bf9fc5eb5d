"""s6 tile timeline (run on the tree of d97d408, whose kernel has the TRACE clock stamps; HEAD has not): one traced
each K step's empty wait; consumer: before/after each K step's ready wait, the E release, the epilogue)."""
import os, statistics, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import torch
from bench_lce import CANONICAL, make_problem
from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_ws import _launch_ws, user_gemm, ws_config

OUT = Path(os.environ.get("OUT", "/tmp/tl")); OUT.mkdir(parents=True, exist_ok=True)
p = make_problem(**CANONICAL, seed=3)
packed = PackedLinearCompress.from_weight(p.weight, CANONICAL["ku"], p.bias)
U, B, Ku, Kc, D, N = p.shape
yu = torch.empty(U, N, D, device="cuda", dtype=p.cand_emb.dtype)
user_gemm(packed, p.user_emb, yu)
out = torch.empty(B, N, D, device="cuda", dtype=p.cand_emb.dtype)
cfg = ws_config(D, 2)
P = torch.cuda.get_device_properties(0).multi_processor_count
lines = []
for mode, up in (("fused", yu), ("alone", None)):
    trace = torch.zeros(P, 64, 48, dtype=torch.int64, device="cuda")
    for _ in range(3):
        _launch_ws(packed, p.cand_emb, out, up, p.cand_to_user, packed.bias if up is not None else None, cfg, trace=trace)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    _launch_ws(packed, p.cand_emb, out, up, p.cand_to_user, packed.bias if up is not None else None, cfg, trace=trace)
    e1.record(); torch.cuda.synchronize()
    ms = e0.elapsed_time(e1)
    t = trace.cpu().numpy()
    tiles = [len(range(pid, B * 4, P)) for pid in range(P)]
    span = max(t[pid, tiles[pid] - 1, 34] - t[pid, 0, 0] for pid in range(P))
    mhz = span / (ms * 1e3)
    def med(vals):
        return statistics.median(vals) if vals else float("nan")
    rows = {}
    def add(name, vals):
        rows[name] = (med(vals), statistics.quantiles(vals, n=10)[0] if len(vals) > 10 else float("nan"),
                      statistics.quantiles(vals, n=10)[-1] if len(vals) > 10 else float("nan"))
    period = [t[p_, i + 1, 24] - t[p_, i, 24] for p_ in range(P) for i in range(1, tiles[p_] - 2)]
    add("tile period (consumer K step 0 data to the next tile's)", period)
    add("epilogue (after last wgmma wait to stores issued)", [t[p_, i, 34] - t[p_, i, 33] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
    for kt in range(8):
        add(f"K step {kt}: consumer ready wait", [t[p_, i, 24 + kt] - t[p_, i, 16 + kt] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
        add(f"K step {kt}: producer empty wait", [t[p_, i, 8 + kt] - t[p_, i, kt] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
        add(f"K step {kt}: issue to data seen (load latency or more)", [t[p_, i, 24 + kt] - t[p_, i, 8 + kt] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
        add(f"K step {kt}: issue to consumer's wait start (lead)", [t[p_, i, 16 + kt] - t[p_, i, 8 + kt] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
    add("E slot: consumer release (K step 1) to producer's step-3 issue", [t[p_, i, 11] - t[p_, i, 32] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
    add("E step: producer empty wait", [t[p_, i, 36] - t[p_, i, 35] for p_ in range(P) for i in range(1, tiles[p_] - 1)])
    lines += [f"## {mode}: kernel {ms:.4f} ms, {mhz:.0f} MHz from the busiest program's span ({span} cycles)", "",
              "| interval | median cycles | p10 | p90 | median µs |", "|---|---:|---:|---:|---:|"]
    for name, (m, lo, hi) in rows.items():
        lines.append(f"| {name} | {m:.0f} | {lo:.0f} | {hi:.0f} | {m / mhz:.3f} |")
    lines.append("")
    torch.save(trace.cpu(), OUT / f"trace_{mode}.pt")
(OUT / "timeline.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
