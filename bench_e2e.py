"""
The GPU end-to-end check: grpo.py as a researcher runs it, a few real steps per cell, on random-weight local HF
directories built from configs (no hub). CI has no GPU: run it before a change to rollout, batching, kv_reuse or
grpo lands, with its table in the change's note.

    python bench_e2e.py [WORD ...] [-WORD ...]   # the cells whose name has every WORD and no -WORD; --list names them
    python bench_e2e.py --streams=4              # the one-GPU cells in 4 streams over the GPUs: a check, no timing
    python bench_e2e.py --model qwen2.5-7b DIR   # just build a random-weight model directory (bench_fsdp.sh 7b)
    python bench_e2e.py --model qwen2.5-1.5b+eos148 DIR  # the same with 148 more EOS ids (ragged lengths)

Each cell is a fresh process (torchrun for the 2- and 4-GPU cells, skipped with fewer GPUs), `--run-cell --key=value ...`:
grpo.train with no checkpoint written unless BENCH_SAVE=1. gen and update are the last step's seconds (step 1 also
compiles), gnorm its gradient norm (a reward with spread: digit_share); "decode" is the last rollout's path: compiled |
graph (CUDA graphs, eager forward) | fallback (torch.compile failed: graphs, uncompiled) | eager | generate
(model.generate). Logs: BENCH_DIR (/tmp/nanogrpo_e2e). The families keep what differs (Qwen2.5: GQA 6, q/k/v bias, tied;
Llama-3.2: head_dim 64, llama3 RoPE; Qwen3: q/k RMSNorm) at real widths, 4 layers ("/4L"); repro: 28-layer 1.5B.
"""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BENCH_DIR = os.environ.get("BENCH_DIR", "/tmp/nanogrpo_e2e")
SHAPES = {  # family: (config class, config); the layer count is the real model's
    "qwen2.5-1.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                         tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)),
    **{f"qwen2.5-{name}": ("Qwen2Config", dict(  # the untied 7B-32B: vocabulary 152064, 128-wide heads
        vocab_size=152064, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H // 128,
        num_key_value_heads=kv, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=32768))
       for name, H, I, L, kv in (("7b", 3584, 18944, 28, 4), ("14b", 5120, 13824, 48, 8), ("32b", 5120, 27648, 64, 8))},
    "llama3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
                                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192),
                                        max_position_embeddings=131072)),
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)),
    "qwen3-1.7b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True, rope_theta=1e6,
                                       max_position_embeddings=40960)),
}


def make_model_dir(family, path, layers=None, eos_ids=0):
    """a random-weight bf16 HF directory of the family's shape (layers: fewer than the real model's), with a
    character tokenizer padded to the vocabulary (ChatML template; <|im_end|> = id 2 is EOS, which a random model
    practically never samples, so every completion runs to max_completion_len). Built on the GPU; kept if there.
    eos_ids: that many more ids end a completion, listed with id 2 in generation_config.json's eos_token_id (what
    grpo.stop_token_ids reads). A random model's next token is close to uniform over the V ids, so it stops with
    probability ~(eos_ids + 1) / V a token: lengths roughly geometric, mean ~V / (eos_ids + 1). The weights do not
    depend on eos_ids (the same seed): such a directory differs from the plain one only in where rows end."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    cls, cfg = SHAPES[family]
    cfg = dict(cfg, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if layers:
        cfg["num_hidden_layers"] = layers
    V = cfg["vocab_size"]
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(i) for i in range(32, 127)] + ["\n"])}
    named = len(vocab)  # specials and characters; ids from here on are the filler "<tN>"
    vocab.update({f"<t{i}>": i for i in range(named, V)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                               pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = getattr(transformers, cls)(**cfg)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(config)
    torch.set_default_dtype(torch.float32)
    if eos_ids:  # filler ids only (characters keep their meaning: digit_share), the same ones on every build
        extra = sorted(random.Random(0).sample(range(named, V), eos_ids))
        model.generation_config.eos_token_id = [cfg["eos_token_id"], *extra]
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)  # a killed build leaves no half directory that looks whole
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()  # (else this process keeps the weights' memory reserved while the cells run beside it)
    print(f"built {path}: {family}, {config.num_hidden_layers} layers, {n / 1e9:.2f} B parameters, "
          f"{eos_ids + 1} EOS ids", flush=True)
    return path


# ---------------------------------------------------------------------------------------------------------------
# the cells: name -> (model (family/layers), grpo flags, processes)
# ---------------------------------------------------------------------------------------------------------------
BASE = ["--prompts_per_step=8", "--group_size=8", "--max_steps=3", "--max_minutes=0", "--eval_every=0",
        "--eval_size=8", "--eval_samples=0", "--max_prompt_len=512", "--temperature=1.0", "--lr=1e-6",
        "--reward=task,bench_e2e.py:digit_share"]  # (a random model never earns the task's reward: see digit_share)


def digit_share(completion, example):
    """the cells' second reward: the fraction of a completion's characters that are digits. A random model never
    earns the arithmetic reward, so its groups would all have zero advantages and zero gradients, and a NaN or a
    wrong shape in a backward would pass unseen; this reward differs between any two completions (the character
    tokenizer writes most ids as "<tN>"), so every cell's update carries a real gradient."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


FAMILIES = ("qwen2.5-1.5b", "llama3.2-1b", "qwen3-1.7b")
FEATURES = {  # each on the Qwen2.5 4-layer model, 1024 tokens (the compiled decode), checkpointing on
    "beta": ["--beta=0.04"], "spg2": ["--steps_per_generation=2", "--num_iterations=2"],
    "dynamic": ["--dynamic_sampling=True", "--max_sampling_tries=2", "--reward="],  # task reward: all groups flat
    "gspo": ["--importance_sampling_level=sequence"],
    "entropy": ["--top_entropy_quantile=0.2"], "entropy-bonus": ["--entropy_coef=0.01"],
    "no-kv-reuse": ["--kv_reuse=False"],
    "naive": ["--logprob_impl=naive", "--micro_batch_tokens=8192"],  # (its fp32 logits: 32768 tokens need 77 GiB)
    "chunked": ["--logprob_impl=chunked"], "is-correction": ["--vllm_importance_sampling_correction=True"],
    "fp32": ["--dtype=float32"], "cispo": ["--loss_type=cispo", "--epsilon_high=5.0"],
    "sapo": ["--loss_type=sapo"],  # vespo: its weight takes the sampler correction in
    "vespo": ["--loss_type=vespo", "--vllm_importance_sampling_correction=True",
              "--vllm_importance_sampling_mode=token_mask"],
    "deterministic": ["--deterministic=True"],
    "lora": ["--lora_r=16"], "lora-beta": ["--lora_r=16", "--beta=0.04"],  # (peft: in the device image)
}
CELLS = {}
for fam in FAMILIES:
    for T in (64, 1024):
        for gc in (False, True):
            CELLS[f"{fam}/4L T={T}{' gc' if gc else ''}"] = (
                f"{fam}/4", [f"--max_completion_len={T}", f"--gradient_checkpointing={gc}"], 1)
for feat, flags in FEATURES.items():
    CELLS[f"qwen2.5-1.5b/4L T=1024 gc {feat}"] = (
        "qwen2.5-1.5b/4", ["--max_completion_len=1024", "--gradient_checkpointing=True"] + flags, 1)
REPRO = ["--prompts_per_step=16", "--group_size=8", "--max_completion_len=1024", "--gradient_checkpointing=True"]
CELLS["repro qwen2.5-1.5b T=1024 gc"] = ("qwen2.5-1.5b", REPRO, 1)  # issue 19's crash at step 0
CELLS["repro qwen2.5-1.5b T=1024 gc compile=False"] = ("qwen2.5-1.5b", REPRO + ["--compile=False"], 1)
for fsdp in (True, False):  # the same global batch over 2 processes
    CELLS[f"torchrun 2 qwen2.5-1.5b/4L T=1024 gc fsdp={fsdp}"] = (
        "qwen2.5-1.5b/4", ["--max_completion_len=1024", "--gradient_checkpointing=True", f"--fsdp={fsdp}"], 2)
    CELLS[f"torchrun 2 repro qwen2.5-1.5b fsdp={fsdp}"] = ("qwen2.5-1.5b", REPRO + [f"--fsdp={fsdp}"], 2)
for n, p, name in ((2, 32, "weak"), (4, 16, "strong"), (4, 64, "weak")):  # --fsdp=auto; scaling against repro
    CELLS[f"torchrun {n} repro qwen2.5-1.5b {name}"] = ("qwen2.5-1.5b", [f"--prompts_per_step={p}"] + REPRO[1:], n)


def cell_command(nproc, args, script=__file__):
    """the command line of one cell: this file with --run-cell and args, in python or under torchrun. (Not "--run":
    torchrun's parser reads it as an abbreviation of its own --run-path and exits, "ambiguous option".)"""
    launch = ([sys.executable] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    return launch + [os.path.abspath(script), "--run-cell"] + args


def parse_model(model):
    """a cell's model "family[/layers][+eosK]" -> (family, layers or None, K): "qwen2.5-1.5b/4" the family's
    first 4 layers, "+eos148" 148 more EOS ids (make_model_dir's eos_ids: ragged completion lengths)"""
    spec, _, eos = model.partition("+eos")
    family, _, layers = spec.partition("/")
    return family, int(layers or 0) or None, int(eos or 0)


def model_path(model):
    """a cell's model (parse_model's spec) as a directory of BENCH_DIR, built on first use; each spec its own
    directory (a "+eosK" one is not the plain family's)"""
    family, layers, eos_ids = parse_model(model)
    path = os.path.join(BENCH_DIR, "models", model.replace("/", "_"))
    if eos_ids:
        return make_model_dir(family, path, layers, eos_ids)
    return make_model_dir(family, path, layers)  # (three arguments: test_all stubs make_model_dir(family, path, layers))


def run_cell(name, model, flags, nproc, keep=None, script=__file__, env=None):
    """one cell in a fresh process (script's --run-cell); returns its table row (dict). keep: an out_dir to leave;
    env: added to the process's environment"""
    model_dir = model_path(model)
    slug = "".join(c if c.isalnum() else "_" for c in name)
    out_dir, log = keep or os.path.join(BENCH_DIR, "out", slug), os.path.join(BENCH_DIR, "logs", slug + ".txt")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    cmd = cell_command(nproc, BASE + flags + [f"--model={model_dir}", f"--out_dir={out_dir}", "--overwrite=True"],
                       script)
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.path.dirname(os.path.abspath(__file__)),
                            env=dict(os.environ, **(env or {}))).returncode
    wall = time.time() - t0
    row = dict(cell=name, ok=rc == 0, wall=wall)
    recs = []
    if os.path.exists(os.path.join(out_dir, "log.jsonl")):
        recs = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl")) if line.strip()]
    steps = [r for r in recs if "gen_s" in r]
    if steps:
        last = steps[-1]
        row.update(steps=len(steps), gen=last["gen_s"], gen1=steps[0]["gen_s"], update=last["update_s"],
                   peak=max(r["peak_gib"] for r in steps), decode=last.get("decode", "?"),
                   len=last["completion_len_mean"], gnorm=last.get("grad_norm", float("nan")))
    bad = [r["step"] for r in steps if not all(math.isfinite(r.get(k, math.nan)) for k in ("loss", "grad_norm"))]
    if rc != 0 or len(steps) < 3 or bad:
        text = open(log).read().splitlines()
        errs = [line for line in text if "Error" in line or "error" in line] or text[-1:]
        why = f"loss or grad_norm not finite at steps {bad}" if rc == 0 and bad else errs[-1] if errs else f"exit {rc}"
        row["ok"], row["why"] = False, why.strip()[:160]
    if not keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return row


def print_row(r):
    if "gen" in r:
        nums = (f"{r['gen']:6.2f} {r['gen1']:7.1f} {r['update']:7.2f} {r['peak']:6.1f} {r['len']:5.0f} "
                f"{r['gnorm']:7.3f}  {r['decode']:<16}")
    else:
        nums = f"{'':6} {'':7} {'':7} {'':6} {'':5} {'':7}  {'':9}"
    status = "ok" if r["ok"] else "SKIP" if r.get("skipped") else "ERROR"
    print(f"| {r['cell']:<48} {status:<5} {nums} {r['wall']:5.0f}s {r.get('why', '')}", flush=True)
    return r


def select_cells(cells, args):
    """the cells whose name has every WORD and no -WORD of args (--key=value args aside)"""
    words = [a for a in args if not a.startswith("--")]
    return {k: v for k, v in cells.items() if all((w[1:] not in k) if w.startswith("-") else (w in k) for w in words)}


def main(args):
    import torch
    cells = select_cells(CELLS, args)
    if "--list" in args:
        for k, (model, flags, nproc) in cells.items():
            print(f"{k:<48} {model:<16} nproc={nproc} {' '.join(flags)}")
        return
    gpus = torch.cuda.device_count()
    print(f"GPU: {torch.cuda.get_device_name() if gpus else 'none'} x{gpus}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, triton {__import__('triton').__version__}; "
          f"{len(cells)} cells; base flags: {' '.join(BASE)}")
    print(f"| {'cell':<48} {'':<5} {'gen s':>6} {'gen1 s':>7} {'upd s':>7} {'GiB':>6} {'len':>5} {'gnorm':>7}  "
          f"{'decode':<16} wall")
    streams = int(next((a.split("=", 1)[1] for a in args if a.startswith("--streams=")), 1))
    one = [k for k, v in cells.items() if v[2] == 1]  # (with streams: all built first, no two threads build one)
    for model in sorted({cells[k][0] for k in one}) if streams > 1 else []:
        model_path(model)

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # (a parent may have narrowed the GPUs already)
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]  # the GPUs this process sees

    def row(name, s=0):  # stream s runs on the s % gpus-th GPU this process sees
        model, flags, nproc = cells[name]
        if nproc > max(gpus, 1) or (nproc > 1 and not gpus):
            return print_row(dict(cell=name, ok=False, skipped=True, wall=0, why=f"needs {nproc} GPUs, {gpus} here"))
        env = {"CUDA_VISIBLE_DEVICES": ids[s % gpus]} if streams > 1 and nproc == 1 and gpus else None
        return print_row(run_cell(name, model, flags, nproc, env=env))
    with ThreadPoolExecutor(streams) as pool:  # each stream its share of the one-GPU cells in turn, then the rest
        rows = [r for rs in pool.map(lambda s: [row(k, s) for k in one[s::streams]], range(streams)) for r in rs]
    rows += [row(k) for k in cells if k not in one]
    ran = [r for r in rows if not r.get("skipped")]
    print(f"cells: {sum(r['ok'] for r in ran)} ok, {sum(not r['ok'] for r in ran)} failed, "
          f"{len(rows) - len(ran)} skipped")
    with open(os.path.join(BENCH_DIR, "table.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return all(r["ok"] for r in ran)


def run(args):
    """--run-cell: grpo.train(args) in this process"""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import checkpoint
    import grpo
    if os.environ.get("BENCH_SAVE") != "1":  # grpo calls checkpoint.save_checkpoint
        checkpoint.save_checkpoint = lambda *args, **kwargs: None
        grpo.disk_errors = lambda *args: []  # (so no disk space is asked for)
    grpo.train(args)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--run-cell"]:
        run(argv[1:])
    elif argv[:1] == ["--model"]:  # a spec as the cells write it: family[/layers][+eosK]
        family, layers, eos_ids = parse_model(argv[1])
        make_model_dir(family, argv[2], layers, eos_ids)
    else:
        sys.exit(0 if main(argv) else 1)
