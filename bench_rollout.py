"""
Benchmark of rollout.py's generate_groups against the HBM roofline (GPU: random-weight Qwen2.5-shaped models, bf16;
CPU: a smoke run on a tiny model):

    python bench_rollout.py [WORKLOAD ...] [--no-hf]   # uniform, ragged, uniform-1.5B, trainer; --no-hf: ours only
    python bench_rollout.py rows [0.5B] [1.5B] [ROWS]  # ms per decode step at 128..8 (or ROWS) live rows vs roofline
    python bench_rollout.py lora [MODEL_DIR]           # decode tok/s with LoRA adapters folded in vs without

The roofline of a workload is the sum over its decode steps of (weight bytes + live K/V bytes) / bandwidth
(decode_bytes); frac = measured tok/s / roofline tok/s. model.generate is timed beside it for the x HF column.
"""
import math
import sys

import torch
import triton
import triton.testing

from bench_logprobs import sync
from rollout import LAST, generate_groups, kv_bytes_per_token

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SHAPES = {"0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936),
          "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=1000)}
# name: (shape, B, G, P, new tokens, EOS). EOS "none": no token ends a row; "1/1000": every 1000th id is EOS, so on
# a random model (near-uniform next-token distribution) lengths are about geometric with mean ~1000, capped;
# "id 2": the trainer's one EOS id (practically unreachable on a random model)
WORKLOADS = {"uniform": ("0.5B", 8, 16, 512, 4096, "none"), "ragged": ("0.5B", 8, 16, 512, 4096, "1/1000"),
             "uniform-1.5B": ("1.5B", 8, 16, 512, 4096, "none"), "trainer": ("0.5B", 32, 8, 64, 64, "id 2")}
if not CUDA:
    WORKLOADS = {k: ("tiny", 2, 4, 16, 48, eos) for k, (_, _, _, _, _, eos) in WORKLOADS.items()}
HF_SECONDS = 30.0  # model.generate gets this much wall time per workload (max_time); see bench_hf
SPEC_BW = {"H100": 3.35e12, "H200": 4.8e12}  # datasheet HBM bytes/s (SXM)


def spec_bandwidth():
    """this GPU's datasheet HBM bytes/s from SPEC_BW; None for another device or the CPU"""
    return next((v for k, v in SPEC_BW.items() if k in torch.cuda.get_device_name()), None) if CUDA else None


def bench_model(shape):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         rope_theta=1e6, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(torch.bfloat16 if CUDA else torch.float32).eval()


def copy_bandwidth():
    """bytes/s of a large device-to-device copy, counting bytes read and written"""
    if not CUDA:
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / (triton.testing.do_bench(lambda: y.copy_(x)) / 1e3)


def decode_bytes(model, prompt_mask, keep, G):
    """bytes the decode steps must read, summed: every step reads each weight once (a tied embedding once, as the LM
    head) plus the K/V of its live rows: each live row's own s columns at step s, and the prompt of every group with
    a live row once (its G rows share it). keep (B*G, C): row r is fed at step s iff keep[r, s]."""
    kv_tok = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists a tied one once
    live = keep[:, 1:].bool()  # (B*G, C-1): fed at steps 1..C-1
    steps = torch.arange(1, keep.shape[1], device=keep.device)
    own = (live * steps).sum()
    prompts = (live.view(-1, G, live.shape[1]).any(1) * prompt_mask.sum(1, keepdim=True)).sum()
    return float(live.any(0).sum()) * weights + float(own + prompts) * kv_tok


def bench_ours(model, prompt_ids, G, T, eos):
    import time
    t0 = time.perf_counter()
    generate_groups(model, prompt_ids, torch.ones_like(prompt_ids), G, T, eos_token_id=eos,
                    pad_token_id=0)  # the same call once untimed: it compiles the forward (T >= COMPILE_MIN_TOKENS)
    sync()                           # and a Triton kernel per bucket's split count (~1 s each, once per process)
    print(f"  (first call, compiling: {time.perf_counter() - t0:.1f} s)", flush=True)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ids, keep = generate_groups(model, prompt_ids, torch.ones_like(prompt_ids), G, T, eos_token_id=eos, pad_token_id=0)
    sync()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    return keep, dt, peak, dict(LAST)


def bench_hf(model, prompt_ids, G, T, eos):
    """model.generate(num_return_sequences=G), stopped after HF_SECONDS (max_time). Its step cost grows with the
    context (dynamic cache, K/V repeated per step), so tokens/s over a cut run is an upper bound on its full run."""
    import time
    kw = dict(do_sample=True, num_return_sequences=G, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
              eos_token_id=list(eos) or None)
    model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=4, **kw)
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=T,
                         max_time=HF_SECONDS, **kw)[:, prompt_ids.shape[1]:]
    sync()
    dt = time.perf_counter() - t0
    is_eos = torch.isin(out, torch.tensor(list(eos), dtype=torch.long, device=out.device))
    ended = is_eos.long().cumsum(1)
    tokens = int(((ended == 0) | ((ended == 1) & is_eos)).sum())
    return tokens / dt, out.shape[1] < T and not bool(is_eos.any(1).all())


def main(names):
    import json
    import transformers
    hf_too = "--no-hf" not in names  # --no-hf: ours only
    names = [n for n in names if n != "--no-hf"] or list(WORKLOADS)
    dev_name = torch.cuda.get_device_name() if CUDA else "cpu"
    copy_bw = copy_bandwidth()
    spec_bw = spec_bandwidth()
    tbs = lambda bw: f"{bw / 1e12:.2f} TB/s" if bw else "-"
    print(f"rollout benchmark on {dev_name}: torch {torch.__version__}, triton {triton.__version__}, transformers "
          f"{transformers.__version__}; sampling T=1; HBM bandwidth: datasheet {tbs(spec_bw)}, a device copy "
          f"{tbs(copy_bw)} (bytes read + written)", flush=True)
    print("roofline: sum over decode steps of (weight bytes + live K/V bytes: each live row's own columns, each "
          "group's prompt once) / bandwidth; tok/s = new tokens / that time. frac = measured / roofline.")
    hdr = (f"{'workload':>13} {'model':>5} {'B':>3} {'G':>3} {'P':>5} {'T':>5} | {'tokens':>7} {'s':>6} "
           f"{'tok/s':>8} {'ms/step':>7} | {'roof tok/s':>10} {'frac':>5} {'frac_cp':>7} | {'peak GiB':>8} | "
           f"{'HF tok/s':>9} {'x HF':>6}  buckets")
    print(hdr, flush=True)
    rows, models = {}, {}
    for name in names:
        shape, B, G, P, T, eos_kind = WORKLOADS[name]
        if shape not in models:
            models.clear()
            sync()
            models[shape] = bench_model(shape)
        model = models[shape]
        V = model.config.vocab_size
        eos = {"none": (), "1/1000": list(range(3, V, 1000)), "id 2": [2]}[eos_kind]
        g = torch.Generator(device=DEV).manual_seed(1)
        prompt_ids = torch.randint(3, V, (B, P), device=DEV, generator=g)
        prompt_ids = prompt_ids.masked_fill(torch.isin(prompt_ids, torch.tensor(eos, dtype=torch.long,
                                                                                device=DEV)), 5)
        torch.manual_seed(2)
        keep, dt, peak, last = bench_ours(model, prompt_ids, G, T, eos)
        tokens = int(keep.sum())
        byts = decode_bytes(model, torch.ones_like(prompt_ids), keep, G)
        bw = spec_bw or copy_bw
        roof = tokens / (byts / bw) if bw else None
        hf, cut = bench_hf(model, prompt_ids, G, T, eos) if hf_too else (None, False)
        r = rows[name] = dict(model=shape, B=B, G=G, P=P, T=T, eos=eos_kind, tokens=tokens, s=dt, tok_s=tokens / dt,
                              ms_per_step=dt / max(last["steps"], 1) * 1e3, decode_bytes=byts,
                              roofline_tok_s=roof, frac=roof and tokens / dt / roof,
                              frac_copy_bw=copy_bw and tokens / dt / (tokens / (byts / copy_bw)), peak_gib=peak,
                              hf_tok_s=hf, hf_cut=cut, x_hf=hf and tokens / dt / hf, buckets=last["buckets"],
                              steps=last["steps"], mean_len=tokens / (B * G))
        fmt = lambda v, f: format(v, f) if v is not None else "-"
        print(f"{name:>13} {shape:>5} {B:>3} {G:>3} {P:>5} {T:>5} | {tokens:>7} {dt:>6.2f} {r['tok_s']:>8.0f} "
              f"{r['ms_per_step']:>7.2f} | {fmt(roof, '>10.0f')} {fmt(r['frac'], '>5.2f')} "
              f"{fmt(r['frac_copy_bw'], '>7.2f')} | {peak:>8.2f} | {fmt(hf, '>9.0f')}{'*' if cut else ' '} "
              f"{fmt(r['x_hf'], '>5.1f')}x  {last['buckets']}", flush=True)
    if "uniform" in rows and "ragged" in rows:
        u, g = rows["uniform"], rows["ragged"]
        roof = f"{g['roofline_tok_s'] / u['roofline_tok_s']:.2f}" if u["roofline_tok_s"] else "-"
        print(f"ragged efficiency = ragged tok/s / uniform tok/s = {g['tok_s'] / u['tok_s']:.2f} (the same ratio of "
              f"their rooflines: {roof}); ragged mean length {g['mean_len']:.0f}, {g['steps']} steps")
    print("* model.generate stopped after HF_SECONDS: its tok/s over the cut run is an upper bound on its full run")
    print(json.dumps(dict(device=dev_name, torch=torch.__version__, triton=triton.__version__,
                          transformers=transformers.__version__, copy_bw=copy_bw, spec_bw=spec_bw, rows=rows)))
    sys.stdout.flush()


def bench_rows(shapes=("0.5B", "1.5B"), row_counts=(128, 64, 32, 16, 8), P=64, T=1024):
    """`python bench_rollout.py rows`: the decode step at a fixed number of live rows (groups of 8 prompts' rows, no
    EOS, T new tokens), ms per step against its roofline: (weights + the live K/V of the average step) / bandwidth.
    A ragged rollout's tail runs at 8-16 rows; a GPU of several holds fewer rows than one alone."""
    bw = spec_bandwidth() or copy_bandwidth() or math.nan
    shapes = shapes if CUDA else ("tiny",)
    T = T if CUDA else 48
    print(f"decode step by live rows on {torch.cuda.get_device_name() if CUDA else 'cpu'}: P={P}, {T} new tokens, no "
          f"EOS; roofline = (weights + live K/V) / {bw / 1e12:.2f} TB/s")
    print(f"{'model':>5} {'rows':>5} | {'ms/step':>8} {'roof ms':>8} {'frac':>5} | {'tok/s':>8}  path")
    for shape in shapes:
        model = bench_model(shape)
        for n in row_counts if CUDA else (8,):
            G = min(n, 8)
            prompt_ids = torch.randint(3, model.config.vocab_size, (n // G, P), device=DEV,
                                       generator=torch.Generator(device=DEV).manual_seed(1))
            keep, dt, _, last = bench_ours(model, prompt_ids, G, T, ())
            steps = max(last["steps"], 1)
            roof = decode_bytes(model, torch.ones_like(prompt_ids), keep, G) / bw / steps * 1e3
            ms = dt / steps * 1e3
            print(f"{shape:>5} {n:>5} | {ms:>8.3f} {roof:>8.3f} {roof / ms:>5.2f} | {keep.sum() / dt:>8.0f}  "
                  f"{last.get('path')}", flush=True)
        del model
        sync()


def bench_lora(path=None, r=16, B=8, G=8, P=64, T=1024):
    """`python bench_rollout.py lora [MODEL_DIR]`: the decode on a model (a bf16 HF directory, else the random 1.5B)
    with and without LoRA adapters (r=16, B random so the fold changes the weights): the decode folds each adapter
    into its weights once per rollout (rollout.fuse_projections), so both should cost the same a token."""
    import time
    import lora
    from transformers import AutoModelForCausalLM
    if path and CUDA:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    else:
        model = bench_model("1.5B" if CUDA else "tiny")
    B, T = (B, T) if CUDA else (2, 48)
    prompt_ids = torch.randint(3, model.config.vocab_size, (B, P), device=DEV,
                               generator=torch.Generator(device=DEV).manual_seed(1))
    print(f"decode with and without LoRA (r={r}) on {torch.cuda.get_device_name() if CUDA else 'cpu'}: "
          f"{path or ('random 1.5B' if CUDA else 'tiny')}, {B} prompts x {G}, P={P}, {T} new tokens, no EOS",
          flush=True)
    rate = {}
    for name in ("base", "lora"):
        if name == "lora":
            lora.add_lora(model, r, 2 * r, 0.0)
            for m in model.modules():
                if lora.is_lora(m):
                    torch.nn.init.normal_(m.lora_B["default"].weight, std=0.02)
        for timed in (False, True):  # the first call compiles and captures
            sync()
            t0 = time.perf_counter()
            ids, keep = generate_groups(model, prompt_ids, torch.ones_like(prompt_ids), G, T, eos_token_id=(),
                                        pad_token_id=0)
            sync()
            dt = time.perf_counter() - t0
        rate[name] = float(keep.sum()) / dt
        print(f"{name:>5}: {dt:6.2f} s, {rate[name]:8.0f} tok/s, path {LAST.get('path')}", flush=True)
    print(f"LoRA / base decode tok/s = {rate['lora'] / rate['base']:.3f}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["rows"]:  # shapes and row counts in any order: rows 1.5B 16 8
        bench_rows(tuple(a for a in argv[1:] if not a.isdigit()) or ("0.5B", "1.5B"),
                   tuple(int(a) for a in argv[1:] if a.isdigit()) or (128, 64, 32, 16, 8))
    elif argv[:1] == ["lora"]:
        bench_lora(*argv[1:2])
    else:
        main(argv)
