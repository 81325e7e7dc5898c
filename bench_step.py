"""
Where a GRPO step's time goes, against its hardware floor (issue 43): `python bench_step.py [WORD ...] [--key=value
...]` runs each cell (name has every WORD; the flags join its own) as `grpo.py` for 4 steps on a random-weight model
(bench_e2e's), in a fresh process; step 3 is timed, step 4's update runs under torch.profiler. Floors: generation =
the HBM roofline of the decode steps it ran (every weight once a step + each live row's K/V, prompt + tokens so far,
at bench_rollout.SPEC_BW); update = k * N * tokens / the bf16 GEMM rate (an 8192^3 matmul in the same process): N the
matmul parameters, tokens each prompt once + its completions, per pass, k = 6 (forward, input and weight gradients) or
4 for LoRA (no weight gradient for the frozen base); checkpointing's recompute is a cost, not floor. Phases (ranges
set here, none in the library): the GPU time of the kernels launched in prompt (kv_reuse's prompt pass), forward (the
rest of the micro-batches' forwards), lm_head (the log-prob kernel, both ways), optimizer (clip + AdamW), backward
(the rest of update_step); comm: NCCL's kernels (2 GPUs: FSDP2's reduce-scatters, overlapping the backward); idle =
its wall with no kernel running.
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
CELLS = {  # name: (model (a bench_e2e family), grpo flags, processes (torchrun: FSDP2, rank 0's numbers, per GPU))
    "1.5B full 16x8x1024 gc": ("qwen2.5-1.5b", cell(16, 8, 1024, GC), 1),
    "1.5B full 16x8x1024 mbt=16384": ("qwen2.5-1.5b", cell(16, 8, 1024, "--micro_batch_tokens=16384",
                                                            "--gradient_checkpointing=False"), 1),
    "7B lora 8x8x1024 gc": ("qwen2.5-7b", cell(8, 8, 1024, GC, "--lora_r=16"), 1),
    "1.5B full 8x16x4096 gc": ("qwen2.5-1.5b", cell(8, 16, 4096, GC), 1),
    "135M default 32x16x64": ("smollm2-135m", cell(32, 16, 64), 1),  # the default run's shape
    "1.5B full 32x8x1024 gc 2 GPUs": ("qwen2.5-1.5b", cell(32, 8, 1024, GC, "--fsdp=True"), 2),  # 16 groups a GPU
}
PHASES = ("lm_head", "prompt", "optimizer", "forward", "update")  # innermost first: a kernel counts in the first


def gpu_phases(trace):
    """({phase: seconds of GPU time}, the update's wall seconds, its 8 kernels of most GPU time [(name, s)]) from a
    chrome trace: a kernel belongs to the innermost range open when the host launched it (its correlation id's runtime
    call), on any thread (backward runs on autograd's); idle = the wall minus the union of the kernels' intervals"""
    ev = json.load(open(trace))["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation"
              and e.get("name") in PHASES]
    launch = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    out, busy = dict.fromkeys(("prompt", "forward", "lm_head", "backward", "optimizer", "comm", "idle"), 0.0), []
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


def run(args):
    """in the cell's process: grpo.train(args), the ranges and the profiler set around it; writes the cell's numbers"""
    import torch
    import triton.testing
    from torch.profiler import ProfilerActivity, profile, record_function
    import batching
    import checkpoint
    import grpo
    import kernel
    import kv_reuse
    import logprobs
    import rollout
    checkpoint.save_checkpoint = lambda *a, **k: None
    seen = {"steps": 0}
    steps = int(next(a.split("=")[1] for a in args if a.startswith("--max_steps=")))
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []))

    def ranged(name, fn, start=False):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if start and seen["steps"] == steps and not seen.get("profiling"):
                seen["profiling"] = prof.start() or True  # the last step's updates, profiled
            with record_function(name):
                return fn(*a, **k)
        return wrapped

    def sample_step(*a, **k):  # the timed step's groups: what the floors need
        out = sample_fn(*a, **k)
        seen["steps"] += 1
        if seen["steps"] == steps - 1:
            buf = out[0]
            seen.update(P=buf["prompt_mask"].sum(1).tolist(), C=buf["completion_mask"].sum(1).tolist(),
                        G=buf["group_size"])
        return out

    def load_model(*a, **k):  # the prompt pass: the trunk called with kv_reuse's capturing cache
        seen["model"] = model = load_fn(*a, **k)
        trunk, fwd = model.model, model.model.forward

        @functools.wraps(fwd)  # (kv_reuse.cache_arg reads the trunk's signature)
        def forward(*fa, **fk):
            cache = fk.get("cache", fk.get("past_key_values"))
            if cache is not None and isinstance(getattr(cache, "layers", [None])[0], kv_reuse.CaptureLayer):
                with record_function("prompt"):
                    return fwd(*fa, **fk)
            return fwd(*fa, **fk)
        trunk.forward = forward
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
    timed = [r for r in recs if "gen_s" in r][-2]  # step 3: step 4 ran under the profiler
    model, dev = seen["model"], torch.cuda.is_available()
    cfg = model.config
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") if dev else None
    rate = 2 * 8192**3 / (triton.testing.do_bench(lambda: x @ x) / 1e3) if dev else float("nan")  # FLOP/s
    lora = any(a.startswith("--lora_r=") and a != "--lora_r=0" for a in args)
    n_mat = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "lora_" not in n
                and ("embed_tokens" not in n or cfg.tie_word_embeddings))  # the matrices a token runs through
    tokens = (sum(seen["P"]) + sum(seen["C"])) * int(next(  # kv_reuse: each prompt once + its G completions, a pass
        (a.split("=")[1] for a in args if a.startswith("--num_iterations=")), 1))
    kv_token = rollout.kv_bytes_per_token(cfg, 2)  # bytes of one token's K and V (bf16)
    weights = sum(2 * p.numel() for n, p in model.named_parameters()  # what a decode step reads, bf16 (FSDP2's
                  if "embed_tokens" not in n or cfg.tie_word_embeddings)  # parameters are float32 shards)
    P = [seen["P"][r // seen["G"]] for r in range(len(seen["C"]))]  # each row's prompt length
    kv_read = sum(p * c + c * (c - 1) / 2 for p, c in zip(P, seen["C"])) * kv_token  # a row's steps: P + t each
    bw = __import__("bench_rollout").spec_bandwidth() or float("nan")  # datasheet HBM bytes/s
    stats = torch.cuda.memory_stats() if dev else {}  # the run's allocator retries and cudaFrees
    res = dict(gen=timed["gen_s"], update=timed["update_s"], peak=max(r["peak_gib"] for r in recs if "peak_gib" in r),
               gen_floor=(max(seen["C"]) * weights + kv_read) / bw, rate=rate,
               update_floor=(4 if lora else 6) * n_mat * tokens / rate,
               phases=gpu_phases(os.path.join(out_dir, "trace.json")) if dev and seen.get("profiling") else ({}, 1, []),
               mem={k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_free")})  # (each a device sync)
    json.dump(res, open(os.path.join(out_dir, "step.json"), "w"))


def main(words):
    import torch
    extra = [w for w in words if w.startswith("--")]  # --key=value: added to every cell's flags
    cells = {k: v for k, v in CELLS.items() if all(w in k for w in words if w not in extra)}
    print(f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}, torch {torch.__version__}; "
          f"seconds of step 3, floors as in this file's docstring; phases: the profiled step 4's update; "
          f"flags: {' '.join(extra) or 'the cells own'}")
    print(f"| {'cell':<32} | {'gen s':>6} {'floor':>6} {'frac':>5} | {'upd s':>6} {'floor':>6} {'frac':>5} | "
          f"{'step':>5} | {'GiB':>5} | update phases, % of its wall")
    for name, (model, flags, nproc) in cells.items():
        if nproc > max(torch.cuda.device_count(), 1):
            print(f"| {name:<32} | SKIP: needs {nproc} GPUs", flush=True)
            continue
        label = " ".join([name, *extra])  # (its own out_dir and log: a run with other flags keeps this one's)
        out_dir = os.path.join(bench_e2e.BENCH_DIR, "step", "".join(c if c.isalnum() else "_" for c in label))
        row = bench_e2e.run_cell(label, model, [*flags, *extra, "--max_steps=4"], nproc, out_dir, __file__)
        if not os.path.exists(os.path.join(out_dir, "step.json")):
            print(f"| {name:<32} | ERROR {row.get('why', '')}", flush=True)
            continue
        r = json.load(open(os.path.join(out_dir, "step.json")))
        phases, wall, top = r["phases"]
        ph = " ".join(f"{k} {100 * v / wall:.0f}" for k, v in phases.items())
        print(f"| {name:<32} | {r['gen']:6.2f} {r['gen_floor']:6.2f} {r['gen_floor'] / r['gen']:5.2f} | "
              f"{r['update']:6.2f} {r['update_floor']:6.2f} {r['update_floor'] / r['update']:5.2f} | "
              f"{(r['gen_floor'] + r['update_floor']) / (r['gen'] + r['update']):5.2f} | {r['peak']:5.1f} | {ph} "
              f"(GEMM {r['rate'] / 1e12:.0f} TFLOP/s; profiled: wall {wall:.2f} s, "
              f"kernels {wall - phases.get('idle', 0):.2f} s; allocator {r.get('mem')})", flush=True)
        print("|   the update's top kernels, % of its wall: " + ", ".join(f"{n[:60]} {100 * t / wall:.0f}"
                                                                           for n, t in top))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-cell"]:
        run(sys.argv[2:])
    else:
        main(sys.argv[1:])
