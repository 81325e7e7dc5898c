"""
Where a GRPO step's time goes, against its hardware floor: `python bench_step.py [WORD ...] [-WORD ...]
[--key=value ...]` runs each cell (name has every WORD and no -WORD; the flags join its own) as `grpo.py` for 4 steps
on a random-weight model (bench_e2e's), in a fresh process; step 3 is timed, step 4's update runs under torch.profiler (a cell
with --max_steps=S: steps 3..S-1 are timed, summed, and step S profiled: the ragged cells, whose steps vary). Floors: generation =
the HBM roofline of the decode steps it ran (every weight once a step + each live row's K/V, prompt + tokens so far,
at bench_rollout.SPEC_BW); update = k * N * tokens / the bf16 GEMM rate (an 8192^3 matmul in the same process): N the
matmul parameters, tokens each prompt once + its completions, per pass, k = 6 (forward, input and weight gradients) or
4 for LoRA (no weight gradient for the frozen base); checkpointing's recompute is a cost, not floor. Phases (ranges
set here, none in the library): the GPU time of the kernels launched in forward (the micro-batches' packed
forwards), lm_head (the log-prob kernel, both ways), optimizer (clip + AdamW), backward
(the rest of update_step); comm: NCCL's kernels (2 GPUs: FSDP2's reduce-scatters, overlapping the backward); idle =
its wall with no kernel running.

A random-weight model practically never writes its EOS, so every other cell's completions all run to the cap. A
"ragged" cell's model lists many more EOS ids (bench_e2e's "+eosK" spec), so its lengths are roughly geometric; it
runs with its uniform twin (RAGGED_TWIN: a selected ragged cell brings its twin into the call, so both run on one
GPU), and a last table sets each beside its twin per generated token of the timed step: gen and update seconds a
token, their ratios ragged / uniform, the whole step's generated tokens/s ratio, and the log's padding_frac (the
share of the update's token slots that were padding; "-" where the log has none). `python bench_step.py --list`
names the cells.
"""
import collections
import functools
import json
import math
import os
import sys

import bench_e2e

GC = "--gradient_checkpointing=True"
cell = lambda B, G, C, *more: [f"--prompts_per_step={B}", f"--group_size={G}", f"--max_completion_len={C}", *more]
CELLS = {  # name: (model (a bench_e2e model spec: family[+eosK]), grpo flags, processes (torchrun: FSDP2, rank 0's numbers, per GPU))
    "1.5B full 16x8x1024 gc": ("qwen2.5-1.5b", cell(16, 8, 1024, GC), 1),
    "1.5B full 16x8x1024 mbt=16384": ("qwen2.5-1.5b", cell(16, 8, 1024, "--micro_batch_tokens=16384",
                                                            "--gradient_checkpointing=False"), 1),
    "7B lora 8x8x1024 gc": ("qwen2.5-7b", cell(8, 8, 1024, GC, "--lora_r=16"), 1),
    "1.5B full 8x16x4096 gc": ("qwen2.5-1.5b", cell(8, 16, 4096, GC), 1),
    "135M default 32x16x64": ("smollm2-135m", cell(32, 16, 64), 1),  # the default run's shape
    "1.5B full 32x8x1024 gc 2 GPUs": ("qwen2.5-1.5b", cell(32, 8, 1024, GC, "--fsdp=True"), 2),  # 16 groups a GPU
    # 148 more EOS ids of the 151,936: a row stops with probability ~149/V a token, so its length is about
    # geometric, mean ~1,020 before the cap (which ~2% of rows reach): about the tokens of its twin, ragged
    "1.5B full 16x8x4096 gc ragged": ("qwen2.5-1.5b+eos148", cell(16, 8, 4096, GC, "--max_steps=8"), 1),
}
RAGGED_TWIN = {  # ragged cell: its uniform twin (every completion at its cap), run in the same call
    "1.5B full 16x8x4096 gc ragged": "1.5B full 16x8x1024 gc",
}
PHASES = ("lm_head", "optimizer", "forward", "update")  # innermost first: a kernel counts in the first


def gpu_phases(trace):
    """({phase: seconds of GPU time}, the update's wall seconds, its 8 kernels of most GPU time [(name, s)]) from a
    chrome trace: a kernel belongs to the innermost range open when the host launched it (its correlation id's runtime
    call), on any thread (backward runs on autograd's); idle = the wall minus the union of the kernels' intervals"""
    ev = json.load(open(trace))["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation"
              and e.get("name") in PHASES]
    launch = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    out, busy = dict.fromkeys(("forward", "lm_head", "backward", "optimizer", "comm", "idle"), 0.0), []
    by_kernel = collections.Counter()
    for k in (e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        t = launch.get(k.get("args", {}).get("correlation"))
        names = {n for a, b, n in ranges if t is not None and a <= t <= b}
        if "update" in names:
            phase = "comm" if "nccl" in k["name"].lower() else next(n for n in PHASES if n in names)
            out[phase.replace("update", "backward")] += k["dur"] / 1e6
            busy.append((k["ts"], k["ts"] + k["dur"]))
            by_kernel[k["name"]] += k["dur"] / 1e6
    wall = covered((a, b) for a, b, n in ranges if n == "update") / 1e6  # (a range on two threads counts once)
    out["idle"] = wall - covered(busy) / 1e6  # the wall with no kernel running
    return out, wall, by_kernel.most_common(8)


def covered(intervals):
    """the length of the union of (start, end) intervals"""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        total, end = total + max(b, end) - max(a, end), max(end, b)
    return total


def flag(args, key, default=None):
    """the value of the last --key=value in args: grpo's config takes the last, and a cell's args are bench_e2e's
    BASE (--max_steps=3 among them) followed by the cell's own flags (--max_steps=4)"""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{key}=")]
    return values[-1] if values else default


def run(args):
    """in the cell's process: grpo.train(args), the ranges and the profiler set around it; writes the cell's numbers"""
    import torch
    import triton.testing
    from torch.profiler import ProfilerActivity, profile, record_function
    import batching
    import checkpoint
    import grpo
    import kernel
    import logprobs
    import rollout
    checkpoint.save_checkpoint = lambda *a, **k: None
    grpo.disk_errors = lambda *a: []  # (nothing is written, so no disk space is asked for)
    seen = {"steps": 0}
    steps = int(flag(args, "max_steps"))  # the last step is profiled, the one before it timed
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []))

    def ranged(name, fn, start=False):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if start and seen["steps"] == steps and not seen.get("profiling"):
                seen["profiling"] = prof.start() or True  # the last step's updates, profiled
            with record_function(name):
                return fn(*a, **k)
        return wrapped

    def sample_step(*a, **k):  # the timed steps' groups: what the floors need
        out = sample_fn(*a, **k)
        seen["steps"] += 1
        if 3 <= seen["steps"] <= steps - 1:
            buf = out[0]
            seen.setdefault("timed", []).append((buf["prompt_mask"].sum(1).tolist(),
                                                 buf["completion_mask"].sum(1).tolist(), buf["group_size"]))
        return out

    def load_model(*a, **k):
        seen["model"] = model = load_fn(*a, **k)
        return model
    sample_fn, load_fn = grpo.sample_step, checkpoint.load_model
    grpo.sample_step, checkpoint.load_model = sample_step, load_model
    batching.update_step = ranged("update", batching.update_step, start=True)
    batching.micro_batch_loss = ranged("forward", batching.micro_batch_loss)
    torch.nn.utils.clip_grad_norm_ = ranged("optimizer", torch.nn.utils.clip_grad_norm_)
    torch.optim.AdamW.step = ranged("optimizer", torch.optim.AdamW.step)
    for fn in (kernel._FusedLogprobs, logprobs._ChunkedLogprobs):
        fn.forward, fn.backward = (staticmethod(ranged("lm_head", f)) for f in (fn.forward, fn.backward))
    grpo.train(args)
    if seen.get("profiling"):
        prof.stop()
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports (a profiled rank 1 crashed in teardown once)
        os._exit(0)
    out_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--out_dir="))
    if seen.get("profiling"):
        prof.export_chrome_trace(os.path.join(out_dir, "trace.json"))
    recs = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl")) if line.strip()]
    timed = [r for r in recs if "gen_s" in r][2:-1]  # steps 3..S-1: step S ran under the profiler
    model, dev = seen["model"], torch.cuda.is_available()
    cfg = model.config
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") if dev else None
    rate = 2 * 8192**3 / (triton.testing.do_bench(lambda: x @ x) / 1e3) if dev else float("nan")  # FLOP/s
    lora = int(flag(args, "lora_r", 0)) > 0
    n_mat = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "lora_" not in n
                and ("embed_tokens" not in n or cfg.tie_word_embeddings))  # the matrices a token runs through
    # kv_reuse: each prompt once + its G completions, a pass
    tokens = sum(sum(P) + sum(C) for P, C, _ in seen["timed"]) * int(flag(args, "num_iterations", 1))
    kv_token = rollout.kv_bytes_per_token(cfg, 2)  # bytes of one token's K and V (bf16)
    weights = sum(2 * p.numel() for n, p in model.named_parameters()  # what a decode step reads, bf16 (FSDP2's
                  if "embed_tokens" not in n or cfg.tie_word_embeddings)  # parameters are float32 shards)
    bw = __import__("bench_rollout").spec_bandwidth() or float("nan")  # datasheet HBM bytes/s
    gen_floor = 0.0
    for P, C, G in seen["timed"]:  # each timed step: its decode steps read every weight, and each row's K/V
        kv_read = sum(P[r // G] * c + c * (c - 1) / 2 for r, c in enumerate(C)) * kv_token  # P + t a step
        gen_floor += (max(C) * weights + kv_read) / bw
    C_all = [c for _, C, _ in seen["timed"] for c in C]
    mean = lambda key: sum(r.get(key, 0) for r in timed) / len(timed) if key in timed[0] else None  # noqa: E731
    stats = torch.cuda.memory_stats() if dev else {}  # the run's allocator retries and cudaFrees
    res = dict(gen=sum(r["gen_s"] for r in timed), update=sum(r["update_s"] for r in timed),
               peak=max(r["peak_gib"] for r in recs if "peak_gib" in r), steps=len(timed),
               gen_tokens=sum(C_all), len_max=max(C_all), truncated=mean("truncated"),
               padding_frac=mean("padding_frac"),  # (rank 0's tokens, the log's whole-step keys)
               gen_floor=gen_floor, rate=rate,
               update_floor=(4 if lora else 6) * n_mat * tokens / rate,
               phases=gpu_phases(os.path.join(out_dir, "trace.json")) if dev and seen.get("profiling") else ({}, 1, []),
               mem={k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_free")})  # (each a device sync)
    json.dump(res, open(os.path.join(out_dir, "step.json"), "w"))


def ragged_table(results):
    """each ragged cell of results (name: its step.json) beside its uniform twin, both of this call: the timed
    step's generated tokens, gen and update seconds, each per generated token, and ragged / uniform of those and
    of the step's generated tokens/s"""
    pairs = [(rag, uni) for rag, uni in RAGGED_TWIN.items() if rag in results and uni in results]
    if not pairs:
        return
    print("\nragged vs uniform, the timed steps: us/tok = microseconds per generated token; step tok/s = tokens / "
          "(gen + update); trunc = share of rows cut at the cap; padding = the log's padding_frac")
    print(f"| {'cell':<32} | {'tokens':>7} {'len max':>7} {'trunc':>5} | {'gen s':>6} {'upd s':>6} | "
          f"{'gen us/tok':>10} {'upd us/tok':>10} {'step tok/s':>10} | {'padding':>7}")
    for rag, uni in pairs:
        for name in (uni, rag):
            r = results[name]
            n, pad, trunc = r["gen_tokens"], r.get("padding_frac"), r.get("truncated")
            print(f"| {name:<32} | {n:7d} {r['len_max']:7d} {'-' if trunc is None else f'{trunc:.2f}':>5} | "
                  f"{r['gen']:6.2f} {r['update']:6.2f} | {1e6 * r['gen'] / n:10.2f} {1e6 * r['update'] / n:10.2f} "
                  f"{n / (r['gen'] + r['update']):10.0f} | {'-' if pad is None else f'{pad:.3f}':>7}")
        a, b = results[rag], results[uni]
        per_token = lambda key: (a[key] / a["gen_tokens"]) / (b[key] / b["gen_tokens"])
        step_rate = (a["gen_tokens"] / (a["gen"] + a["update"])) / (b["gen_tokens"] / (b["gen"] + b["update"]))
        print(f"| {'  ragged / uniform':<32} | {a['gen_tokens'] / b['gen_tokens']:7.2f} {'':7} {'':5} | "
              f"{a['gen'] / b['gen']:6.2f} {a['update'] / b['update']:6.2f} | {per_token('gen'):10.2f} "
              f"{per_token('update'):10.2f} {step_rate:10.2f} |", flush=True)


def main(words):
    if "--list" in words:  # the cells, their models and flags, and which twin a ragged cell brings along
        for k, (model, flags, nproc) in CELLS.items():
            twin = f" (twin: {RAGGED_TWIN[k]})" if k in RAGGED_TWIN else ""
            print(f"{k:<32} {model:<20} nproc={nproc} {' '.join(flags)}{twin}")
        return
    import torch
    extra = [w for w in words if w.startswith("--")]  # --key=value: added to every cell's flags
    chosen = list(bench_e2e.select_cells(CELLS, words))  # every WORD, no -WORD
    chosen += [RAGGED_TWIN[k] for k in chosen if k in RAGGED_TWIN]  # a ragged cell is read against its twin
    cells = {k: v for k, v in CELLS.items() if k in chosen}  # (CELLS' order: the twin runs first)
    results = {}
    print(f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}, torch {torch.__version__}; "
          f"seconds of step 3 (or steps 3..S-1, summed), floors as in this file's docstring; phases: the "
          f"profiled last step's update; "
          f"flags: {' '.join(extra) or 'the cells own'}")
    print(f"| {'cell':<32} | {'gen s':>6} {'floor':>6} {'frac':>5} | {'upd s':>6} {'floor':>6} {'frac':>5} | "
          f"{'step':>5} | {'GiB':>5} | update phases, % of its wall")
    for name, (model, flags, nproc) in cells.items():
        if nproc > max(torch.cuda.device_count(), 1):
            print(f"| {name:<32} | SKIP: needs {nproc} GPUs", flush=True)
            continue
        label = " ".join([name, *extra])  # (its own out_dir and log: a run with other flags keeps this one's)
        out_dir = os.path.join(bench_e2e.BENCH_DIR, "step", "".join(c if c.isalnum() else "_" for c in label))
        step_json = os.path.join(out_dir, "step.json")
        if os.path.exists(step_json):  # (an earlier run's: a failed run must not be read as this one)
            os.remove(step_json)
        steps = [] if flag([*flags, *extra], "max_steps") else ["--max_steps=4"]  # (a ragged cell: its own)
        row = bench_e2e.run_cell(label, model, [*flags, *extra, *steps], nproc, out_dir, __file__)
        if not os.path.exists(step_json):
            print(f"| {name:<32} | ERROR {row.get('why', '')}", flush=True)
            continue
        r = results[name] = json.load(open(step_json))
        phases, wall, top = r["phases"]
        ph = " ".join(f"{k} {100 * v / wall:.0f}" for k, v in phases.items())
        print(f"| {name:<32} | {r['gen']:6.2f} {r['gen_floor']:6.2f} {r['gen_floor'] / r['gen']:5.2f} | "
              f"{r['update']:6.2f} {r['update_floor']:6.2f} {r['update_floor'] / r['update']:5.2f} | "
              f"{(r['gen_floor'] + r['update_floor']) / (r['gen'] + r['update']):5.2f} | {r['peak']:5.1f} | {ph} "
              f"(GEMM {r['rate'] / 1e12:.0f} TFLOP/s; profiled: wall {wall:.2f} s, "
              f"kernels {wall - phases.get('idle', 0):.2f} s; allocator {r.get('mem')})", flush=True)
        print("|   the update's top kernels, % of its wall: " + ", ".join(f"{n[:60]} {100 * t / wall:.0f}"
                                                                           for n, t in top))
    ragged_table(results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-cell"]:
        run(sys.argv[2:])
    else:
        main(sys.argv[1:])
