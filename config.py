"""
The run's config: every knob is a module global with its default, overridden by --key=value
(parse_config), and the checks that refuse a bad value, naming its valid range, before anything
loads or is written. No argparse, YAML or config class: a knob's type is its default's type.

    cfg = parse_config(["--lr=5e-6", "--task=countdown"])   # SimpleNamespace of every key
    dev, dt = resolve(cfg)                                   # checked; device and dtype resolved
"""
import ast
import glob
import importlib.util
import os
import re
from math import isfinite as finite
from types import SimpleNamespace

import torch

import lora
from tasks import MAX_DIFFICULTY, check_task, make_reward

# model and task
model = "smollm2"  # "smollm2" (SmolLM2-135M-Instruct from a GGUF), a local HF directory or hub id
gguf_dir = "models/smollm2-gguf"  # where the smollm2 GGUF is looked for, and unpacked to
task = "arithmetic"  # arithmetic | countdown | jsonl:PATH | hf:NAME[:config] (tasks.py)
eval_file = ""  # a dataset task's held-out rows (JSONL); "" holds eval_size rows out of the task
reward = ""  # "" = the task's own; else comma-separated task | module:function | file.py:function
reward_weights = ""  # one weight per --reward, comma-separated ("" = all 1); logged as reward/NAME
difficulty = 1  # arithmetic: digits per operand; countdown: how many numbers (difficulty + 1)
# DAPO's overlong penalty and dynamic sampling
soft_punish_cache = 0  # the penalty ramps over this many tokens before max_completion_len (0 = off)
overlong_penalty_factor = 1.0  # the penalty at max_completion_len is -overlong_penalty_factor
dynamic_sampling = False  # drop groups whose rewards all agree; sample more prompts to refill
max_sampling_tries = 4  # dynamic sampling draws prompts_per_step prompts at most this often a step
# run length, sampling, optimizer
max_steps = 1000  # generation batches; each feeds num_iterations * steps_per_generation updates
max_minutes = 0.0  # wall-time limit, start-up included (0 = none); the final eval and save follow
max_flat_steps = 50  # stop after this many steps in a row without a reward spread (0 = never)
prompts_per_step = 32  # prompts a generation batch samples (over all torchrun processes)
group_size = 16  # G: completions sampled per prompt; each is compared with its group's mean
max_prompt_len = 256  # a longer prompt is refused
max_completion_len = 64  # completions stop here (truncated) if no stop token came first
temperature = 0.7  # the rollout's sampling temperature
top_p = 1.0  # nucleus sampling (1 = off)
lr = 1e-5  # AdamW's learning rate, after a linear warm-up over warmup_steps
weight_decay = 0.0  # AdamW's decoupled weight decay
grad_clip = 1.0  # clip the gradient's global norm to this (0 = off)
warmup_steps = 5  # steps of linear learning-rate warm-up
num_iterations = 1  # passes over each generation batch; 1 (steps_per_generation=1): on-policy
steps_per_generation = 1  # K: optimizer steps a pass, on disjoint mini-batches of whole groups
# the loss
epsilon = 0.2  # the PPO clip: the ratio is clipped below at 1 - epsilon
epsilon_high = 0.28  # DAPO's clip-higher, above at 1 + epsilon_high (= epsilon: the symmetric clip)
beta = 0.0  # weight of the k3 KL to the initial model; 0 loads no reference model at all
loss_type = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo (policy_loss)
importance_sampling_level = "token"  # token | sequence (GSPO: one length-normalized ratio a row)
top_entropy_quantile = 1.0  # only this top fraction of tokens by entropy carries the policy loss
scale_rewards = "group"  # the advantage over the std of its group | batch | none
mask_truncated_completions = False  # completions cut at max_completion_len carry no loss
delta = 0.0  # INTELLECT-2's two-sided clip: the ratio capped at delta (0 = off; > 1 + epsilon_high)
off_policy_mask_threshold = 0.0  # rows with A < 0 and a mean KL from the sampler over it: no loss
entropy_coef = 0.0  # the entropy bonus: the loss minus entropy_coef x the mean entropy (0 = off)
sapo_temperature_pos = 1.0  # sapo's soft clip: the gate's slope for tokens with advantage > 0
sapo_temperature_neg = 1.05  # ... and for the others
vespo_k_pos = 2.0  # vespo's weight w^k e^(lambda (1 - w)) of a sequence ratio w, advantage >= 0
vespo_lambda_pos = 3.0
vespo_k_neg = 3.0  # ... and advantage < 0
vespo_lambda_neg = 2.0
# TRL's correction for the sampler's and trainer's slightly different log-probs (sampling_logp_diff)
vllm_importance_sampling_correction = False  # weight the policy loss by exp(old - sampler logp)
vllm_importance_sampling_mode = "sequence_mask"  # {token,sequence}_{truncate,mask}
vllm_importance_sampling_clip_max = 3.0  # truncate: clamp to [clip_min, clip_max]; mask: 0 outside
vllm_importance_sampling_clip_min = 0.0  # 0 = no lower bound
# speed and memory
logprob_impl = "auto"  # fused | chunked | naive | auto (fused on the GPU, chunked on the CPU)
kv_reuse = True  # the update packs each group's prompt once with its G completions
gradient_checkpointing = "auto"  # recompute layers in the backward: True | False | auto (if needed)
compile = True  # GPU, from 128 new tokens: torch.compile the decode and the update's small ops
micro_batch_tokens = 0  # real tokens a micro-batch holds (whole groups, or parts); 0 = auto
rollout_kv_gib = 0.0  # K/V the rollout holds at once (0 = auto); more groups go in later waves
device = "auto"  # auto | cuda | cpu | cuda:N
dtype = "bfloat16"  # float32 | bfloat16 (float16 would need a loss scaler); the masters are float32
seed = 1337  # each torchrun process samples with seed + its rank
deterministic = False  # deterministic kernels: the same log for the same command, GPU and software
# LoRA (peft): the base stays frozen in dtype and only the adapters train
lora_r = 0  # LoRA rank (0 = full fine-tuning)
lora_alpha = 32  # the adapters' scale is lora_alpha / lora_r (TRL's default, as the dropout's)
lora_dropout = 0.05  # dropout on each adapter's input
lora_target_modules = ""  # comma-separated names ("" or all-linear: q,k,v,o,gate,up,down_proj)
# eval, logging, checkpoints, torchrun
eval_every = 10  # held-out greedy eval every N steps, and at step 0 and the last (0: only those)
eval_size = 100  # held-out prompts
eval_pass_k = 0  # also sample this many completions per held-out prompt: pass@k (0 = off)
eval_samples = 4  # held-out greedy completions (question, answer, reward) kept in the log per eval
eval_temperature = 1.0  # the temperature of pass@k's samples
save_every = 50  # checkpoint every N steps (0: only the last)
out_dir = "out"  # log.jsonl, ckpt/, curves.png, LOCK; an earlier run there is never lost silently
report_to = "none"  # none | tensorboard | wandb | tensorboard,wandb: log.jsonl's numbers there too
resume = False  # continue the run in out_dir from its checkpoint
overwrite = False  # replace an earlier run in out_dir (its log.jsonl, curves.png and checkpoint)
dist_timeout_minutes = 10.0  # a collective that waits longer (a rank died or hangs) ends the job
fsdp = "auto"  # True = FSDP2 (shards the state) | False = replicas | auto = replicas where they fit

CONFIG_KEYS = [k for k, v in list(globals().items())
               if k[0] != "_" and isinstance(v, (bool, int, float, str))]


def parse_config(argv, defaults=None):
    """defaults (these globals, or a run's) overridden by --key=value, typed as each default"""
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
                v = None  # not a number
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or (isinstance(default, int) and v != int(v)):
                raise ValueError(f"--{key} wants a {type(default).__name__}, got {val!r}")
            cfg[key] = type(default)(v)
        else:
            cfg[key] = val
    return SimpleNamespace(**cfg)


CHOICES = {"loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
           "scale_rewards": ("group", "batch", "none"),
           "importance_sampling_level": ("token", "sequence"),
           "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate",
                                             "sequence_mask"),
           "logprob_impl": ("auto", "fused", "chunked", "naive"), "dtype": ("float32", "bfloat16")}
AT_LEAST_1 = ("max_steps", "prompts_per_step", "max_prompt_len", "max_completion_len", "eval_size",
              "num_iterations", "difficulty", "steps_per_generation", "max_sampling_tries")
AT_LEAST_0 = ("warmup_steps", "eval_every", "save_every", "eval_pass_k", "soft_punish_cache",
              "eval_samples", "max_flat_steps", "lora_r")
POSITIVE = ("lr", "temperature", "vllm_importance_sampling_clip_max", "eval_temperature",
            "dist_timeout_minutes", "lora_alpha", "sapo_temperature_pos", "sapo_temperature_neg")
RANGES = {  # key: (is the value valid?, the valid range as an error states it)
    **{k: (lambda v: finite(v) and v > 0, "finite and > 0") for k in POSITIVE},
    **{k: (lambda v: finite(v) and v >= 0, "finite and >= 0")
       for k in ("weight_decay", "epsilon_high", "overlong_penalty_factor", "entropy_coef",
                 "off_policy_mask_threshold", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg")},
    "grad_clip": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no clipping)"),
    "delta": (lambda v: v == 0 or (finite(v) and v >= 1), "0 (off) or at least 1 (the ratio "
              "starts at 1: a cap below it leaves a positive advantage no gradient)"),
    "epsilon": (lambda v: 0 <= v <= 1, "in [0, 1] (the ratio is clipped below at 1 - epsilon)"),
    "beta": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no KL, no reference model)"),
    "top_p": (lambda v: 0 < v <= 1,
              "in (0, 1] (0 would keep only the most likely token: a group of one answer)"),
    "max_minutes": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = no limit)"),
    "group_size": (lambda v: v >= 2, ">= 2 (the advantage is a reward minus its group's mean)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "top_entropy_quantile": (lambda v: 0 <= v <= 1, "in [0, 1] (1 = every token carries the loss)"),
    "vllm_importance_sampling_clip_min": (lambda v: finite(v) and v >= 0,
                                          "finite and >= 0 (0 = no lower bound)"),
    **{k: (lambda v: v >= 1, ">= 1") for k in AT_LEAST_1},
    **{k: (lambda v: v >= 0, ">= 0") for k in AT_LEAST_0},
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "rollout_kv_gib": (lambda v: finite(v) and v >= 0, "finite and >= 0 (0 = auto)"),
    "micro_batch_tokens": (lambda v: v >= 0, ">= 0 (0 = auto)"),
    **{k: (lambda v: str(v).lower() in ("auto", "true", "false", "1", "0"), "True, False or auto")
       for k in ("gradient_checkpointing", "fsdp")},
}
FREE_KEYS = ("model", "gguf_dir", "out_dir", "device", "resume", "overwrite",  # check_config's
             "mask_truncated_completions", "kv_reuse", "task", "eval_file", "reward",  # own, and
             "reward_weights", "dynamic_sampling", "vllm_importance_sampling_correction",  # bools
             "deterministic", "compile", "lora_target_modules", "report_to")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
AUTO_TOKENS = 32768  # the largest micro-batch auto picks, and the CPU's


def check_model(name):
    """a --model that looks like a path must be an HF directory: from_pretrained would take a
    missing path for a hub id (and retry the hub), one without tokenizer files for sentencepiece"""
    if not name.strip():
        return ["--model='': name a model (an HF directory, a hub id, or smollm2: the default)"]
    path = os.path.expanduser(name)
    local = (name.startswith((".", "/", "~")) or os.path.exists(path) or name.count("/") > 1
             or ("/" in name and os.path.isdir(name.split("/")[0])))  # a hub id: name or org/name
    if name == "smollm2" or not local:
        return []
    if not os.path.isdir(path):
        return [f"--model={name!r}: no such directory (a local path; a hub id looks like org/name)"]
    missing = []
    if not os.path.exists(os.path.join(path, "config.json")):
        missing += [f"no config.json in {path}: not a Hugging Face model directory"]
    if not glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")):
        missing += [f"no weights (*.safetensors or *.bin) in {path}"]
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        missing += [f"no tokenizer files in {path} (want one of {', '.join(TOKENIZER_FILES)}; "
                    f"tokenizer.save_pretrained(DIR) writes them)"]
    tok_config = os.path.join(path, "tokenizer_config.json")  # (or chat_template.jinja, .json, ...)
    if not glob.glob(os.path.join(path, "*chat_template*")) and not (
            os.path.exists(tok_config) and '"chat_template"' in open(tok_config).read()):
        missing += ["its tokenizer has no chat template (a base model?), and every prompt is a "
                    "chat turn: use the model's instruct version, or set tokenizer.chat_template "
                    "and save_pretrained it"]
    return [f"--model={name!r}: {m}" for m in missing]


def check_config(cfg):
    """one ValueError naming each bad flag, its value and its valid range, before anything loads"""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's (its process group starts later)
    errors = [f"--{k}={getattr(cfg, k)!r}: use one of {ok}"
              for k, ok in CHOICES.items() if getattr(cfg, k) not in ok]
    errors += [f"--{k}={getattr(cfg, k)!r}: must be {why}"
               for k, (ok, why) in RANGES.items() if not ok(getattr(cfg, k))]
    errors += world_size_errors(cfg, world)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if lo >= hi:
        errors += [f"--vllm_importance_sampling_clip_min={lo} must be below "
                   f"--vllm_importance_sampling_clip_max={hi}"]
    if cfg.loss_type == "cispo" and cfg.epsilon_high < 1:
        errors += [f"--loss_type=cispo with --epsilon_high={cfg.epsilon_high}: cispo caps the "
                   f"importance weight AT epsilon_high (ScaleRL's eps_max, as TRL), so < 1 would "
                   f"shrink every on-policy gradient; use e.g. --epsilon_high=5.0"]
    sequence_correction = cfg.vllm_importance_sampling_mode.startswith("sequence")
    if cfg.loss_type == "vespo" and cfg.vllm_importance_sampling_correction and sequence_correction:
        errors += ["--loss_type=vespo folds the sampler correction into its sequence weight token "
                   "by token: use --vllm_importance_sampling_mode=token_truncate or token_mask"]
    if cfg.soft_punish_cache >= cfg.max_completion_len:
        errors += [f"--soft_punish_cache={cfg.soft_punish_cache}: must be < --max_completion_len="
                   f"{cfg.max_completion_len} (the penalty ramps over that many tokens before it)"]
    errors += check_task(cfg.task, cfg.eval_file)
    try:  # parses the weights and imports each --reward, so that a bad one is said now
        make_reward(None, cfg.reward, cfg.reward_weights)
    except (ValueError, SyntaxError) as e:
        errors += [str(e)]
    top = MAX_DIFFICULTY.get(cfg.task)
    if top is not None and cfg.difficulty > top:
        errors += [f"--difficulty={cfg.difficulty}: {cfg.task} samples difficulty 1..{top}"]
    if cfg.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", cfg.device):
        errors += [f"--device={cfg.device!r}: use auto, cpu, cuda or cuda:N"]
    elif cfg.device.startswith("cuda") and not torch.cuda.is_available():
        errors += [f"--device={cfg.device!r} but torch sees no CUDA device (torch "
                   f"{torch.__version__}): use --device=auto or --device=cpu"]
    elif cfg.device.startswith("cuda:") and int(cfg.device[5:]) >= torch.cuda.device_count():
        errors += [f"--device={cfg.device!r}: there are {torch.cuda.device_count()} CUDA devices"]
    gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.logprob_impl == "fused" and not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        errors += ["--logprob_impl='fused' on the CPU needs TRITON_INTERPRET=1 (slow): use chunked"]
    if not cfg.out_dir or (os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir)):
        errors += [f"--out_dir={cfg.out_dir!r}: name a directory (new, or an earlier run's)"]
    if cfg.resume and cfg.overwrite:
        errors += ["--resume=True and --overwrite=True: continue the run or replace it, not both"]
    elif cfg.resume and not os.path.isdir(cfg.out_dir):
        errors += [f"--resume=True but there is no --out_dir={cfg.out_dir!r} to resume"]
    for t in cfg.report_to.split(","):  # each tracker is an optional extra
        if t not in ("none", "tensorboard", "wandb"):
            errors += [f"--report_to={cfg.report_to!r}: use none, tensorboard, wandb or "
                       f"tensorboard,wandb"]
        elif t != "none" and importlib.util.find_spec(t) is None:
            errors += [f"--report_to={cfg.report_to!r} needs {t}, not installed: pip install {t}"]
    errors += check_model(cfg.model) + lora_errors(cfg, world)
    if errors:
        raise ValueError("bad config:\n  " + "\n  ".join(errors))


def resolve(cfg):
    """check cfg, then resolve in place what needs no model: logprob_impl, off the GPU
    gradient_checkpointing and micro_batch_tokens, in one process fsdp -> (device, dtype)"""
    check_config(cfg)
    cuda = torch.cuda.is_available() if cfg.device == "auto" else cfg.device.startswith("cuda")
    dev = torch.device(("cuda" if cuda else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.logprob_impl == "auto":  # the Triton kernel runs on the CPU only interpreted, slowly
        cfg.logprob_impl = "fused" if cuda else "chunked"
    # On a GPU, auto and 0 stay for memory_plan, which sizes them from the free memory.
    gc, fs = (str(v).lower() for v in (cfg.gradient_checkpointing, cfg.fsdp))
    cfg.gradient_checkpointing = "auto" if gc == "auto" and cuda else gc in ("true", "1")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process shards nothing
        cfg.fsdp = False
    elif fs == "auto" and not cfg.lora_r:  # (torchrun on the CPU: FSDP2)
        cfg.fsdp = "auto" if cuda else True
    else:  # (LoRA's auto: replicas)
        cfg.fsdp = fs in ("true", "1")
    cfg.micro_batch_tokens = cfg.micro_batch_tokens or (0 if cuda else AUTO_TOKENS)
    return dev, getattr(torch, cfg.dtype)


def world_size_errors(cfg, world):
    """prompts_per_step must split into whole groups per process, each share into mini-batches"""
    local = cfg.prompts_per_step // world
    if cfg.prompts_per_step % world:
        return [f"--prompts_per_step={cfg.prompts_per_step} does not split into whole groups over "
                f"{world} processes (torchrun's WORLD_SIZE={world}): use a multiple of {world}"]
    if cfg.steps_per_generation < 1 or local % cfg.steps_per_generation == 0:
        return []
    share = f"--prompts_per_step={local} (each optimizer step takes an equal share of whole groups)"
    if world > 1:
        share = (f"each process's {local} prompts (--prompts_per_step={cfg.prompts_per_step} over "
                 f"WORLD_SIZE={world})")
    return [f"--steps_per_generation={cfg.steps_per_generation}: must divide {share}"]


def lora_errors(cfg, world):
    """--lora_r > 0 needs peft, targets the LoRA decode can fold, and under torchrun --fsdp=False"""
    if cfg.lora_r == 0:
        return []
    errors = []
    if importlib.util.find_spec("peft") is None:
        errors += [f"--lora_r={cfg.lora_r} needs PEFT, which is not installed: pip install peft"]
    bad = [t for t in lora.targets(cfg.lora_target_modules) if t in ("lm_head", "embed_tokens")]
    if bad:
        errors += [f"--lora_target_modules={cfg.lora_target_modules!r}: {', '.join(bad)} cannot "
                   f"take an adapter here (the fused log-prob kernel reads lm_head's weight "
                   f"itself; the embedding is tied to it)"]
    if world > 1 and str(cfg.fsdp).lower() in ("true", "1"):
        errors += [f"--lora_r={cfg.lora_r} under torchrun runs with --fsdp=False (a replica of the "
                   f"frozen base per rank, the adapters' gradients all-reduced); LoRA under FSDP2 "
                   f"is not supported yet"]
    return errors


def default_plan(cfg, world):
    """the plan where no memory check ran (CPU, or it could not count): FSDP2, no checkpointing"""
    return SimpleNamespace(gradient_checkpointing=cfg.gradient_checkpointing is True,
                           micro_batch_tokens=cfg.micro_batch_tokens or AUTO_TOKENS,
                           fsdp=world > 1 and cfg.fsdp is not False)


def state_bytes(cfg, n_params, shards):
    """training state on one GPU. Full fine-tuning: 16 bytes a parameter (float32 weights or
    masters, gradients, AdamW's two moments) split over `shards` ranks by FSDP2, + the dtype weights
    (bf16, or FSDP2's gathered copy), + a reference model in dtype if beta > 0 (FSDP2: sharded
    too). LoRA: the base in dtype."""
    dt = 2 if cfg.dtype == "bfloat16" else 4
    if cfg.lora_r:  # (its reference model is the base with the adapters off)
        return n_params * dt
    ref = dt * (cfg.beta > 0) / shards
    return n_params * (16 / shards + (dt if shards > 1 or dt == 2 else 0) + ref)


def activation_bytes(cfg, mc):
    """bytes a token keeps for the backward -> (without, with checkpointing), from the HF config mc.
    A layer keeps 4H + 3q + 3kv + 3I values (norm and projection inputs; q, k, v, attention's
    output; the MLP's gate, up, product); LoRA dropout adds 5H + q + I. Checkpointing: each layer's
    input and 2 layers (one recomputed, its gradients). 4H outside. x 1.4: RMSNorm's fp32 copies."""
    H, L = mc.hidden_size, mc.num_hidden_layers
    I = getattr(mc, "intermediate_size", None) or 4 * H
    d = getattr(mc, "head_dim", None) or H // mc.num_attention_heads
    q = mc.num_attention_heads * d
    kv = (getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads) * d
    layer = 4 * H + 3 * q + 3 * kv + 3 * I
    if cfg.lora_r and cfg.lora_dropout > 0:
        layer += 5 * H + q + I
    b = 1.4 * (2 if cfg.dtype == "bfloat16" else 4)
    return b * (L * layer + 4 * H), b * (L * H + 2 * layer + 4 * H)


def auto_sizes(cfg, free, mc, world):
    """gradient_checkpointing=auto: on where a micro-batch of the step's groups (up to AUTO_TOKENS)
    does not fit without it; micro_batch_tokens=0: what fits, up to AUTO_TOKENS. In 90% of the free
    bytes, less 1 GiB (the LM head's kernel, cuBLAS, the allocator). -> (gc, tokens, errors)"""
    full, ckpt = activation_bytes(cfg, mc)
    spare, P, C, G = 0.9 * free - 2**30, cfg.max_prompt_len, cfg.max_completion_len, cfg.group_size
    step = (P + G * C if cfg.kv_reuse else G * (P + C)) * max(cfg.prompts_per_step // world, 1)
    gc = cfg.gradient_checkpointing
    if gc == "auto":
        gc = min(AUTO_TOKENS, step) * full > spare
    per = ckpt if gc else full
    tokens = cfg.micro_batch_tokens or max(min(AUTO_TOKENS, int(spare // per)), 1)
    if cfg.micro_batch_tokens or spare >= (P + C) * per:  # (a size the user gave is not checked)
        return gc, tokens, []
    how = "use a GPU with more memory" if gc else "set --gradient_checkpointing=True"
    return gc, tokens, [
        f"--max_completion_len={C} after --max_prompt_len={P}: the backward of one completion "
        f"needs {(P + C) * per / 2**30:.1f} GiB of activations and {max(spare, 0) / 2**30:.1f} GiB "
        f"are free beside the training state; shorten them, {how}"
        + ("" if cfg.lora_r else " or train LoRA (--lora_r=16)")]


def fit_errors(cfg, n_params, world, sharded, gpu_bytes, kv_token):
    """why the training state and one completion's K/V (the rollout's least) cannot fit gpu_bytes"""
    need = state_bytes(cfg, n_params, world if sharded else 1)
    P, C = cfg.max_prompt_len, cfg.max_completion_len
    row = kv_token * (P + C)
    have = f"this GPU has {gpu_bytes / 2**30:.0f} GiB free"
    if 0 < cfg.rollout_kv_gib * 2**30 < row:  # (the rollout would refuse it after the weights load)
        return [f"--rollout_kv_gib={cfg.rollout_kv_gib}: one completion's K/V ({kv_token} bytes a "
                f"token) needs {row / 2**30:.2f} GiB; raise it or shorten --max_completion_len or "
                f"--max_prompt_len"]
    if need <= gpu_bytes < need + row:
        return [f"--max_completion_len={C} after --max_prompt_len={P}: one completion's K/V "
                f"({kv_token} bytes a token) needs {row / 2**30:.1f} GiB beside the training "
                f"state's {need / 2**30:.0f} GiB, and {have}; shorten them or use a GPU with more "
                f"memory"]
    if need <= gpu_bytes:
        return []
    what = f"{n_params / 1e9:.1f}B parameters need {need / 2**30:.0f} GiB before any activation"
    if cfg.lora_r:
        return [f"--model={cfg.model!r} with --lora_r={cfg.lora_r}: {what} (the frozen base in "
                f"{cfg.dtype}); {have}. Use a smaller model or a GPU with more memory (LoRA under "
                f"FSDP2 is not supported yet)"]
    over = f" over {world} ranks" if sharded else ""
    ref = " + the reference model" if cfg.beta > 0 else ""
    base = n_params * (2 if cfg.dtype == "bfloat16" else 4) / 2**30
    return [f"--model={cfg.model!r}, full fine-tuning: {what} (float32 weights or masters, "
            f"gradients and AdamW moments: 16 bytes a parameter{over}, + the {cfg.dtype} weights"
            f"{ref}); {have}. Train LoRA adapters instead (--lora_r=16: the base stays in "
            f"{cfg.dtype}, {base:.0f} GiB, no masters or moments), or shard the state over more "
            f"GPUs (torchrun --nproc_per_node=N grpo.py: FSDP2)"]


def size_text(n):
    """n bytes as GiB, or as MiB below one GiB"""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def disk_errors(cfg, n_params, free_bytes, resuming):
    """why this run's checkpoints cannot fit the free_bytes of out_dir's disk. Full fine-tuning
    saves 12 bytes a parameter: the float32 weights (or masters) and AdamW's two float32 moments
    (LoRA: the adapters alone, small, not counted). A save writes the new checkpoint beside the
    last and removes the last once the new is complete, so a run that saves more than once needs
    room for two (a resumed run for one beside its last). 2% spare: tokenizer, log, plot."""
    one = 12 * n_params
    room = 1.02 * one  # one checkpoint and the small files beside it
    two = not resuming and 0 < cfg.save_every < cfg.max_steps
    if cfg.lora_r or room * (1 + two) <= free_bytes:
        return []
    what = (f"--out_dir={cfg.out_dir}: a checkpoint of {n_params:,} parameters takes "
            f"{size_text(one)} (float32 weights and AdamW's two moments, 12 bytes a parameter)")
    have = f"the disk has {size_text(free_bytes)} free"
    if resuming:
        return [f"{what}, and the next save is written beside the last one; {have}. Free space "
                f"on that disk"]
    if not two:
        return [f"{what}; {have}. Free space, pick an --out_dir on a larger disk, or train LoRA "
                f"adapters (--lora_r=16)"]
    once = ", save once, at the end (--save_every=0)" if room <= free_bytes else ""
    return [f"{what}, and a run that saves more than once needs room for two (the new one is "
            f"written beside the last); {have}. Free space, pick an --out_dir on a larger disk"
            f"{once}, or train LoRA adapters (--lora_r=16)"]


def memory_plan(cfg, n_params, world, gpu_bytes, kv_token=0, mc=None):
    """the training state and one completion's K/V (kv_token bytes a token) must fit gpu_bytes;
    with mc (the model's HF config) what they leave sizes the auto knobs. --fsdp=auto takes FSDP2's
    sizes, then replicas where those fit beside a whole state. -> (errors, plan); cfg unchanged"""
    gc, tokens, fsdp = cfg.gradient_checkpointing, cfg.micro_batch_tokens, cfg.fsdp
    sharded = world > 1 and fsdp is not False  # (auto: FSDP2 first)
    errors = fit_errors(cfg, n_params, world, sharded, gpu_bytes, kv_token)
    if not errors and mc is not None:
        free = gpu_bytes - state_bytes(cfg, n_params, world if sharded else 1)
        gc, tokens, errors = auto_sizes(cfg, free, mc, world)
    if world > 1 and fsdp == "auto":  # FSDP2 unless its micro-batch fits beside a whole state too
        spare = 0.9 * (gpu_bytes - state_bytes(cfg, n_params, 1)) - 2**30
        fsdp = bool(errors) or mc is None or spare < tokens * activation_bytes(cfg, mc)[gc is True]
    plan = SimpleNamespace(gradient_checkpointing=gc, micro_batch_tokens=tokens, fsdp=fsdp)
    return errors, default_plan(plan, world)
