"""Sample from a model, as nanoGPT's sample.py does. --model=out scores the run's held-out set
greedily with grpo.evaluate, printing its last eval_accuracy again; --prompt="..." completes one
prompt; --temperature=0.7 --num_samples=4 samples. Any other --key=value is config.py's, parsed over
the run's saved config (an HF directory: the defaults), so a key means what it meant in training.
"""
import json
import os
import sys

import torch

import checkpoint
import config
import grpo
import lora

model = "out"  # a run's out_dir or ckpt/ (full or LoRA), or an HF model directory
prompt = ""  # one prompt, its completions printed; "" = the task's held-out set, each scored
temperature = 0.0  # 0 = greedy (the held-out eval's); > 0 samples (top_p as the run's)
num_samples = 1  # completions per prompt when sampling


def main(argv):
    defaults = dict(model=model, prompt=prompt, temperature=temperature, num_samples=num_samples)
    mine = [a for a in argv if a[2:].split("=", 1)[0] in defaults]
    opt = config.parse_config(mine, defaults)
    if opt.temperature < 0 or opt.num_samples < 1:
        raise ValueError(f"--temperature={opt.temperature}, --num_samples={opt.num_samples}: "
                         f"want >= 0 and >= 1")
    ckpt = os.path.join(opt.model, "ckpt")
    path = os.path.abspath(ckpt if os.path.isdir(ckpt) else opt.model)
    state, lora_json = (os.path.join(path, f) for f in ("trainer_state.pt", "adapter_config.json"))
    saved = {}
    if os.path.isfile(state):  # the run's config (mmap: the rest stays unread)
        saved = torch.load(state, weights_only=False, mmap=True)["config"]
    cfg = config.parse_config([a for a in argv if a not in mine],
                              {k: saved.get(k, getattr(config, k)) for k in config.CONFIG_KEYS})
    adapter = json.load(open(lora_json)) if os.path.isfile(lora_json) else {}
    cfg.model = adapter.get("base_model_name_or_path", path)  # LoRA: the base, then the adapters
    cfg.lora_r, cfg.resume = adapter.get("r", 0), False
    dev, dt = config.resolve(cfg)  # a bad flag or --model is refused here, before anything loads
    _, reward, eval_set = grpo.load_task(cfg.task, cfg.difficulty, cfg.eval_size, cfg.eval_file)
    reward_fn = grpo.make_reward(reward, cfg.reward, cfg.reward_weights)[0]
    tokenizer = checkpoint.load_tokenizer(path)
    policy = grpo.cast_parameters(checkpoint.load_model(cfg.model, dev), dt).eval()
    if adapter:  # float32 adapters on the dt base, as in training
        lora.add_lora(policy, adapter["r"], adapter["lora_alpha"], 0.0, adapter["target_modules"])
        lora.load_adapter(policy, path)
    torch.manual_seed(cfg.seed)
    if opt.temperature == 0 and not opt.prompt:  # the run's held-out eval itself, every row kept
        cfg.eval_pass_k, cfg.eval_samples = 0, len(eval_set)
        samples = grpo.evaluate(policy, tokenizer, eval_set, reward_fn, cfg, dev)["eval_samples"]
        rows = [(s["question"], s["completion"], s["reward"], s["correct"]) for s in samples]
    else:  # num_samples completions a prompt, prompt-major; a lone --prompt has nothing to score
        todo, n = [(opt.prompt, None)] if opt.prompt else eval_set, opt.num_samples
        ids, mask = grpo.encode_prompts(tokenizer, [q for q, _ in todo], cfg.max_prompt_len, dev)
        buf = grpo.generate(policy, ids, mask, n, opt.temperature, cfg.top_p, cfg, tokenizer)
        if opt.prompt:
            texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
            scored = [(None, None)] * len(texts)
        else:
            texts, scored = grpo.score(reward_fn, tokenizer, buf, todo, n)
        questions = [q for q, _ in todo for _ in range(n)]
        rows = [(q, text, r, ok) for q, text, (r, ok, *_) in zip(questions, texts, scored)]
    for q, text, r, ok in rows:
        verdict = "" if r is None else f"  reward {r:.2f}, {'correct' if ok else 'wrong'}"
        print(f"{q!r}\n  -> {text!r}{verdict}")
    if not opt.prompt:
        accuracy = sum(ok for *_, ok in rows) / len(rows)
        print(f"held-out accuracy {accuracy:.4f} ({len(rows)} completions, {path})")
    return dict(cfg=cfg, model=policy, rows=rows)


if __name__ == "__main__":
    main(sys.argv[1:])
