"""
Sample from a model, as nanoGPT's sample.py. --model=out (a run's out_dir or ckpt/; LoRA: the base it names, adapted)
scores the run's held-out set greedily as grpo.evaluate did: its last eval_accuracy again; --prompt="..." completes
one prompt; --temperature=0.7 --num_samples=4 samples. The globals below are this script's; any other --key=value is
config.py's, through its parser and checks over the run's saved config (an HF directory: the defaults): one parser,
so a key means here what it means in training.
"""
import json
import os
import sys

import torch

import checkpoint
import config
import grpo
import lora
from batching import rollout

model = "out"  # a run's out_dir or ckpt/ (full or LoRA), or an HF model directory
prompt = ""  # one prompt, its completions printed; "" = the task's held-out set, each completion scored
temperature = 0.0  # 0 = greedy (the held-out eval's); > 0 samples (top_p as the run's)
num_samples = 1  # completions per prompt when sampling


def main(argv):
    mine = [a for a in argv if a[2:].split("=", 1)[0] in ("model", "prompt", "temperature", "num_samples")]
    opt = config.parse_config(mine, dict(model=model, prompt=prompt, temperature=temperature, num_samples=num_samples))
    if opt.temperature < 0 or opt.num_samples < 1:
        raise ValueError(f"--temperature={opt.temperature}, --num_samples={opt.num_samples}: want >= 0 and >= 1")
    path = os.path.abspath(os.path.join(opt.model, "ckpt") if os.path.isdir(f"{opt.model}/ckpt") else opt.model)
    state, lora_json = os.path.join(path, "trainer_state.pt"), os.path.join(path, "adapter_config.json")
    saved = torch.load(state, weights_only=False, mmap=True)["config"] if os.path.isfile(state) else {}  # (mmap: lazy)
    cfg = config.parse_config([a for a in argv if a not in mine],
                              {k: saved.get(k, getattr(config, k)) for k in config.CONFIG_KEYS})
    adapter = json.load(open(lora_json)) if os.path.isfile(lora_json) else {}  # then: what loads; resume off
    cfg.model, cfg.lora_r, cfg.resume = adapter.get("base_model_name_or_path", path), adapter.get("r", 0), False
    dev, dt = config.resolve(cfg)  # a bad flag, a --model with no model (LoRA: peft?): said before anything loads
    task_reward, eval_set = grpo.load_task(cfg.task, cfg.difficulty, cfg.eval_size, cfg.eval_file)[1:]
    reward_fn = grpo.make_reward(task_reward, cfg.reward, cfg.reward_weights)[0]
    tokenizer = checkpoint.load_tokenizer(path)
    policy = grpo.cast_parameters(checkpoint.load_model(cfg.model, dev), dt).eval()  # as the run ran it
    if adapter:  # float32 adapters on the dt base, as in training
        lora.add_lora(policy, adapter["r"], adapter["lora_alpha"], 0.0, adapter["target_modules"])
        lora.load_adapter(policy, path)
    torch.manual_seed(cfg.seed)
    if opt.temperature == 0 and not opt.prompt:  # the run's held-out eval itself, every completion kept
        cfg.eval_pass_k, cfg.eval_samples = 0, len(eval_set)
        rows = [(s["question"], s["completion"], s["reward"], s["correct"])
                for s in grpo.evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)["eval_samples"]]
    else:  # num_samples completions a prompt, prompt-major
        todo, n = [(opt.prompt, None)] if opt.prompt else eval_set, opt.num_samples
        ids, mask = grpo.encode_prompts(tokenizer, [q for q, _ in todo], cfg.max_prompt_len, dev)
        buf = rollout(policy, ids, mask, n, cfg.max_completion_len, opt.temperature, cfg.top_p,
                      grpo.stop_token_ids(policy, tokenizer), tokenizer.pad_token_id, cfg.compile)
        texts, scored = ((tokenizer.batch_decode(buf["completion_ids"], True), None) if opt.prompt else
                         grpo.score(reward_fn, tokenizer, buf, todo, n))  # (a lone prompt has no example to score)
        rows = [(todo[i // n][0], t, *(scored[i][:2] if scored else (None, None))) for i, t in enumerate(texts)]
    for q, text, r, ok in rows:
        print(f"{q!r}\n  -> {text!r}" + ("" if r is None else f"  reward {r:.2f}, {'correct' if ok else 'wrong'}"))
    if not opt.prompt:
        print(f"held-out accuracy {sum(ok for *_, ok in rows) / len(rows):.4f} ({len(rows)} completions, {path})")
    return dict(cfg=cfg, model=policy, rows=rows)


if __name__ == "__main__":
    main(sys.argv[1:])
