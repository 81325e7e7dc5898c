"""
nanoGRPO: GRPO on one GPU, read top to bottom.

    python grpo.py                                   # the default: SmolLM2-135M-Instruct on synthetic arithmetic
    python grpo.py --task=countdown --lr=5e-6        # any config global (config.py) can be overridden as --key=value
    torchrun --nproc_per_node=2 grpo.py              # 2 processes, each a device and half of each step's groups

One step = one generation batch (prompts_per_step x group_size completions, sampled once; with dynamic_sampling,
resampled until its groups carry signal), then num_iterations x steps_per_generation optimizer steps over it
(batching.py). The knobs and their checks: config.py; what is on disk: checkpoint.py; the tasks: tasks.py.
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
from dist import all_ranks, fsdp_modules, gathered, rank, rank0_value, setup_distributed, stat_op, world_size
import lora
from config import AUTO_TOKENS, memory_errors, parse_config, resolve
from tasks import (TASKS, check_training_pool, load_task, make_reward, overlong_penalty,  # noqa: F401
                   reward_names, step_seed, train_prompts)  # (grpo.TASKS: tasks')

# ------------------------------------------------------------------------------------------------------------------
# more than one process: `torchrun --nproc_per_node=N grpo.py ...`. Each rank generates and scores its own
# prompts_per_step / N whole groups (advantages stay local) from its own RNG stream (seed + rank); the gradients sum
# over the ranks (dist.py; replicas, or FSDP2: --fsdp). The eval is sharded; rank 0 alone prints, logs, saves.
def shard_model(model, dt, dev):
    """FSDP2: fully_shard each decoder layer, then the root (embeddings, final norm, LM head: tied ones stay one
    parameter). The float32 weights, gradients and AdamW moments are sharded; forward and backward run in dt on gathered
    weights (MixedPrecisionPolicy), gradients reduce-scattered in float32 as a SUM (the loss weights hold the global
    normalizers). A unit stays gathered until the mini-batch's backward ends (batching.backward reshards; ZeRO-2 for the
    dt weights): kv_reuse calls each layer twice (prompt, then completions), and the prompt pass's backward (started by
    the completions' K/V gradients) runs after the completion pass's post-backward hook, which reshards by default, and
    for the last layer with no pre-backward hook at all (the prompt pass's output gets no gradient): it would read freed
    weights. The loss is a root forward method (batching.logprobs_forward), so it reads the gathered LM-head weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from batching import logprobs_forward
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


# ------------------------------------------------------------------------------------------------------------------
# prompts
def stop_token_ids(model, tokenizer):
    """the tokenizer's EOS and each generation_config EOS, where model.generate stops (Qwen2.5: 2, Llama-3.1: 3)"""
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


def score(reward_fn, tokenizer, buf, pairs, n):
    """(texts, reward_fn's [(total, correct, [each reward])]) of buf's completions, rows prompt-major: row i answers
    pairs[i // n] = (question, example). Its token ids are cut at its length, the EOS included (TRL's count)."""
    texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
    ids = [row[:L] for row, L in zip(buf["completion_ids"].tolist(), buf["completion_mask"].sum(1).tolist())]
    rows = [pairs[i // n] for i in range(len(texts))]
    return texts, reward_fn([q for q, _ in rows], texts, [e for _, e in rows], ids)


# ------------------------------------------------------------------------------------------------------------------
# the loop
def cast_parameters(model, dt):
    """the parameters in dt, the buffers left as they are: RoPE's inv_freq stays float32, as transformers'
    from_pretrained(dtype=bfloat16) leaves it. model.to(bfloat16) would round it too (relative error up to 3e-3),
    and the rotary angle position * inv_freq with it: 0.14 rad off at position 100, 2.8 rad at 2000 (SmolLM2)."""
    for p in model.parameters():  # (a tied weight is one parameter: it stays tied)
        p.data = p.data.to(dt)
    return model


def make_optimizer(policy, cfg, dt):
    """AdamW over float32 weights. A bf16 run's model holds dt copies (generation, forward, backward: all in dt), the
    optimizer float32 masters, rounded into the model after each step: stepping bf16 weights drops every update below
    2^-8 of the weight, and an lr=1e-5 AdamW update is ~1e-3 of a typical weight. Under FSDP2 the sharded parameters are
    the masters (shard_model). With LoRA only the float32 adapters train: the frozen base is cast to dt, with no master
    (a 7B base is 15 GB in bf16; masters and AdamW would add 90 GB). -> (optimizer, masters or None)"""
    master, sharded = None, bool(fsdp_modules(policy))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    if len(trainable) < len(list(policy.parameters())):  # LoRA (lora.add_lora froze the rest)
        for p in policy.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dt)
    elif dt != torch.float32 and not sharded:
        master = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]  # float32, before the cast
        cast_parameters(policy, dt)
    params = master if master is not None else trainable
    fused = {} if not params[0].is_cuda else {"foreach": True} if sharded else {"fused": True}  # (DTensors: foreach)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, **fused)
    return opt, master


@torch.no_grad()
def evaluate(model, tokenizer, eval_set, reward_fn, cfg, dev, batch=128):
    """held-out greedy accuracy and format rate (temperature 0, one completion a prompt); eval_pass_k = k > 0 adds
    pass@k, the share of prompts with a correct answer among k samples at eval_temperature (n = k: Chen et al.'s
    1 - C(n-c, k)/C(n, k) is "any correct"). Sharded over the ranks. eval_samples: rank 0's first greedy completions."""
    from batching import rollout
    model.eval()
    correct = fmt = passed = 0
    samples, k = [], cfg.eval_pass_k
    mine = eval_set[rank()::world_size()]  # (all of it in one process)
    batch = max(1, batch // max(k, 1))  # prompts per chunk: k samples each
    chunks = max(1, math.ceil(len(mine) / batch))
    batch = max(1, math.ceil(len(mine) / chunks))  # even sizes: a 1-prompt last chunk recompiles the decode (~26 s)
    for i in range(0, len(mine), batch):
        chunk = mine[i:i + batch]
        ids, mask = encode_prompts(tokenizer, [q for q, _ in chunk], cfg.max_prompt_len, dev)
        for n, temp in ((1, 0.0),) + (((k, cfg.eval_temperature),) if k else ()):
            buf = rollout(model, ids, mask, n, cfg.max_completion_len, temp, 1.0, stop_token_ids(model, tokenizer),
                          tokenizer.pad_token_id, cfg.compile, cfg.rollout_kv_gib)
            texts, scored = score(reward_fn, tokenizer, buf, chunk, n)
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
    """one step's prompts -> groups of completions -> rewards (the task's, weighted, plus the soft overlong penalty).
    With dynamic_sampling (DAPO) a group whose G rewards are all equal carries no gradient: it is dropped and more
    prompts are drawn (at most max_sampling_tries draws) until prompts_per_step groups carry signal. Short of that,
    the step trains on the informative groups alone, as DAPO and verl do: uniform groups would add their tokens to
    the dapo/bnpo normalizers and dilute the few with signal (1 in 32: a 32x smaller gradient); they only round up
    to whole steps_per_generation mini-batches. Returns (buffer, rewards (B*G,), stats of EVERY sampled completion)."""
    from batching import concat_groups, rollout, select_groups
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
                          stop_token_ids(policy, tokenizer), tokenizer.pad_token_id, cfg.compile, cfg.rollout_kv_gib)
        except torch.cuda.OutOfMemoryError as e:
            raise torch.cuda.OutOfMemoryError("out of GPU memory while generating: lower --prompts_per_step, "
                                              "--group_size or --max_completion_len") from e
        scored = score(reward_fn, tokenizer, buf, batch, G)[1]  # rows prompt-major (b*G + g)
        pens = [overlong_penalty(L, cfg.max_completion_len, cfg.soft_punish_cache, cfg.overlong_penalty_factor)
                for L in buf["completion_mask"].sum(1).tolist()]
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
    buf = draws[0][0] if chosen == [(0, b) for b in range(n)] else concat_groups(  # (the first draw, whole, in order)
        [select_groups(d, idx) for d, _, idx in picks], tokenizer.pad_token_id)
    rewards = torch.cat([r.view(n, G)[idx].view(-1) for _, r, idx in picks])  # (B*G,) in buf's order
    # every sampled completion's reward, as trained on, of every rank
    parts = all_ranks((torch.cat([r for _, r in draws]).tolist(), sampled, n_flat, len(draws), len(chosen)))
    totals = torch.tensor(sum((p[0] for p in parts), []))
    sampled, n_flat, tries = sum((p[1] for p in parts), []), sum(p[2] for p in parts), [p[3] for p in parts]
    stats = dict(reward_mean=totals.mean().item(), reward_std=totals.std().item(),
                 accuracy=sum(s[1] for s in sampled) / len(sampled),
                 sampling_tries=max(tries), groups=sum(p[4] for p in parts),
                 extra_rollouts=sum(t - 1 for t in tries) * n * G,
                 sampled_frac_reward_zero_std=n_flat / (n * sum(tries)), decode=draws[0][0]["decode"],
                 rollout_waves=draws[0][0]["waves"])  # (1 unless the K/V budget cut it: rollout_kv_gib)
    for i, name in enumerate(reward_names(cfg.reward)):
        stats[f"reward/{name}"] = torch.tensor([s[2][i] for s in sampled]).nanmean().item()  # (TRL: None rows out)
    if cfg.soft_punish_cache:
        stats["reward/overlong"] = statistics.fmean(s[3] for s in sampled)
    return buf, rewards, stats


def train(argv):
    t_start = time.time()
    cfg = parse_config(argv)
    dev, dt = resolve(cfg)  # every value checked: a bad one is refused before anything loads or is written
    if cfg.deterministic:  # before the first cuBLAS call: its split reductions follow the workspace config
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)  # e.g. SDPA's backward without atomics (flash: dQ, mem-efficient)
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
            checkpoint.close_trackers()
            if lock and os.path.exists(lock):
                os.remove(lock)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
        if cfg.deterministic:
            torch.use_deterministic_algorithms(False)  # (train called in a process that goes on: the tests)


def run(cfg, dev, dt, make_prompts, reward_fn, eval_set, t_start):
    from tqdm import tqdm
    from transformers import AutoConfig

    from batching import free_gpu_bytes, prepare_buffer, update_step
    from kv_reuse import checkpointing_enable
    from rollout import kv_bytes_per_token
    r, world = rank(), world_size()
    ckpt = rank0_value(checkpoint.prepare_out_dir(cfg) if r == 0 else None)  # the others wait for rank 0's recovery
    state = checkpoint.read_trainer_state(ckpt) if ckpt else None
    if state:
        checkpoint.check_resume(state, cfg, world, ckpt)
    torch.manual_seed(cfg.seed + r)  # each rank samples its own completions; rank 0 (one process) as before
    random.seed(cfg.seed + r)
    # on resume the policy comes from ckpt, the reference from here; rank 0 converts the GGUF once, the others wait
    base = rank0_value(checkpoint.resolve_model_path(cfg.model, cfg.gguf_dir) if r == 0 else None)
    tokenizer = checkpoint.load_tokenizer(ckpt or base)
    encode_prompts(tokenizer, [q for q, _ in eval_set], cfg.max_prompt_len, dev)  # max_prompt_len: said before loading
    if dev.type == "cuda":  # the state, a completion's K/V and its activations must fit: said before the weights load
        asked = (cfg.gradient_checkpointing, cfg.micro_batch_tokens, cfg.fsdp)  # auto and 0: resolved in place
        try:
            n_params, mc = checkpoint.parameter_count(base), AutoConfig.from_pretrained(base)
            kv_token = kv_bytes_per_token(mc, torch.finfo(dt).bits // 8)
            errors = memory_errors(cfg, n_params, world, free_gpu_bytes(dev), kv_token, mc)  # (mc: auto's sizes)
        except Exception as e:  # noqa: BLE001 - a check that cannot count must not stop a run that may fit
            errors = []
            print(f"(memory check skipped: {base}: {type(e).__name__}: {e})")
        if errors:
            raise ValueError("bad config:\n  " + "\n  ".join(errors))
        chosen = rank0_value((cfg.gradient_checkpointing is True, cfg.micro_batch_tokens or AUTO_TOKENS,
                              world > 1 and cfg.fsdp is not False))  # (memory check skipped: auto is FSDP2)
        cfg.gradient_checkpointing, cfg.micro_batch_tokens, cfg.fsdp = chosen  # rank 0's: the same on every rank
        print(f"memory: gradient_checkpointing, micro_batch_tokens, fsdp = {chosen} (asked: {asked})")
    sharded = world > 1 and cfg.fsdp
    checkpoint.open_trackers(cfg, state["step"] if state else 0)  # --report_to (rank 0's); train's finally closes
    # (FSDP2: loaded on the CPU, sharded to dev.) LoRA: the base from --model, the adapters from ckpt on resume
    policy = checkpoint.load_model(base if cfg.lora_r else ckpt or base, torch.device("cpu") if sharded else dev)
    if cfg.lora_r:
        lora.add_lora(policy, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, lora.targets(cfg.lora_target_modules))
        if ckpt:
            lora.load_adapter(policy, ckpt)
    if cfg.gradient_checkpointing:
        checkpointing_enable(policy)
    if sharded:
        shard_model(policy, dt, dev)
    ref_model = None
    if cfg.beta > 0 and cfg.lora_r:  # the base is the policy with its adapters off (batching: lora.disabled)
        ref_model = policy
    elif cfg.beta > 0:  # k3 KL anchor: the initial weights, frozen (under FSDP2 too: a dt replica on every rank)
        ref_model = cast_parameters(checkpoint.load_model(base, dev), dt).eval().requires_grad_(False)
    optimizer, master = make_optimizer(policy, cfg, dt)
    stop = stop_token_ids(policy, tokenizer)
    print(f"completions end at: {dict(zip(tokenizer.convert_ids_to_tokens(stop), stop))}, or max_completion_len")
    reward_fn, reward_count = make_reward(reward_fn, cfg.reward, cfg.reward_weights)
    eval_questions = {q for q, _ in eval_set}
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    step, records = 0, []
    if state:
        step = checkpoint.restore_trainer_state(state, optimizer, r, ckpt)
        del state
        records = checkpoint.read_log(log_path, step) if r == 0 else []  # (later steps are redone)
        print(f"resumed from {ckpt} at step {step}")
    else:
        with gathered(policy):
            ev = evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)
        records.append(dict(step=0, **ev, minutes=(time.time() - t_start) / 60))
        checkpoint.track(records[0])  # (--report_to: rank 0's trackers)
        print(f"step 0: held-out greedy accuracy {ev['eval_accuracy']:.3f} (format {ev['eval_format']:.3f}) on "
              f"{len(eval_set)} prompts" + (f", pass@{cfg.eval_pass_k} {ev['eval_pass_k']:.3f}" if cfg.eval_pass_k
                                             else ""))
    if r == 0:
        checkpoint.write_log(log_path, records)

    pbar = tqdm(range(step + 1, cfg.max_steps + 1), initial=step, total=cfg.max_steps, desc="grpo", dynamic_ncols=True,
                disable=r != 0)
    flat = 0  # steps in a row that sampled no group with reward spread (max_flat_steps)
    for step in pbar:
        for g in optimizer.param_groups:  # linear warmup, then constant (stateless, so resume needs nothing)
            g["lr"] = cfg.lr * min(1.0, step / max(cfg.warmup_steps, 1))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()  # 1. generate once for the whole generation batch; 2. rewards, one per completion
        policy.eval()
        errors_before, n_opt = reward_count["errors"], cfg.num_iterations * cfg.steps_per_generation
        reward_count.update(metrics={}, state=SimpleNamespace(  # the rewards' log_metric values; TRL's trainer_state:
            global_step=(step - 1) * n_opt, max_steps=cfg.max_steps * n_opt))  # optimizer steps before / in all
        with gathered(policy):  # FSDP2: the full weights for this step's generation (a no-op otherwise)
            buf, rewards, sample_stats = sample_step(cfg, step, policy, tokenizer, make_prompts, reward_fn,
                                                     eval_questions, dev)
        t1 = time.time()
        # 3. advantages, mini-batches, loss weights, old/ref log-probs; num_iterations x steps_per_generation updates
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
        metrics = all_ranks(reward_count["metrics"])  # the rewards' log_metric values: each one's mean over the ranks
        rec |= {k: statistics.fmean(v for m in metrics for v in m.get(k, ())) for k in sorted(set().union(*metrics))
                if k not in rec}
        rec = {k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))}  # strict JSON: no NaN
        out_of_time = rank0_value(cfg.max_minutes > 0 and time.time() - t_start > cfg.max_minutes * 60)  # all stop
        flat = flat + 1 if rec["sampled_frac_reward_zero_std"] == 1.0 else 0  # (over every rank's groups)
        stuck = cfg.max_flat_steps > 0 and flat >= cfg.max_flat_steps
        last = step == cfg.max_steps or out_of_time or stuck
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or last:  # every rank: the eval is sharded
            with gathered(policy):
                rec.update(evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev))
        records.append(rec)
        if r == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            checkpoint.track(rec)
        pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", acc=f"{rec['accuracy']:.2f}")
        tqdm.write(format_record(rec))
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or last:
            checkpoint.save_checkpoint(cfg, policy, master, tokenizer, optimizer, step)
        if out_of_time:
            tqdm.write(f"max_minutes={cfg.max_minutes} reached after step {step}")
            break
        if stuck:
            tqdm.write(f"stopped after step {step}: for {flat} steps in a row every sampled group's rewards were "
                       f"equal (zero advantages, zero gradient), so the policy could not change (max_flat_steps="
                       f"{cfg.max_flat_steps}); more exploration (--temperature, --group_size) or another task helps")
            break
    pbar.close()
    if r == 0:
        checkpoint.plot_curves(records, cfg.out_dir)
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
def format_record(r):
    r = {k: math.nan for k in ("clip_ratio", "clip_low", "clip_high", "entropy")} | r
    each = [f"{k[7:]} {v:.3f}" for k, v in r.items() if k.startswith("reward/")]  # each reward's mean, if several
    s = (f"step {r['step']}: reward {r['reward_mean']:.3f}±{r['reward_std']:.3f}"
         + (f" ({', '.join(each)})" if len(each) > 1 else "") + f" acc {r['accuracy']:.3f} "
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


if __name__ == "__main__":
    train(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun: the process group is destroyed, every file closed;
        sys.stdout.flush()                       # leave before interpreter teardown, where gloo's worker threads
        sys.stderr.flush()                       # can still be joinable: "terminate called without an active
        os._exit(0)                              # exception", SIGABRT (pytorch PR 179291; seen once in CI)
