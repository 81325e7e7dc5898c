"""
Models and runs on disk: model directories (smollm2.py makes the default one), resuming a killed
run, and out_dir: LOCK ({"pid", "host"} of the run that holds it), log.jsonl (a JSON record a step),
curves.png, tensorboard/ and wandb/ (--report_to), and ckpt/: an HF directory (from_pretrained loads
it as it is) + trainer_state.pt (step, optimizer, every rank's RNG, world size, config), and under
FSDP2 each rank's optimizer shard. A run can be killed anywhere: every write ends with a rename;
recover_checkpoint, read_log and take_lock undo what a kill leaves, and a file cut otherwise is
named when it fails to load (loaded).
"""
import glob
import json
import math
import os
import random
import shutil
import socket
import time

import torch

import lora
import smollm2
from dist import all_ranks, fsdp_modules, rank, rank0_value

# out_dir: the LOCK, a run's files, --overwrite / --resume, atomic checkpoints ---------------------
RUN_FILES = ("log.jsonl", "log.jsonl.tmp", "curves.png", "ckpt", "ckpt.tmp", "ckpt.old",
             "tensorboard", "wandb")
# what defines a run (weights' lineage, data, held-out set, shapes): resume refuses a change
STRUCTURAL = ("model", "task", "eval_file", "difficulty", "eval_size", "seed", "group_size",
              "max_completion_len", "dtype", "lora_r", "lora_alpha", "lora_target_modules")
# --report_to's open writers (rank 0's): {"tensorboard": a SummaryWriter, "wandb": wandb's Run}
TRACKERS = {}


def take_lock(out_dir):
    """Create out_dir/LOCK (pid, host) atomically: a live run's is refused, a dead one's taken."""
    path, me = os.path.join(out_dir, "LOCK"), {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    held = json.load(f)
                pid, host = int(held["pid"]), held["host"]
            except (OSError, ValueError, KeyError, TypeError):  # killed before writing it
                pid, host = None, me["host"]
            if host != me["host"]:
                raise ValueError(f"{out_dir} is in use by pid {pid} on {host} ({path}); if that "
                                 f"run is gone, delete {path}") from None
            # (our own pid: a run killed before a restart that handed its pid to this process)
            if pid is not None and pid != me["pid"] and pid_alive(pid):
                raise ValueError(f"{out_dir} is in use by a live run (pid {pid}, {path}): wait "
                                 f"for it, or pick another --out_dir (if no run is there, pid "
                                 f"{pid} is another program: delete {path})") from None
            print(f"taking over {path}: the run that held it (pid {pid}) is gone")
            os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise ValueError(f"{path}: another run took the lock first")


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and someone else's
        return True
    try:  # an unreaped killed run (no init in a container) is a zombie: dead, yet kill() works
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def refuse_own_checkpoint(cfg):
    """a --model that is out_dir's checkpoint, which --overwrite or the run's first save removes"""
    saves = [os.path.realpath(os.path.join(cfg.out_dir, d)) for d in RUN_FILES if "ckpt" in d]
    if os.path.realpath(os.path.expanduser(cfg.model)) in saves:
        raise ValueError(f"--model={cfg.model!r} is the checkpoint in --out_dir={cfg.out_dir!r}, "
                         f"which this run would replace: copy it elsewhere, or use another out_dir")


def prepare_out_dir(cfg):
    """Under the lock: an earlier run is refused unless --overwrite=True (remove_earlier_run clears
    it later) or --resume=True: -> its checkpoint, brought into a plain state (else None)."""
    if cfg.overwrite:
        return None
    if not cfg.resume:
        earlier = [os.path.basename(f) for f in earlier_files(cfg.out_dir)]
        if earlier:
            raise ValueError(f"{cfg.out_dir} holds an earlier run ({', '.join(earlier)}): pass "
                             f"--resume=True to continue it, --overwrite=True to replace it, or "
                             f"another --out_dir")
        return None
    ckpt = recover_checkpoint(cfg.out_dir)
    if ckpt is None:  # (config's checks refused an out_dir that does not exist)
        print(f"--resume=True: no checkpoint in {cfg.out_dir} yet (killed before its first "
              f"save?): starting at step 0")
    return ckpt


def earlier_files(out_dir):
    """the paths of an earlier run's files in out_dir"""
    return [os.path.join(out_dir, f) for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]


def remove_earlier_run(cfg):
    """--overwrite=True: the earlier run's files, removed once the checks before loading passed"""
    for path in earlier_files(cfg.out_dir):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"--overwrite=True: removed the earlier run's {os.path.basename(path)}")


def tree_bytes(path):
    """the bytes of a file, or of every file under a directory"""
    walk = os.walk(path) if os.path.isdir(path) else [("", [], [path])]
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in walk for f in fs)


def recover_checkpoint(out_dir):
    """The newest complete checkpoint as out_dir/ckpt, ckpt.tmp and ckpt.old gone; None if none.
    Only renames move a complete directory. A kill in save_checkpoint (or here) leaves one of:
    tmp partial (ckpt as before); tmp and ckpt complete (before the swap); tmp complete, ckpt
    gone, old complete (mid-swap); ckpt complete, old left over (it would block later saves)."""
    final = os.path.join(out_dir, "ckpt")
    tmp, old = final + ".tmp", final + ".old"
    def is_complete(d):  # save_checkpoint writes trainer_state.pt last
        return os.path.isfile(os.path.join(d, "trainer_state.pt"))
    if is_complete(tmp):  # a finished save that was not swapped in: it is the newest
        if is_complete(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        elif os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    elif is_complete(old) and not is_complete(final):  # only by hand: fall back to the old one
        shutil.rmtree(final, ignore_errors=True)
        os.replace(old, final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return final if is_complete(final) else None


def save_checkpoint(cfg, model, master, tokenizer, optimizer, step):
    """Every rank calls it (its RNG state goes in). Rank 0 writes the HF directory to ckpt.tmp (and
    every rank its FSDP2 optimizer shard), then trainer_state.pt, and swaps ckpt.tmp in as ckpt.
    -> rank 0: (ckpt, its bytes, the seconds the save took); the other ranks: None"""
    t0 = time.time()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    rng = dict(torch=torch.get_rng_state(), python=random.getstate(), cuda=cuda_rng)
    rngs = all_ranks(rng)
    sharded = bool(fsdp_modules(model))
    if sharded:  # the full weights gathered to rank 0's CPU (a tied one once)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        weights = {k: v for k, v in weights.items() if k in names}
    tmp = os.path.join(cfg.out_dir, "ckpt.tmp")
    if rank() == 0:
        recover_checkpoint(cfg.out_dir)  # no ckpt.tmp or ckpt.old left in the way
        if sharded:  # the float32 shards are the weights (a bf16 run's masters)
            model.save_pretrained(tmp, state_dict=weights)
        elif cfg.lora_r:  # a PEFT adapter directory: the base stays where --model points
            base = os.path.abspath(resolve_model_path(cfg.model, cfg.gguf_dir))
            lora.save_adapter(model, tmp, base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                              lora.targets(cfg.lora_target_modules))
        elif master is not None:  # the float32 masters are the weights; the bf16 model rounds them
            names = [n for n, _ in model.named_parameters()]
            model.save_pretrained(tmp, state_dict=dict(zip(names, master)))
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    if sharded:
        rank0_value(None)  # tmp exists (and no leftover is removed from under the others' files)
        shard = os.path.join(tmp, f"optimizer_rank{rank()}.pt")
        torch.save(local_optimizer_state(optimizer), shard)
        rank0_value(None)  # every shard is written
    if rank() != 0:
        return
    state = dict(step=step, optimizer=None if sharded else optimizer.state_dict(), rng=rng,
                 rng_ranks=rngs, world_size=len(rngs), config=vars(cfg))
    path = os.path.join(tmp, "trainer_state.pt")
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)  # tmp is complete from here on
    final = recover_checkpoint(cfg.out_dir)  # swaps it in as ckpt, the old one out
    return final, tree_bytes(final), time.time() - t0


def local_optimizer_state(optimizer):
    """The optimizer's state_dict, each DTensor (FSDP2: this rank's shard of a moment) as local."""
    sd = optimizer.state_dict()
    state = {i: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    return dict(sd, state=state)


def load_local_optimizer_state(optimizer, sd):
    """local_optimizer_state's inverse: each moment a DTensor again, shaped like its parameter."""
    from torch.distributed.tensor import DTensor
    optimizer.load_state_dict(sd)
    for p, s in optimizer.state.items():
        for k, v in s.items():
            local = isinstance(p, DTensor) and not isinstance(v, DTensor)
            if local and v.shape == p.to_local().shape:
                s[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())


# model directories: a checkpoint or the base (an HF directory; "smollm2": smollm2.py) ----------


def loaded(what, path, load):
    """load(), or a ValueError naming the file that does not parse (a parser's error names none)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - re-raised with the file's name
        why = f"{type(e).__name__}: {e}"
        pattern = os.path.join(path, "*.")
        for f in sorted(glob.glob(pattern + "json") + glob.glob(pattern + "safetensors")):
            try:
                if f.endswith(".json"):
                    with open(f) as fh:
                        json.load(fh)
                else:
                    from safetensors import safe_open
                    safe_open(f, "pt").keys()  # reads the header only
            except Exception as e2:  # noqa: BLE001
                why = f"{f} is corrupt ({type(e2).__name__}: {e2})"
                break
        raise ValueError(f"could not load the {what} from {path}: {why}") from e


def resolve_model_path(name, gdir):
    if name == "smollm2":  # the default, converted once from its GGUF
        if not os.path.exists(os.path.join(smollm2.MODEL_DIR, "config.json")):
            smollm2.convert(gdir)
        return smollm2.MODEL_DIR
    return os.path.expanduser(name)  # a local HF directory (check_model looked at it) or a hub id


def load_tokenizer(path):
    from transformers import AutoTokenizer
    tok = loaded("tokenizer", path, lambda: AutoTokenizer.from_pretrained(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path, dev):
    from transformers import AutoModelForCausalLM
    model = loaded("model", path,
                   lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return model.to(dev)


def empty_model(path):
    """The model at path on the meta device: its modules, config and generation config (its EOS
    ids end the completions), no memory, no weights read. (Under FSDP2 every rank but 0 starts so;
    dist.shard_model fills its shards from rank 0's.)"""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    with torch.device("meta"):
        model = loaded("model", path, lambda: AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.float32))
    if os.path.exists(os.path.join(path, "generation_config.json")):  # as from_pretrained reads it
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()  # (as from_pretrained returns it)


def parameter_count(path):
    """The parameter count (a tied embedding once), from the config on the meta device: no reads."""
    return sum(p.numel() for p in empty_model(path).parameters())


# resume -------------------------------------------------------------------------------------------
def read_trainer_state(ckpt):
    path = os.path.join(ckpt, "trainer_state.pt")
    return loaded("trainer state", path, lambda: torch.load(path, weights_only=False))


def check_resume(state, cfg, world, ckpt):
    """Refuse a STRUCTURAL change from ckpt's run (naming each key and both values), another process
    count (each rank's RNG and groups are its own) or --fsdp; print the other changes."""
    if cfg.fsdp == "auto":  # resumed as ckpt's run went: sharded or replicas (one process: neither)
        cfg.fsdp = world > 1 and state["optimizer"] is None
    saved = state["config"]
    def norm(k, v):  # the same local model directory, however it is written
        local_dir = k == "model" and os.path.isdir(os.path.expanduser(v))
        return os.path.realpath(os.path.expanduser(v)) if local_dir else v
    auto = {"gradient_checkpointing": "auto", "micro_batch_tokens": 0}  # saved as plan_memory chose
    changed = {k: (saved[k], v) for k, v in vars(cfg).items() if k in saved
               and k not in ("out_dir", "resume", "overwrite") and norm(k, saved[k]) != norm(k, v)
               and not (k in auto and v == auto[k])}
    bad = [f"--{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items() if k in STRUCTURAL]
    if bad:
        raise ValueError(f"--resume=True would continue the run in {cfg.out_dir} as another run: "
                         f"{'; '.join(bad)}. Keep these as they were, or start a new run (another "
                         f"--out_dir, or --overwrite=True)")
    for k, (a, b) in changed.items():
        print(f"resume: --{k} changed from {a!r} to {b!r}")
    if state.get("world_size", 1) != world:
        raise ValueError(f"{ckpt} was written by a run of {state.get('world_size', 1)} "
                         f"process(es); this one has {world}: resume with the same number "
                         f"(torchrun --nproc_per_node=N, or plain python for 1)")
    saved_fsdp = state["optimizer"] is None  # FSDP2 keeps the optimizer in per-rank shards
    if world > 1 and saved_fsdp != cfg.fsdp:
        raise ValueError(f"{ckpt} was written with --fsdp={saved_fsdp}; resume with the same")


def restore_trainer_state(state, optimizer, r=0, ckpt=None):
    if state["optimizer"] is None:  # FSDP2: this rank's shard (check_resume: the same N wrote it)
        path = os.path.join(ckpt, f"optimizer_rank{r}.pt")
        sd = loaded("optimizer shard", path, lambda: torch.load(path))
        load_local_optimizer_state(optimizer, sd)
    else:
        optimizer.load_state_dict(state["optimizer"])
    rng = state["rng_ranks"][r] if "rng_ranks" in state else state["rng"]  # this rank's own
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


# the log, the plot, --report_to ------------------------------------------------------------------
def read_log(path, step):
    """log.jsonl's records up to `step` (the checkpoint's; later ones are redone). A cut last line
    (killed while appending) is dropped with a notice; a bad line before it is an error."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path} line {i + 1} is not JSON ({e}): fix or drop it") from None
            print(f"{path}: dropping its cut last line ({len(line)} characters, killed mid-write)")
    return [r for r in records if r["step"] <= step]


def flat_steps(records):
    """the steps in a row at the log's end that sampled no group with reward spread"""
    flat = (r.get("sampled_frac_reward_zero_std") == 1.0 for r in reversed(records))
    return next((i for i, f in enumerate(flat) if not f), len(records))


def write_log(path, records):
    """All of log.jsonl at once, through a rename: a kill leaves the old file, not an empty one."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def format_record(r):
    """a step's log record as one line for the console"""
    r = {k: math.nan for k in ("clip_ratio", "clip_low", "clip_high", "entropy")} | r
    each = [f"{k[7:]} {v:.3f}" for k, v in r.items() if k.startswith("reward/")]
    s = f"step {r['step']}: reward {r['reward_mean']:.3f}±{r['reward_std']:.3f}"
    if len(each) > 1:  # each reward's mean, when there are several
        s += f" ({', '.join(each)})"
    s += (f" acc {r['accuracy']:.3f} zero_std {r['frac_reward_zero_std']:.2f}"
          f" len {r['completion_len_mean']:.1f}/{r['completion_len_max']}"
          f" loss {r['loss']:.4f} clip {r['clip_ratio']:.3f}"
          f" (lo {r['clip_low']:.3f} hi {r['clip_high']:.3f}) ent {r['entropy']:.3f}"
          f" gnorm {r['grad_norm']:.3f} gen {r['gen_s']:.1f}s upd {r['update_s']:.1f}s"
          f" {r['tokens_per_s']:.0f} tok/s {r['peak_gib']:.1f}GiB")
    if r.get("extra_rollouts"):
        s += (f" resampled {r['sampling_tries']}x (+{r['extra_rollouts']} rollouts,"
              f" {r['groups']} groups trained)")
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
    """out_dir/curves.png from the log's records (nothing without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    steps = [r["step"] for r in train]
    ax[0].plot(steps, [r["reward_mean"] for r in train], label="train reward")
    ax[0].plot(steps, [r["accuracy"] for r in train], label="train accuracy (sampled)")
    ax[1].plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
               label="held-out greedy accuracy")
    for a in ax:
        a.set_xlabel("step")
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=100)
    plt.close(fig)


def open_trackers(cfg, step):
    """Rank 0, the model loaded (--overwrite's removal is behind): --report_to's writers from `step`
    on (purge_step hides the steps a resumed run redoes)."""
    names = cfg.report_to.split(",") if rank() == 0 else []
    if "tensorboard" in names:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"), purge_step=step + 1)
        TRACKERS["tensorboard"] = writer
        writer.add_text("config", f"```\n{json.dumps(vars(cfg), indent=1)}\n```", step)
    if "wandb" in names:  # WANDB_MODE=offline: no network; `wandb sync out_dir/wandb/...` later
        import wandb
        name = os.environ.get("WANDB_NAME", os.path.basename(os.path.abspath(cfg.out_dir)))
        TRACKERS["wandb"] = wandb.init(project=os.environ.get("WANDB_PROJECT", "nanogrpo"),
                                       name=name, dir=cfg.out_dir, config=vars(cfg))


def track(rec):
    """A log.jsonl record to each open tracker: its numbers at its step, and its eval samples."""
    nums = {k: v for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    samples, step = rec.get("eval_samples"), rec["step"]
    writer = TRACKERS.get("tensorboard")
    if writer is not None:
        for k, v in nums.items():
            writer.add_scalar(k, v, step)
        if samples:
            writer.add_text("eval_samples", f"```\n{json.dumps(samples, indent=1)}\n```", step)
        writer.flush()  # a killed run keeps every step it logged
    if "wandb" in TRACKERS:
        import wandb
        if samples:
            rows = [list(x.values()) for x in samples]
            nums["eval_samples"] = wandb.Table(columns=list(samples[0]), data=rows)
        TRACKERS["wandb"].log(nums, step=step)


def close_trackers():
    """grpo.train's finally: a run that stops early or raises leaves no wandb process behind."""
    while TRACKERS:
        name, tracker = TRACKERS.popitem()
        tracker.finish() if name == "wandb" else tracker.close()
