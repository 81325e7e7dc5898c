"""
nanoGRPO: GRPO on one GPU, or on N under torchrun. Read it top to bottom.

    python grpo.py                                # SmolLM2-135M-Instruct on 1-digit arithmetic
    python grpo.py --task=countdown --lr=5e-6     # any config.py global, as --key=value
    torchrun --nproc_per_node=2 grpo.py           # 2 processes, each half of each step's groups

A step: 1. sample prompts_per_step prompts, group_size completions each (rollout.py), scored by
the reward (tasks.py); 2. update: group advantages, then num_iterations x steps_per_generation
optimizer steps over the groups (batching.py); 3. evaluate, log, save. The knobs: config.py.
Left out on purpose: a separate inference server (the policy samples itself: no weights to sync),
multi-turn and tool calls, learned reward models, schedules beyond a linear warmup.
"""
import json
import math
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import checkpoint
import lora
from config import default_plan, disk_errors, memory_plan, parse_config, resolve, size_text
from dist import (all_ranks, fsdp_modules, gathered, rank, rank0_value, setup_distributed,
                  shard_model, stat_op, world_size)
from tasks import (check_prompt_lengths, check_training_pool, encode_prompts, load_task,
                   make_reward, overlong_penalty, reward_names, score, step_seed, train_prompts)


# -----------------------------------------------------------------------------
# prompts and their rewards
def stop_token_ids(model, tokenizer):
    """the ids a completion ends at: the tokenizer's EOS and each EOS of the generation_config,
    as model.generate stops (Qwen2.5 lists 2, Llama-3.1 lists 3)"""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({tokenizer.eos_token_id, *ids} - {None})


def generate(model, prompt_ids, prompt_mask, n, temperature, top_p, cfg, tokenizer):
    """n completions of each prompt (batching.rollout: the generation buffer)"""
    from batching import rollout
    return rollout(model, prompt_ids, prompt_mask, n, cfg.max_completion_len, temperature, top_p,
                   stop_token_ids(model, tokenizer), tokenizer.pad_token_id, cfg.compile,
                   cfg.rollout_kv_gib)


# -----------------------------------------------------------------------------
# 1. sample: a step's groups of completions and their rewards
def sample_draw(cfg, step, draw, policy, tokenizer, make_prompts, reward_fn, eval_questions, dev):
    """one draw of prompts for this rank, its groups sampled and scored. A completion's reward is
    the weighted sum of the rewards plus DAPO's soft overlong penalty."""
    n, G = cfg.prompts_per_step // world_size(), cfg.group_size
    seed = step_seed(cfg.seed, step, draw)
    pairs = train_prompts(make_prompts, cfg.prompts_per_step, seed, cfg.difficulty, eval_questions)
    pairs = pairs[rank() * n:(rank() + 1) * n]  # the one-process step's prompts, cut by rank
    questions = [q for q, _ in pairs]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, questions, cfg.max_prompt_len, dev)
    try:
        buf = generate(policy, prompt_ids, prompt_mask, G, cfg.temperature, cfg.top_p, cfg,
                       tokenizer)
    except torch.cuda.OutOfMemoryError as e:
        why = "out of GPU memory while generating: lower --prompts_per_step, --group_size or "
        raise torch.cuda.OutOfMemoryError(why + "--max_completion_len") from e
    scored = score(reward_fn, tokenizer, buf, pairs, G)[1]  # (B*G,) rows b*G + g
    penalties = [overlong_penalty(L, cfg.max_completion_len, cfg.soft_punish_cache,
                                  cfg.overlong_penalty_factor)
                 for L in buf["completion_mask"].sum(1).tolist()]
    rewards = torch.tensor([t + p for (t, _, _), p in zip(scored, penalties)], device=dev)  # (B*G,)
    flat = (rewards.view(n, G).std(1) <= 1e-6).tolist()  # (B,) groups whose rewards all agree
    return SimpleNamespace(buf=buf, rewards=rewards, flat=flat, scored=scored, penalties=penalties)


def sample_step(cfg, step, policy, tokenizer, make_prompts, reward_fn, eval_questions, dev):
    """1. sample: this rank's share of the step's groups.
    Returns (buf, rewards (B*G,), stats over every completion sampled on every rank)."""
    from batching import concat_groups, select_groups
    n, G = cfg.prompts_per_step // world_size(), cfg.group_size  # this rank's groups
    draws, kept, spare = [], [], []  # kept, spare: (draw, group) pairs
    for d in range(cfg.max_sampling_tries if cfg.dynamic_sampling else 1):
        draw = sample_draw(cfg, step, d, policy, tokenizer, make_prompts, reward_fn,
                           eval_questions, dev)
        draws.append(draw)
        for b in range(n):
            # dynamic_sampling: a group whose rewards all agree has no gradient, it is spare
            if cfg.dynamic_sampling and draw.flat[b]:
                spare.append((d, b))
            elif len(kept) < n:
                kept.append((d, b))
        if len(kept) == n:
            break
    # Short of n informative groups, train on those alone, as DAPO and verl do (uniform groups
    # would dilute the dapo/bnpo normalizers), topped up to whole steps_per_generation mini-batches
    K = cfg.steps_per_generation
    chosen = kept + spare[:max(K, math.ceil(len(kept) / K) * K) - len(kept)]
    # the chosen groups, draw by draw, into one buffer (the first draw as it is when all of it)
    picks = [(draw, [b for t, b in chosen if t == d]) for d, draw in enumerate(draws)]
    picks = [(draw, idx) for draw, idx in picks if idx]
    buf = draws[0].buf
    if chosen != [(0, b) for b in range(n)]:
        buf = concat_groups([select_groups(d.buf, idx) for d, idx in picks], tokenizer.pad_token_id)
    rewards = torch.cat([draw.rewards.view(n, G)[idx].view(-1) for draw, idx in picks])  # (B*G,)
    return buf, rewards, sampling_stats(cfg, draws, len(chosen), n)


def sampling_stats(cfg, draws, n_chosen, n):
    """the step's reward statistics over every completion sampled on every rank (dropped groups
    included), and how much sampling it took"""
    mine = dict(rewards=[x for d in draws for x in d.rewards.tolist()],
                scored=[s for d in draws for s in d.scored],
                penalties=[p for d in draws for p in d.penalties],
                flat=sum(sum(d.flat) for d in draws), draws=len(draws), chosen=n_chosen)
    ranks = all_ranks(mine)
    totals = torch.tensor([x for m in ranks for x in m["rewards"]])
    scored = [s for m in ranks for s in m["scored"]]
    tries = [m["draws"] for m in ranks]
    stats = dict(reward_mean=totals.mean().item(), reward_std=totals.std().item(),
                 accuracy=sum(correct for _, correct, _ in scored) / len(scored),
                 sampling_tries=max(tries), groups=sum(m["chosen"] for m in ranks),
                 extra_rollouts=sum(t - 1 for t in tries) * n * cfg.group_size,
                 sampled_frac_reward_zero_std=sum(m["flat"] for m in ranks) / (n * sum(tries)),
                 decode=draws[0].buf["decode"], rollout_waves=draws[0].buf["waves"])
    for i, name in enumerate(reward_names(cfg.reward)):
        each = torch.tensor([parts[i] for _, _, parts in scored])
        stats[f"reward/{name}"] = each.nanmean().item()  # a None (NaN) row is left out, as in TRL
    if cfg.soft_punish_cache:
        stats["reward/overlong"] = statistics.fmean(p for m in ranks for p in m["penalties"])
    return stats


# -----------------------------------------------------------------------------
# 2. update: the model and its optimizer
def cast_parameters(model, dt):
    """the parameters in dt, the buffers as they are. RoPE's inv_freq stays float32, as
    from_pretrained(dtype=bfloat16) leaves it: model.to(bfloat16) would round it, and every rotary
    angle position * inv_freq with it (radians off at long positions)."""
    for p in model.parameters():  # a tied weight is one parameter: it stays tied
        p.data = p.data.to(dt)
    return model


def make_optimizer(policy, cfg, dt):
    """AdamW over float32 weights -> (optimizer, masters or None).
    A bf16 run's model holds bf16 weights for generation, forward and backward; the optimizer steps
    float32 masters, rounded into the model after each step (a bf16 weight would drop every update
    smaller than 2^-8 of itself, and lr=1e-5 AdamW updates are that small). Under FSDP2 the sharded
    float32 parameters are the masters. With LoRA only the float32 adapters train; the frozen base
    is cast to dt and gets no master."""
    master, sharded = None, bool(fsdp_modules(policy))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    if len(trainable) < len(list(policy.parameters())):  # LoRA: lora.add_lora froze the rest
        for p in policy.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dt)
    elif dt != torch.float32 and not sharded:
        master = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]
        cast_parameters(policy, dt)
    params = master if master is not None else trainable
    # one fused kernel for the whole step on a GPU; FSDP2's DTensors take the foreach one
    fused = {} if not params[0].is_cuda else {"foreach": True} if sharded else {"fused": True}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99),
                             weight_decay=cfg.weight_decay, **fused), master


def plan_memory(cfg, base, world, dev, dt, resuming):
    """resolve gradient_checkpointing, micro_batch_tokens and fsdp ("auto" and 0) from the GPU's
    free memory (config.memory_plan), and refuse a run whose state cannot fit, or whose
    checkpoints cannot fit out_dir's disk (config.disk_errors), before any weight loads. Rank 0's
    disk check and plan are every rank's (rank 0 writes the HF directory, the others their shards
    beside it)."""
    import shutil
    from transformers import AutoConfig
    from batching import free_gpu_bytes
    from rollout import kv_bytes_per_token
    asked = (cfg.gradient_checkpointing, cfg.micro_batch_tokens, cfg.fsdp)
    plan, errors, disk = default_plan(cfg, world), [], []
    try:
        n_params = checkpoint.parameter_count(base)
        if rank() == 0:  # the free bytes, and those the earlier run's files (--overwrite) free
            earlier = checkpoint.earlier_files(cfg.out_dir) if cfg.overwrite else []
            free = shutil.disk_usage(cfg.out_dir).free + sum(map(checkpoint.tree_bytes, earlier))
            disk = disk_errors(cfg, n_params, free, resuming)
        if dev.type == "cuda":
            mc = AutoConfig.from_pretrained(base)
            kv_token = kv_bytes_per_token(mc, torch.finfo(dt).bits // 8)
            errors, plan = memory_plan(cfg, n_params, world, free_gpu_bytes(dev), kv_token, mc)
    except Exception as e:  # noqa: BLE001 - a check that cannot count must not stop a run
        print(f"(memory and disk checks skipped: {base}: {type(e).__name__}: {e})")
    errors += rank0_value(disk)  # (so no rank refuses alone)
    if errors:
        raise ValueError("bad config:\n  " + "\n  ".join(errors))
    vars(cfg).update(vars(rank0_value(plan)))  # the three keys, as rank 0 chose them
    print(f"memory: gradient_checkpointing, micro_batch_tokens, fsdp = "
          f"{(cfg.gradient_checkpointing, cfg.micro_batch_tokens, cfg.fsdp)} (asked: {asked})")


def load_models(cfg, base, ckpt, dev, dt):
    """the policy (from ckpt on a resume; LoRA: the base from --model, the adapters from ckpt) and
    the reference model for beta > 0 (None otherwise) -> (policy, ref_model)"""
    from batching import logprobs_forward
    from kv_reuse import checkpointing_enable, reuse_unsupported
    sharded = world_size() > 1 and cfg.fsdp
    policy = read_model(base if cfg.lora_r else ckpt or base, sharded, dev)
    if cfg.lora_r:
        lora.add_lora(policy, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                      lora.targets(cfg.lora_target_modules))
        if ckpt:
            lora.load_adapter(policy, ckpt)
    if cfg.kv_reuse and reuse_unsupported(policy):  # micro-batches planned as the passes will run
        print(f"kv_reuse: False ({reuse_unsupported(policy)}: the padded full path)")
        cfg.kv_reuse = False
    if cfg.gradient_checkpointing:
        checkpointing_enable(policy)
    if sharded:
        shard_model(policy, dt, dev, {"logprobs_forward": logprobs_forward})
    ref_model = None
    if cfg.beta > 0 and cfg.lora_r:
        ref_model = policy  # the base is the policy with its adapters off (lora.disabled)
    elif cfg.beta > 0:  # the k3 KL anchor: the initial weights in dt, frozen (FSDP2: sharded too)
        ref_model = read_model(base, sharded, dev)
        ref_model = cast_parameters(ref_model, dt).eval().requires_grad_(False)
        if sharded:
            shard_model(ref_model, dt, dev, {"logprobs_forward": logprobs_forward}, frozen=True)
    return policy, ref_model


def read_model(path, sharded, dev):
    """the float32 model at path on dev; FSDP2 (sharded): rank 0 reads it to its CPU and every
    other rank builds it on the meta device (no memory), as shard_model then sends each rank its
    shards of rank 0's weights: one host process holds the whole model, not one per rank"""
    if sharded and rank() > 0:
        return checkpoint.empty_model(path)
    return checkpoint.load_model(path, torch.device("cpu") if sharded else dev)


# -----------------------------------------------------------------------------
# 3. evaluate on the held-out set
@torch.no_grad()
def evaluate(model, tokenizer, eval_set, reward_fn, cfg, dev, batch=128):
    """held-out greedy accuracy and format rate (temperature 0, one completion a prompt), sharded
    over the ranks. eval_pass_k = k > 0 adds pass@k: the share of prompts with a correct answer
    among k samples at eval_temperature (with n = k samples, Chen et al.'s 1 - C(n-c, k)/C(n, k) is
    "any correct"). eval_samples: rank 0's first greedy completions, for the log."""
    model.eval()
    k, samples = cfg.eval_pass_k, []
    correct = fmt = passed = 0
    mine = eval_set[rank()::world_size()]
    # chunks of even size: a 1-prompt last chunk would compile the decode for one more shape
    batch = max(1, batch // max(k, 1))  # prompts per chunk, k samples each
    chunks = max(1, math.ceil(len(mine) / batch))
    batch = max(1, math.ceil(len(mine) / chunks))
    for i in range(0, len(mine), batch):
        chunk = mine[i:i + batch]
        ids, mask = encode_prompts(tokenizer, [q for q, _ in chunk], cfg.max_prompt_len, dev)
        buf = generate(model, ids, mask, 1, 0.0, 1.0, cfg, tokenizer)
        texts, scored = score(reward_fn, tokenizer, buf, chunk, 1)
        correct += sum(ok for _, ok, _ in scored)
        fmt += sum(r > 0 for r, _, _ in scored)
        for (q, a), text, (r, ok, _) in zip(chunk, texts, scored):
            if len(samples) < cfg.eval_samples:
                answer = a if isinstance(a, (int, float, str)) else str(a)
                samples.append(dict(question=q, answer=answer, completion=text,
                                    reward=round(float(r), 4), correct=bool(ok)))
        if k:
            buf = generate(model, ids, mask, k, cfg.eval_temperature, 1.0, cfg, tokenizer)
            scored = score(reward_fn, tokenizer, buf, chunk, k)[1]
            passed += sum(any(ok for _, ok, _ in scored[j:j + k]) for j in range(0, len(scored), k))
    correct, fmt, passed = (sum(x) for x in zip(*all_ranks((correct, fmt, passed))))
    out = dict(eval_accuracy=correct / len(eval_set), eval_format=fmt / len(eval_set))
    if k:
        out["eval_pass_k"] = passed / len(eval_set)
    if cfg.eval_samples:
        out["eval_samples"] = samples
    return out


# -----------------------------------------------------------------------------
# the loop
def train(argv):
    """check the config, join torchrun's process group, hold out_dir's lock, run"""
    t_start = time.time()
    cfg = parse_config(argv)
    dev, dt = resolve(cfg)  # every value checked: a bad one is refused before anything loads
    checkpoint.refuse_own_checkpoint(cfg)  # (training's own check: sample.py reads such a model)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first call
        torch.use_deterministic_algorithms(True)  # e.g. attention backward without atomics
    r, world, dev = setup_distributed(cfg, dev)  # rank 0 of 1 without torchrun
    try:
        procs = f", {world} processes" if world > 1 else ""
        print("config:", json.dumps(vars(cfg)),
              f"(resolved device={dev}, logprob_impl={cfg.logprob_impl}{procs})")
        make_prompts, reward_fn, eval_set = load_task(cfg.task, cfg.difficulty, cfg.eval_size,
                                                      cfg.eval_file)
        check_training_pool(make_prompts, step_seed(cfg.seed, 1), cfg.difficulty,
                            {q for q, _ in eval_set})
        if r == 0:  # out_dir is rank 0's
            os.makedirs(cfg.out_dir, exist_ok=True)
        lock = checkpoint.take_lock(cfg.out_dir) if r == 0 else None
        try:
            return run(cfg, dev, dt, make_prompts, reward_fn, eval_set, t_start)
        finally:
            checkpoint.close_trackers()
            if lock and os.path.exists(lock):
                os.remove(lock)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
        if cfg.deterministic:
            torch.use_deterministic_algorithms(False)  # (the tests call train in one process)


def run(cfg, dev, dt, make_prompts, reward_fn, eval_set, t_start):
    """set up (out_dir, memory, models), evaluate step 0 (or resume), then step until done"""
    from tqdm import tqdm
    r, world = rank(), world_size()

    # out_dir: a fresh run, or the checkpoint to resume (the other ranks wait for rank 0's)
    ckpt = rank0_value(checkpoint.prepare_out_dir(cfg) if r == 0 else None)
    state = checkpoint.read_trainer_state(ckpt) if ckpt else None
    if state:
        checkpoint.check_resume(state, cfg, world, ckpt)
    torch.manual_seed(cfg.seed + r)  # each rank samples its own completions
    random.seed(cfg.seed + r)
    # the base model: rank 0 converts the GGUF once, the others wait (on resume the policy is ckpt)
    base = rank0_value(checkpoint.resolve_model_path(cfg.model, cfg.gguf_dir) if r == 0 else None)
    tokenizer = checkpoint.load_tokenizer(ckpt or base)
    check_prompt_lengths(tokenizer, make_prompts, eval_set, cfg.max_prompt_len)
    plan_memory(cfg, base, world, dev, dt, resuming=ckpt is not None)
    policy, ref_model = load_models(cfg, base, ckpt, dev, dt)
    if r == 0 and cfg.overwrite:  # only now: a run refused or failed above keeps the earlier one
        checkpoint.remove_earlier_run(cfg)
    checkpoint.open_trackers(cfg, state["step"] if state else 0)  # train's finally closes them
    optimizer, master = make_optimizer(policy, cfg, dt)
    stop = stop_token_ids(policy, tokenizer)
    print(f"completions end at: {dict(zip(tokenizer.convert_ids_to_tokens(stop), stop))}, "
          f"or max_completion_len")
    reward_fn, reward_count = make_reward(reward_fn, cfg.reward, cfg.reward_weights)
    trainer = SimpleNamespace(  # what every step reads
        cfg=cfg, dev=dev, policy=policy, ref_model=ref_model, optimizer=optimizer, master=master,
        tokenizer=tokenizer, make_prompts=make_prompts, reward_fn=reward_fn,
        reward_count=reward_count, eval_set=eval_set, eval_questions={q for q, _ in eval_set},
        t_start=t_start, log_path=os.path.join(cfg.out_dir, "log.jsonl"))

    step, records = 0, []
    if state:
        step = checkpoint.restore_trainer_state(state, optimizer, r, ckpt)
        del state
        # the log up to step; later steps are redone
        records = checkpoint.read_log(trainer.log_path, step) if r == 0 else []
        print(f"resumed from {ckpt} at step {step}, {time.time() - t_start:.1f} s after the start")
    else:
        with gathered(policy):
            ev = evaluate(policy, tokenizer, eval_set, trainer.reward_fn, cfg, dev)
        records.append(dict(step=0, **ev, minutes=(time.time() - t_start) / 60))
        checkpoint.track(records[0])
        pass_k = f", pass@{cfg.eval_pass_k} {ev['eval_pass_k']:.3f}" if cfg.eval_pass_k else ""
        print(f"step 0: held-out greedy accuracy {ev['eval_accuracy']:.3f} (format "
              f"{ev['eval_format']:.3f}) on {len(eval_set)} prompts{pass_k}")
    if r == 0:
        checkpoint.write_log(trainer.log_path, records)
    pbar = tqdm(range(step + 1, cfg.max_steps + 1), initial=step, total=cfg.max_steps,
                desc="grpo", dynamic_ncols=True, disable=r != 0)
    flat = rank0_value(checkpoint.flat_steps(records))  # (a resumed run's log counts too)
    for step in pbar:
        rec = train_step(trainer, step)
        minutes = (time.time() - t_start) / 60
        out_of_time = rank0_value(cfg.max_minutes > 0 and minutes > cfg.max_minutes)
        flat = flat + 1 if rec["sampled_frac_reward_zero_std"] == 1.0 else 0  # no gradient
        stuck = cfg.max_flat_steps > 0 and flat >= cfg.max_flat_steps
        last = step == cfg.max_steps or out_of_time or stuck
        log_step(trainer, rec, last)
        records.append(rec)
        pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", acc=f"{rec['accuracy']:.2f}")
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or last:
            saved = checkpoint.save_checkpoint(cfg, policy, master, tokenizer, optimizer, step)
            if saved:  # (rank 0) what a save costs, to choose save_every by
                path, size, seconds = saved
                tqdm.write(f"saved {path} (step {step}, {size_text(size)}) in {seconds:.1f} s")
        if out_of_time:
            tqdm.write(f"max_minutes={cfg.max_minutes} reached after step {step}")
            break
        if stuck:
            tqdm.write(f"stopped after step {step}: for {flat} steps in a row every sampled "
                       f"group's rewards were equal (zero advantages and gradient: max_flat_steps)"
                       f"; more exploration (--temperature, --group_size) or another task helps")
            break
    pbar.close()
    finish(trainer, records)
    return SimpleNamespace(cfg=cfg, model=policy, records=records)


def train_step(trainer, step):
    """one step: 1. sample and score, 2. update -> the step's log record"""
    from batching import prepare_buffer, update_step
    cfg, policy = trainer.cfg, trainer.policy
    warmup = min(1.0, step / max(cfg.warmup_steps, 1))  # linear, then constant
    for g in trainer.optimizer.param_groups:  # set each step: a resumed state_dict has old values
        g.update(lr=cfg.lr * warmup, weight_decay=cfg.weight_decay)
    if trainer.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    # 1. sample: generate the step's groups once, one reward per completion
    t0, errors_before = time.time(), trainer.reward_count["errors"]
    policy.eval()
    n_opt = cfg.num_iterations * cfg.steps_per_generation  # optimizer steps per step
    # the rewards' log_metric values, and TRL's trainer_state (optimizer steps before, in all)
    trainer.reward_count.update(metrics={}, state=SimpleNamespace(
        global_step=(step - 1) * n_opt, max_steps=cfg.max_steps * n_opt))
    with gathered(policy):  # FSDP2: the full weights for generation (a no-op otherwise)
        buf, rewards, sample_stats = sample_step(cfg, step, policy, trainer.tokenizer,
                                                 trainer.make_prompts, trainer.reward_fn,
                                                 trainer.eval_questions, trainer.dev)
    t1 = time.time()

    # 2. update: advantages, mini-batches, old/ref log-probs, then the optimizer steps
    steps, frac_zero_std = prepare_buffer(policy, trainer.ref_model, buf, rewards, cfg)
    policy.train()
    updates = [update_step(policy, trainer.optimizer, buf, mbs, cfg, trainer.master)
               for _ in range(cfg.num_iterations) for mbs in steps]
    t2 = time.time()

    # each update's stats are means over its tokens already: average them over the updates
    passes = sum(u.pop("micro_batches") for u in updates)  # forward/backward passes: a count
    combine = {"max": max, "min": min, "sum": statistics.fmean}
    stats = {k: combine[stat_op(k)]([u[k] for u in updates]) for k in updates[0]}
    stats["micro_batches"] = passes
    if not math.isfinite(stats["loss"] + stats["grad_norm"]):  # NaN weights: stop before a save
        raise FloatingPointError(f"step {step} diverged (loss {stats['loss']:.3g}, grad_norm "
                                 f"{stats['grad_norm']:.3g}): not saved; resume with a lower --lr")

    # the step's log record, its numbers over every rank's groups
    lengths, truncated = buf["completion_mask"].sum(1).float(), buf["truncated"].float()
    n_tokens = int(buf["prompt_mask"].sum()) * cfg.group_size + int(lengths.sum())
    if world_size() > 1:
        lengths = torch.tensor([x for xs in all_ranks(lengths.tolist()) for x in xs])
        truncated = torch.tensor([x for xs in all_ranks(truncated.tolist()) for x in xs])
        n_tokens = sum(all_ranks(n_tokens))
        frac_zero_std = statistics.fmean(all_ranks(frac_zero_std))
    reward_errors = sum(all_ranks(trainer.reward_count["errors"] - errors_before))
    peak = torch.cuda.max_memory_allocated() / 2**30 if trainer.dev.type == "cuda" else 0.0
    rec = dict(step=step, **sample_stats, reward_errors=reward_errors,
               frac_reward_zero_std=frac_zero_std, completion_len_mean=lengths.mean().item(),
               completion_len_max=int(lengths.max()), truncated=truncated.mean().item(),
               **stats, optimizer_steps=len(updates),
               lr=trainer.optimizer.param_groups[0]["lr"], gen_s=t1 - t0, update_s=t2 - t1,
               tokens_per_s=n_tokens / (t2 - t0), peak_gib=peak,
               minutes=(time.time() - trainer.t_start) / 60)
    metrics = all_ranks(trainer.reward_count["metrics"])  # the rewards' log_metric values: means
    for k in sorted(set().union(*metrics)):
        if k not in rec:
            rec[k] = statistics.fmean(v for m in metrics for v in m.get(k, ()))
    # strict JSON: no NaN
    return {k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))}


def log_step(trainer, rec, last):
    """3. evaluate (every eval_every steps and at the last), then log the step"""
    from tqdm import tqdm
    cfg = trainer.cfg
    if (cfg.eval_every > 0 and rec["step"] % cfg.eval_every == 0) or last:
        with gathered(trainer.policy):  # every rank: the eval is sharded
            rec.update(evaluate(trainer.policy, trainer.tokenizer, trainer.eval_set,
                                trainer.reward_fn, cfg, trainer.dev))
    if rank() == 0:
        with open(trainer.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        checkpoint.track(rec)
    tqdm.write(checkpoint.format_record(rec))


def finish(trainer, records):
    """the plot, a summary of the held-out accuracy, where everything is"""
    cfg = trainer.cfg
    if rank() == 0:
        checkpoint.plot_curves(records, cfg.out_dir)
    evals = [(rec["step"], rec["eval_accuracy"]) for rec in records if "eval_accuracy" in rec]
    print(f"held-out greedy accuracy by step: {evals}")
    curves = os.path.join(cfg.out_dir, "curves.png")
    curves = curves if os.path.exists(curves) else "(pip install matplotlib)"
    ckpt = os.path.join(cfg.out_dir, "ckpt")
    print(f"log: {trainer.log_path}  plot: {curves}  checkpoint: {ckpt}"
          f"  total {(time.time() - trainer.t_start) / 60:.1f} min")
    if world_size() > 1:
        # leave together: a rank tearing down gloo while rank 0 still saves aborts the job
        torch.distributed.barrier()


if __name__ == "__main__":
    train(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # torchrun: leave before interpreter teardown, where gloo's worker threads can still be
        # joinable and abort the process ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
