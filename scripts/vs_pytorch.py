#!/usr/bin/env python3
"""The HiLoRe tape against PyTorch on the same model and shapes; driven by vs-pytorch.sh.

`run` (the driver) launches one process per measurement, interleaved A B A B over the
repetitions: `worker` processes for PyTorch (eager store-all, per-layer checkpointing, the
attention core alone) and `hilore bench-tape` processes for the tape. Each process builds
its inputs, runs an untimed warm-up pass, an untimed memory pass and one timed pass, and
reports wall seconds (time.perf_counter), CPU seconds of the whole process (getrusage user
+ system, every thread: the same counter as the tape's) and peak resident-set growth.

Peak RSS growth, on both sides the same: before the memory pass the allocator hands its
free memory back to the kernel (glibc malloc_trim(0)), the kernel's high-water mark is
reset (`echo 5 > /proc/self/clear_refs`) and VmRSS read; VmHWM after the pass minus that
VmRSS is the growth: what one forward + backward adds to a process whose model, inputs,
code and thread pools are already resident (the warm-up faulted them in). The warm-up's
own reading (one-time costs included) is kept as `first_pass_rss_growth`.

`check` compares PyTorch's per-token log-probs with the tape's on the same tokens
(`hilore bench-tape --logprobs`).
"""

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

# The benchmark decoder's 896-row microbatch (`hilore bench --rows 896`): eight sequences
# whose rows (tokens - 1) add up to 896, the shape of models/tests/planner.rs.
TRAIN_SHAPE = "161,97,129,65,193,81,113,65"

MODEL_METHODS = [
    ("torch-store-all", "PyTorch store-all"),
    ("tape-store-all", "tape store-all"),
    ("torch-checkpoint", "PyTorch+checkpoint"),
    ("tape-recompute-all", "tape recompute-all"),
]


# ----- measurement (both sides measure the same way) ---------------------------------


# The attention core alone takes a few milliseconds a pass, where a pass on a pool that
# has just woken up or memory just returned to the kernel shows: each of its processes
# (PyTorch's and the tape's alike) runs ATTN_WARMUP untimed passes and reports the median
# of ATTN_TIMED timed ones.
ATTN_WARMUP = 3
ATTN_TIMED = 7


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def trim_heap():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measured(fn, trim=False):
    """Runs fn() once: wall and CPU seconds, peak RSS growth (None where unavailable);
    with trim, the allocator's free memory is returned to the kernel first."""
    if trim:
        trim_heap()
    base = status_bytes("VmRSS") if reset_peak_rss() else None
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    hwm = status_bytes("VmHWM")
    rss = None if base is None or hwm is None else max(0, hwm - base)
    return {"wall": wall, "cpu": cpu, "rss_growth": rss}


# ----- PyTorch worker -----------------------------------------------------------------


def torch_setup(threads):
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return torch


def load_model(torch, model_dir):
    import transformers
    from transformers import AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])
    minor = int(transformers.__version__.split(".")[1])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", **{dtype_kw: torch.float32}
    )
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        v = getattr(model.config, key, 0.0)
        if v not in (0, 0.0, None):
            raise SystemExit(f"{model_dir}: config {key} = {v}; the comparison needs 0")
    return model


def model_inputs(torch, seqs):
    """The model inputs of a case: `(inputs, targets, valid, layout)`. Equal-length
    sequences are one [B, L - 1] batch; other cases are right-padded to the longest one
    with an attention mask, as a PyTorch GRPO trainer batches its responses (TRL pads
    too): the padded positions are computed and their log-probs get coefficient 0
    (`valid` is the 0/1 mask of real tokens)."""
    lens = {len(s) for s in seqs}
    if len(lens) == 1:
        t = torch.tensor(seqs, dtype=torch.long)
        return {"input_ids": t[:, :-1]}, t[:, 1:], torch.ones(t[:, 1:].shape), "batch"
    width = max(len(s) for s in seqs) - 1
    ids, tgt, att = [], [], []
    for s in seqs:
        pad = width - (len(s) - 1)
        ids.append(s[:-1] + [0] * pad)
        tgt.append(s[1:] + [0] * pad)
        att.append([1] * (len(s) - 1) + [0] * pad)
    att = torch.tensor(att)
    inputs = {"input_ids": torch.tensor(ids), "attention_mask": att}
    return inputs, torch.tensor(tgt), att.float(), "padded"


def token_logprobs(torch, model, inputs, targets):
    logits = model(**inputs, use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def worker_model(args):
    torch = torch_setup(args.threads)
    model = load_model(torch, args.model)
    model.train()
    if args.method == "torch-checkpoint":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        if not getattr(model.model, "gradient_checkpointing", False):
            raise SystemExit("gradient checkpointing did not switch on")
    case = json.load(open(args.tokens))["cases"][0]
    inputs, targets, valid, layout = model_inputs(torch, case["sequences"])
    g = torch.Generator().manual_seed(args.seed)
    coeffs = torch.randn(targets.shape, generator=g) * valid

    def step():
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(torch, model, inputs, targets)
        (coeffs * logp).sum().backward()

    warm = measured(step)
    mem = measured(step, trim=True)
    timed = measured(step)
    return {
        "layout": layout,
        "tokens": int(valid.sum().item()),
        "warmup_wall": warm["wall"],
        "wall": timed["wall"],
        "cpu": timed["cpu"],
        "rss_growth": mem["rss_growth"],
        "first_pass_rss_growth": warm["rss_growth"],
        "threads": torch.get_num_threads(),
    }


def worker_attention(args):
    torch = torch_setup(args.threads)
    import torch.nn.functional as F

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    t = args.t
    g = torch.Generator().manual_seed(args.seed)
    q = torch.randn(1, hq, t, d, generator=g).requires_grad_()
    k = torch.randn(1, hkv, t, d, generator=g).requires_grad_()
    v = torch.randn(1, hkv, t, d, generator=g).requires_grad_()
    grad = torch.randn(1, hq, t, d, generator=g)
    scale = 1.0 / math.sqrt(d)
    gqa = "enable_gqa"
    try:
        F.scaled_dot_product_attention(
            q[:, :, :2], k[:, :, :2], v[:, :, :2], is_causal=True, enable_gqa=True
        )
    except TypeError:
        gqa = "repeat_interleave"

    def step():
        for x in (q, k, v):
            x.grad = None
        if gqa == "enable_gqa":
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            r = hq // hkv
            o = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(r, dim=1),
                v.repeat_interleave(r, dim=1),
                is_causal=True,
                scale=scale,
            )
        o.backward(grad)

    # A few milliseconds a pass: warm the pool up over several passes and take the
    # median of several timed ones (the tape's side does the same, see tape_attention).
    warm = measured(step)
    for _ in range(ATTN_WARMUP - 1):
        measured(step)
    mem = measured(step, trim=True)
    runs = [measured(step) for _ in range(ATTN_TIMED)]
    timed = {
        "wall": statistics.median(r["wall"] for r in runs),
        "cpu": statistics.median(r["cpu"] for r in runs),
    }
    return {
        "gqa": gqa,
        "tokens": t,
        "warmup_wall": warm["wall"],
        "wall": timed["wall"],
        "cpu": timed["cpu"],
        "rss_growth": mem["rss_growth"],
        "first_pass_rss_growth": warm["rss_growth"],
        "threads": torch.get_num_threads(),
    }


def check(args):
    """Per-token log-probs of PyTorch against the tape's, every case of --tokens."""
    torch = torch_setup(args.threads)
    model = load_model(torch, args.model)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    out = []
    for case in json.load(open(args.tokens))["cases"]:
        inputs, targets, valid, layout = model_inputs(torch, case["sequences"])
        with torch.no_grad():
            logp = token_logprobs(torch, model, inputs, targets)[valid.bool()]
        tape = torch.tensor(case["logprobs"])
        if tape.shape != logp.shape:
            raise SystemExit(
                f"case {case['lengths']}: tape has {tape.numel()} log-probs, PyTorch {logp.numel()}"
            )
        diff = (logp - tape).abs().max().item()
        out.append(
            {
                "lengths": case["lengths"],
                "layout": layout,
                "tokens": int(logp.numel()),
                "max_abs_diff": diff,
                "mean_logprob": logp.mean().item(),
                # The spread the difference is to be read against.
                "logprob_std": logp.std().item(),
            }
        )
    import transformers

    return {
        "parameters": n_params,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cases": out,
    }


# ----- driver -------------------------------------------------------------------------


def sh(cmd, env=None, capture=True):
    p = subprocess.run(cmd, env=env, capture_output=capture, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout or "")
        sys.stderr.write(p.stderr or "")
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    return p.stdout


def thread_env(n):
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[k] = str(n)
    return env


def shape_arg(shape):
    """A --shapes item as `hilore bench-tape --lengths` takes it (one case)."""
    if shape == "train":
        return TRAIN_SHAPE
    return shape.replace("+", ",")


def run(args):
    hilore = os.path.abspath(args.hilore)
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    me = os.path.abspath(__file__)
    shapes = [s for s in args.shapes.split(",") if s]
    threads = [int(t) for t in args.threads.split(",") if t]
    attn = [int(t) for t in args.attention.split(",") if t]
    py = sys.executable
    load0 = os.getloadavg()

    # The tokens of every shape, and the tape's log-probs of them.
    tokens = {}
    for s in shapes:
        f = os.path.join(work, f"tokens-{s.replace('+', '_')}.json")
        sh(
            [hilore, "bench-tape", "--model", args.model, "--lengths", shape_arg(s)]
            + ["--seed", str(args.seed), "--logprobs", f]
        )
        tokens[s] = f
    # The check: the same log-probs from both.
    checks = []
    for s in shapes:
        r = json.loads(
            sh(
                [py, me, "check", "--model", args.model, "--tokens", tokens[s]]
                + ["--threads", str(threads[-1])],
                env=thread_env(threads[-1]),
            ).strip().splitlines()[-1]
        )
        for c in r["cases"]:
            c["shape"] = s
            checks.append(c)
            print(
                f"log-probs {s} ({c['tokens']} tokens, {c['layout']}): PyTorch vs tape max abs diff {c['max_abs_diff']:.3e} (log-probs: mean {c['mean_logprob']:.3f}, std {c['logprob_std']:.3f})",
                flush=True,
            )
        meta_versions = {k: r[k] for k in ("parameters", "torch", "transformers")}
    worst = max(c["max_abs_diff"] for c in checks)
    if worst > args.tolerance:
        raise SystemExit(
            f"the log-probs disagree by {worst:.3e} (> {args.tolerance}): not the same model"
        )

    def tape_model(shape, method, n, rep):
        plan = method.removeprefix("tape-")
        out = os.path.join(work, f"tape-{shape.replace('+', '_')}-{plan}-t{n}-r{rep}.json")
        cmd = [hilore, "bench-tape", "--model", args.model, "--lengths", shape_arg(shape)]
        cmd += ["--plans", plan, "--threads", str(n), "--reps", "1", "--warmup", "1"]
        cmd += ["--seed", str(args.seed), "--json", out]
        if plan != "store-all":
            cmd.append("--no-per-unit")
        sh(cmd, env=thread_env(n))
        row = json.load(open(out))["cases"][0]
        return {
            "tokens": row["tokens"],
            "warmup_wall": row["warmup_wall_seconds"][0],
            "wall": row["wall_seconds"][0],
            "cpu": row["cpu_seconds"][0],
            "rss_growth": row["peak_rss_growth_bytes"],
            "first_pass_rss_growth": row["first_pass_rss_growth_bytes"],
            "heap_growth": row["peak_heap_growth_bytes"],
            "per_unit_seconds": row["per_unit_seconds"],
        }

    def tape_attention(t, n, rep):
        out = os.path.join(work, f"tape-attention-{t}-t{n}-r{rep}.json")
        cmd = [hilore, "bench-tape", "--model", args.model, "--attention", str(t)]
        cmd += ["--threads", str(n), "--reps", str(ATTN_TIMED), "--warmup", str(ATTN_WARMUP)]
        cmd += ["--json", out]
        sh(cmd, env=thread_env(n))
        row = json.load(open(out))["cases"][0]
        return {
            "tokens": row["tokens"],
            "warmup_wall": row["warmup_wall_seconds"][0],
            "wall": row["wall_seconds_median"],
            "cpu": row["cpu_seconds_median"],
            "rss_growth": row["peak_rss_growth_bytes"],
            "first_pass_rss_growth": row["first_pass_rss_growth_bytes"],
            "heap_growth": row["peak_heap_growth_bytes"],
        }

    def torch_worker(extra, n):
        cmd = [py, me, "worker", "--model", args.model, "--threads", str(n)]
        cmd += ["--seed", str(args.seed)] + extra
        return json.loads(sh(cmd, env=thread_env(n)).strip().splitlines()[-1])

    samples = {}  # (kind, shape or T, threads, method) -> [sample]
    for rep in range(args.reps):
        for s in shapes:
            for n in threads:
                for method, _ in MODEL_METHODS:
                    if method.startswith("tape-"):
                        r = tape_model(s, method, n, rep)
                    else:
                        r = torch_worker(
                            ["--method", method, "--tokens", tokens[s]], n
                        )
                    samples.setdefault(("model", s, n, method), []).append(r)
                    progress(rep, args.reps, s, n, method, r)
        for t in attn:
            for n in threads:
                for method in ("torch-sdpa", "tape-attention"):
                    if method == "tape-attention":
                        r = tape_attention(t, n, rep)
                    else:
                        r = torch_worker(["--method", "torch-sdpa", "--t", str(t)], n)
                    samples.setdefault(("attention", str(t), n, method), []).append(r)
                    progress(rep, args.reps, f"T={t}", n, method, r)

    rows = []
    for (kind, case, n, method), ss in samples.items():
        row = {
            "kind": kind,
            "shape": case,
            "threads": n,
            "method": method,
            "tokens": ss[0]["tokens"],
            "wall_seconds_median": statistics.median(x["wall"] for x in ss),
            "cpu_seconds_median": statistics.median(x["cpu"] for x in ss),
            "peak_rss_growth_bytes_median": median_opt([x["rss_growth"] for x in ss]),
            "wall_seconds": [x["wall"] for x in ss],
            "cpu_seconds": [x["cpu"] for x in ss],
            "warmup_wall_seconds": [x["warmup_wall"] for x in ss],
            "peak_rss_growth_bytes": [x["rss_growth"] for x in ss],
            "first_pass_rss_growth_bytes": [x["first_pass_rss_growth"] for x in ss],
        }
        row["cpu_per_wall"] = row["cpu_seconds_median"] / row["wall_seconds_median"]
        for k in ("layout", "gqa"):
            if k in ss[0]:
                row[k] = ss[0][k]
        if "heap_growth" in ss[0]:
            row["peak_heap_growth_bytes"] = max(x["heap_growth"] for x in ss)
        units = [x["per_unit_seconds"] for x in ss if x.get("per_unit_seconds")]
        if units:
            row["per_unit_seconds_median"] = {
                u: statistics.median(m[u] for m in units) for u in units[0]
            }
        rows.append(row)
    result = {
        "meta": {
            **meta_versions,
            # Relative to the repository, so the JSON reads the same on every machine.
            "model": os.path.relpath(
                args.model, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            ),
            "shapes": {s: shape_arg(s) for s in shapes},
            "threads": threads,
            "reps": args.reps,
            "cpus": os.cpu_count(),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
            "rss": "peak resident-set growth over one forward+backward after a warm-up: "
            "malloc_trim(0), VmHWM reset by /proc/self/clear_refs, VmHWM after the pass "
            "minus VmRSS before it; each measurement its own process",
            "cpu": "getrusage(RUSAGE_SELF) user + system seconds over the timed pass",
        },
        "logprob_check": checks,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print()
    print(markdown(result, shapes, threads, attn))
    print(f"results: {args.out}")


def median_opt(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def progress(rep, reps, case, n, method, r):
    rss = "?" if r["rss_growth"] is None else f"{r['rss_growth'] / 2**20:.1f} MiB"
    print(
        f"  rep {rep + 1}/{reps} {case:<10} {n} thr {method:<19} wall {r['wall']:.4f} s  cpu {r['cpu']:.4f} s  rss +{rss}",
        file=sys.stderr,
        flush=True,
    )


def markdown(result, shapes, threads, attn):
    by = {(r["kind"], r["shape"], r["threads"], r["method"]): r for r in result["rows"]}

    def t(r):
        return f"{r['wall_seconds_median']:.4f} / {r['cpu_seconds_median']:.4f} ({r['cpu_per_wall']:.2f})"

    def ratio(a, b, key):
        return f"{a[key] / b[key]:.2f}"

    def mib(r):
        v = r["peak_rss_growth_bytes_median"]
        return "-" if v is None else f"{v / 2**20:.1f}"

    def mratio(a, b):
        x, y = a["peak_rss_growth_bytes_median"], b["peak_rss_growth_bytes_median"]
        return "-" if not x or not y else f"{x / y:.2f}"

    lines = [
        "Forward + backward of the whole model, medians over the repetitions; each cell "
        "`wall s / CPU s (CPU/wall)`; ratios are tape / PyTorch (wall, CPU): below 1 the tape is faster.",
        "",
        "| shape | tokens | threads | PyTorch store-all | tape store-all | ratio | PyTorch+checkpoint | tape recompute-all | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        for n in threads:
            a, b, c, d = (by[("model", s, n, m)] for m, _ in MODEL_METHODS)
            lines.append(
                f"| {s} | {a['tokens']} | {n} | {t(a)} | {t(b)} | "
                f"{ratio(b, a, 'wall_seconds_median')}, {ratio(b, a, 'cpu_seconds_median')} | "
                f"{t(c)} | {t(d)} | "
                f"{ratio(d, c, 'wall_seconds_median')}, {ratio(d, c, 'cpu_seconds_median')} |"
            )
    lines += [
        "",
        "Peak resident-set growth over one forward + backward, MiB (median over processes); ratios tape / PyTorch.",
        "",
        "| shape | threads | PyTorch store-all | tape store-all | ratio | PyTorch+checkpoint | tape recompute-all | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        for n in threads:
            a, b, c, d = (by[("model", s, n, m)] for m, _ in MODEL_METHODS)
            lines.append(
                f"| {s} | {n} | {mib(a)} | {mib(b)} | {mratio(b, a)} | {mib(c)} | {mib(d)} | {mratio(d, c)} |"
            )
    if attn:
        gqa = next(
            (r.get("gqa") for r in result["rows"] if r["method"] == "torch-sdpa"), "?"
        )
        lines += [
            "",
            f"Attention core alone (one sequence of T rows, causal, forward + backward; PyTorch: scaled_dot_product_attention, GQA by {gqa}).",
            "",
            "| T | threads | PyTorch sdpa | tape attention | ratio | PyTorch RSS + MiB | tape RSS + MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for T in attn:
            for n in threads:
                a = by[("attention", str(T), n, "torch-sdpa")]
                b = by[("attention", str(T), n, "tape-attention")]
                lines.append(
                    f"| {T} | {n} | {t(a)} | {t(b)} | "
                    f"{ratio(b, a, 'wall_seconds_median')}, {ratio(b, a, 'cpu_seconds_median')} | {mib(a)} | {mib(b)} |"
                )
    units = [
        (s, n, by[("model", s, n, "tape-store-all")].get("per_unit_seconds_median"))
        for s in shapes
        for n in threads
    ]
    units = [u for u in units if u[2]]
    if units:
        order = ["embed", "attn_norm", "qkv", "attn_core", "attn_out", "mlp_norm", "gate_up", "down", "head"]
        lines += [
            "",
            "Tape, forward + backward per unit, each unit in isolation (its real inputs, a fresh "
            "store-all tape, summed over the layers), median seconds.",
            "",
            "| unit | " + " | ".join(f"{s}, {n} thr" for s, n, _ in units) + " |",
            "|---|" + "---|" * len(units),
        ]
        for u in order:
            lines.append(f"| {u} | " + " | ".join(f"{m[u]:.5f}" for _, _, m in units) + " |")
        lines.append(
            "| sum | " + " | ".join(f"{sum(m.values()):.5f}" for _, _, m in units) + " |"
        )
    for c in result["logprob_check"]:
        lines.append("")
        lines.append(
            f"log-probs {c['shape']}: PyTorch vs tape max abs diff {c['max_abs_diff']:.3e} over {c['tokens']} tokens ({c['layout']})"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the whole comparison (vs-pytorch.sh calls this)")
    r.add_argument("--hilore", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--shapes", default="128x7,512x4,train")
    r.add_argument("--threads", default="1,2")
    r.add_argument("--attention", default="512,2048")
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--seed", type=int, default=7)
    r.add_argument("--tolerance", type=float, default=1e-3)
    w = sub.add_parser("worker", help="one PyTorch measurement (JSON on stdout)")
    w.add_argument("--model", required=True)
    w.add_argument("--method", required=True, choices=["torch-store-all", "torch-checkpoint", "torch-sdpa"])
    w.add_argument("--tokens")
    w.add_argument("--t", type=int)
    w.add_argument("--threads", type=int, required=True)
    w.add_argument("--seed", type=int, default=7)
    c = sub.add_parser("check", help="PyTorch log-probs against the tape's")
    c.add_argument("--model", required=True)
    c.add_argument("--tokens", required=True)
    c.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.cmd == "run":
        run(a)
    elif a.cmd == "worker":
        if a.method == "torch-sdpa":
            print(json.dumps(worker_attention(a)))
        else:
            print(json.dumps(worker_model(a)))
    else:
        print(json.dumps(check(a)))


if __name__ == "__main__":
    main()
