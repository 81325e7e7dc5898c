"""
Tasks and rewards. A task is two plain functions: make_prompts(n, seed, difficulty) returns
[(question, example)], reward(completion, example) returns (reward, correct). Built in: arithmetic,
countdown, datasets (jsonl:PATH, hf:NAME[:config]); swap TASKS[name] for your own. Also here: reward
plug-ins (per-completion or TRL's batched form), the held-out split, the training prompts.

The built-in verifiers read exactly one "The answer is X": 1.0 if X is right, 0.1 for the format
with a wrong X, else 0. A reply with several answers, or one cut off at max_completion_len, earns
nothing: otherwise the policy learns to write answer after answer until the length cap. They run on
whatever the policy writes, so they never raise and never eval (safe_eval walks the syntax tree).
Answer tags (<answer>X</answer>) are left out: small instruct models rarely write them.
"""
import ast
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import random
import re
import sys
import traceback
from fractions import Fraction
from types import SimpleNamespace

# An answer starts with "answer is". What follows is read by patterns that cannot backtrack for
# long: a reply of thousands of spaces or digits is read in linear time.
ANSWER_IS = re.compile(r"answer is", re.I)
EXPR_RE = re.compile(r"answer is:?([\d\s+\-*/()]*\d[\d\s+\-*/()]*)", re.I)
TEXT_RE = re.compile(r"answer is:?\s*([^\n]*)", re.I)  # the rest of the line (dataset answers)
MAX_DIGITS = 20  # longest number a reward reads; no task asks for more
MAX_EXPR_CHARS = 200  # longest expression safe_eval reads, well above any countdown answer
MAX_DEPTH = 32  # deepest nesting of operators, parentheses and unary signs
MAX_ABS = 10**15  # largest |numerator| or denominator of any value: bounds each step's cost
BIN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def only_answer(completion, pattern):
    """pattern's matched group (the first of its alternatives that matched) at the reply's one
    "answer is"; None if it has none, or several"""
    if len(ANSWER_IS.findall(completion)) != 1:
        return None
    found = pattern.search(completion)
    return next((g for g in found.groups() if g is not None), None) if found else None


def parse_int(s):
    """int of digits, commas and a leading minus; None past MAX_DIGITS digits or on junk"""
    s = s.replace(",", "")
    if not 0 < len(s.lstrip("-")) <= MAX_DIGITS:
        return None
    try:
        return int(s)
    except ValueError:
        return None


def _value(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        v = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand, depth + 1)
        v = -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.BinOp) and type(node.op) in BIN_OPS:
        v = BIN_OPS[type(node.op)](_value(node.left, depth + 1), _value(node.right, depth + 1))
    else:  # **, //, %, names, calls, floats, ...
        raise ValueError(f"{type(node).__name__} is not allowed")
    if abs(v.numerator) > MAX_ABS or v.denominator > MAX_ABS:
        raise ValueError("too large")
    return v


def safe_eval(expr):
    """the exact value (a Fraction) of integers combined with + - * / and parentheses; None for
    anything else, a division by zero, or past MAX_EXPR_CHARS / MAX_DEPTH / MAX_ABS. Never raises,
    where eval recurses too deep on a run of minus signs and never returns on 9**9**9."""
    if len(expr) > MAX_EXPR_CHARS:
        return None
    try:
        return _value(ast.parse(expr.strip(), mode="eval").body, 0)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError, OverflowError):
        return None


# The answer line holds the equation: "The answer is 2 - 5 = -3". A small model then writes the
# operands right before the result, and copies the example's minus sign; asked for the number
# alone (or for the equation before the answer), it drops the equation and guesses the sign.
ARITHMETIC_FORMAT = ("End your reply with the equation and its result: The answer is EQUATION = "
                     "NUMBER. For example, for 2 - 5: The answer is 2 - 5 = -3.")
# the number after the answer's equation, else a number right after "answer is" that no operator
# follows ("The answer is 3 + 4 =" has no result, not the result 3); 60: two MAX_DIGITS operands
RESULT_RE = re.compile(r"answer is:?[\d\s+\-*/()]{0,60}=\s*(-?\d[\d,]*)"
                       r"|answer is:?\s*(-?\d[\d,]*)(?![\d,]|\s*[+\-*/=])", re.I)


def arithmetic_prompts(n, seed, difficulty):
    """a + b or a - b with `difficulty`-digit operands; the example is the integer answer"""
    rng, out, hi = random.Random(seed), [], 10 ** difficulty - 1
    for _ in range(n):
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice("+-")
        q = f"What is {a} {op} {b}? {ARITHMETIC_FORMAT}"
        out.append((q, a + b if op == "+" else a - b))
    return out


def arithmetic_reward(completion, target):
    found = only_answer(completion, RESULT_RE)
    answer = parse_int(found) if found else None
    if answer is None:  # no single answer, or not a number we read: no format credit either
        return 0.0, False
    return (1.0, True) if answer == target else (0.1, False)


def countdown_prompts(n, seed, difficulty):
    """difficulty + 1 numbers in 1..20 and a target reachable with + - * using each number once (it
    is built that way). A draw is kept only if its target is in 1..200, which gets rarer with every
    number: MAX_DIFFICULTY bounds it. The example is (sorted numbers, target)."""
    rng, out, tries = random.Random(seed), [], 0
    while len(out) < n:
        tries += 1
        if tries > 1000 + 100 * n:
            raise ValueError(f"countdown_prompts: {len(out)} of {n} prompts in {tries - 1} draws: "
                             f"use difficulty <= {MAX_DIFFICULTY['countdown']}, not {difficulty}")
        nums = [rng.randint(1, 20) for _ in range(difficulty + 1)]
        order = rng.sample(nums, len(nums))
        target = order[0]
        for x in order[1:]:  # ((a op b) op c) ...
            op = rng.choice("+-*")
            target = target + x if op == "+" else target - x if op == "-" else target * x
        if 0 < target <= 200:
            q = (f"Using the numbers {nums}, each exactly once, and + - * / ( ), write an "
                 f"expression equal to {target}. End your reply with: The answer is EXPRESSION.")
            out.append((q, (tuple(sorted(nums)), target)))
    return out


def countdown_reward(completion, target):
    nums, value = target
    found = only_answer(completion, EXPR_RE)
    expr = found.strip() if found else ""
    got = safe_eval(expr) if found else None
    if got is None:  # no single answer, or none we evaluate: no format credit either
        return 0.0, False
    # safe_eval took every literal, so each one is short
    used = tuple(sorted(parse_int(x) for x in re.findall(r"\d+", expr)))
    return (1.0, True) if used == nums and got == value else (0.1, False)


# Dataset tasks: jsonl:PATH (one JSON object a line) and hf:NAME[:config] (through `datasets`) -----
QUESTION_KEYS = ("question", "prompt", "problem")  # the first one a row has is its question
ANSWER_KEYS = ("answer", "solution", "target")


def dataset_answer(example):
    """a row's reference answer: GSM8K's "...reasoning...\n#### 1,234" -> "1234", else the field"""
    a = str(next(example[k] for k in ANSWER_KEYS if k in example))
    a = a.rsplit("####", 1)[-1]  # GSM8K's final answer, or the whole field
    return a.strip().replace(",", "") if re.fullmatch(r"\s*-?[\d,]*\.?\d+\s*", a) else a.strip()


def same_answer(got, want):
    """numbers compare by exact value ("3.50" == "3.5", "$1,234" == "1234"), text case-folded"""
    def num(x):
        x = x.replace(",", "").replace("$", "").strip()
        if not re.fullmatch(r"-?\d*\.?\d+", x) or len(x) > MAX_DIGITS + 2:
            return None
        return Fraction(x)
    a, b = num(got), num(want)
    if a is not None and b is not None:
        return a == b
    return got.strip().casefold() == want.strip().casefold()


def dataset_reward(completion, example):
    """arithmetic's rule on the line after the one "The answer is", less a final period"""
    found = only_answer(completion, TEXT_RE)
    got = (found or "").strip().removesuffix(".").rstrip()
    if not got:
        return 0.0, False
    return (1.0, True) if same_answer(got, dataset_answer(example)) else (0.1, False)


def dataset_question(example):
    q = next(example[k] for k in QUESTION_KEYS if k in example)
    return f"{q}\nEnd your reply with: The answer is ANSWER."


def read_rows(spec, split="train"):
    """the rows of [jsonl:]PATH or hf:NAME[:config]; a ValueError names a bad line or field"""
    if not spec.startswith("hf:"):
        path, rows = spec.removeprefix("jsonl:"), []
        with open(os.path.expanduser(path)) as f:
            lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
        for i, line in lines:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not JSON ({e})") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path} line {i}: want an object, got {type(rows[-1]).__name__}")
    else:  # hf:NAME[:config]; only this needs `datasets` (check_task said so if it is missing)
        import datasets
        name, _, config = spec[3:].partition(":")
        rows = list(datasets.load_dataset(name, config or None, split=split))
    for i, r in enumerate(rows, 1):
        if not any(k in r for k in QUESTION_KEYS) or not any(k in r for k in ANSWER_KEYS):
            raise ValueError(f"{spec} row {i} has no question ({'/'.join(QUESTION_KEYS)}) or no "
                             f"answer ({'/'.join(ANSWER_KEYS)}) field: it has {sorted(r)[:10]}")
        if not isinstance(next(r[k] for k in QUESTION_KEYS if k in r), (str, int, float)):
            raise ValueError(f"{spec} row {i}: its question is not text (chat messages, TRL's "
                             f"conversational form?): give the question as a string")
    if not rows:
        raise ValueError(f"{spec}: no rows")
    return rows


def dataset_task(spec, eval_size, eval_file=""):
    """(make_prompts, eval_set): held out are eval_file's first eval_size rows (hf: "test" split),
    else eval_size rows drawn with EVAL_SEED (any --seed); training samples the rest, replaced"""
    rows = read_rows(spec)
    if eval_file:
        held, train = read_rows(eval_file, split="test")[:eval_size], rows
    else:
        if len(rows) <= eval_size:
            raise ValueError(f"{spec} has {len(rows)} rows: --eval_size={eval_size} would hold out "
                             f"all of them (lower --eval_size, or give --eval_file)")
        order = list(range(len(rows)))
        random.Random(EVAL_SEED).shuffle(order)
        held, train = [rows[i] for i in order[:eval_size]], [rows[i] for i in order[eval_size:]]

    def make_prompts(n, seed, difficulty):  # a dataset has no difficulty
        rng = random.Random(seed)
        return [(dataset_question(r), r) for r in (rng.choice(train) for _ in range(n))]
    make_prompts.questions = [dataset_question(r) for r in train]  # (check_prompt_lengths')
    return make_prompts, [(dataset_question(r), r) for r in held]


TASKS = {"arithmetic": (arithmetic_prompts, arithmetic_reward),
         "countdown": (countdown_prompts, countdown_reward)}
# the largest difficulty each generator samples quickly (arithmetic: answers within MAX_DIGITS)
MAX_DIFFICULTY = {"arithmetic": 18, "countdown": 10}
# make_reward scores a truncated reply (0.0, False) with these; your own rewards see every reply
VERIFIERS = (arithmetic_reward, countdown_reward, dataset_reward)


# What the trainer does with any task: the held-out split, the training prompts, the rewards -------
EVAL_SEED = 10**9 + 7  # the held-out set's seed, one no training step uses (see step_seed)
FILE_MODULES = {}  # real path -> module: a file's code runs once, though the config check loads it


def step_seed(seed, step, draw=0):
    """the prompt seed of a step's draw (dynamic sampling draws again): unique per (step, draw),
    never EVAL_SEED, a function of the seed alone: a resumed run draws what an unbroken one would"""
    return seed * 100_003 + step + draw * 7_919_000_003


def prompt_text(tokenizer, question):
    """a question as the model's chat template writes a user's turn, the reply to follow"""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def check_prompt_lengths(tokenizer, make_prompts, eval_set, max_prompt_len):
    """refuse, before the model loads, a held-out question or dataset row whose prompt has more
    than max_prompt_len tokens (met mid-run it would stop the run, and each resume, at its step)"""
    questions = dict.fromkeys([q for q, _ in eval_set] + getattr(make_prompts, "questions", []))
    ids = tokenizer([prompt_text(tokenizer, q) for q in questions], add_special_tokens=False)
    long = [len(x) for x in ids.input_ids if len(x) > max_prompt_len]
    if long:
        raise ValueError(f"{len(long)} of the {len(questions)} prompts exceed max_prompt_len="
                         f"{max_prompt_len} tokens (up to {max(long)}): raise --max_prompt_len")


def encode_prompts(tokenizer, questions, max_prompt_len, dev):
    """chat template, then left padding -> ids and mask, both (B, P)"""
    texts = [prompt_text(tokenizer, q) for q in questions]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    if enc.input_ids.shape[1] > max_prompt_len:
        raise ValueError(f"a prompt has {enc.input_ids.shape[1]} tokens, more than "
                         f"max_prompt_len={max_prompt_len}: raise --max_prompt_len")
    return enc.input_ids.to(dev), enc.attention_mask.to(dev)


def score(reward_fn, tokenizer, buf, pairs, n):
    """score buf's completions. Rows are prompt-major: row i answers pairs[i // n] = (question,
    example). A row's token ids are cut at its length, the EOS included (TRL's count); a row with no
    EOS is truncated. Returns (texts, [(total, correct, [each reward])])."""
    texts = tokenizer.batch_decode(buf["completion_ids"], skip_special_tokens=True)
    lengths = buf["completion_mask"].sum(1).tolist()
    ids = [row[:L] for row, L in zip(buf["completion_ids"].tolist(), lengths)]
    rows = [pairs[i // n] for i in range(len(texts))]
    questions, examples = [q for q, _ in rows], [e for _, e in rows]
    return texts, reward_fn(questions, texts, examples, ids, buf["truncated"].tolist())


def check_task(task, eval_file=""):
    """the errors (strings) of a --task or --eval_file that cannot load, before anything loads"""
    errors, specs = [], [("task", task)]
    if eval_file and not eval_file.startswith("hf:"):  # a bare path is a jsonl file
        specs.append(("eval_file", "jsonl:" + eval_file.removeprefix("jsonl:")))
    for flag, spec in specs:
        if spec.startswith("jsonl:") and not os.path.isfile(os.path.expanduser(spec[6:])):
            errors.append(f"--{flag}={spec!r}: no such file")
        elif spec.startswith("hf:") and importlib.util.find_spec("datasets") is None:
            errors.append(f"--{flag}={spec!r} needs `pip install datasets`; offline, export the "
                          f"rows to a file and use --task=jsonl:PATH")
        elif spec not in TASKS and not spec.startswith(("jsonl:", "hf:")):
            errors.append(f"--{flag}={spec!r}: use one of {', '.join(TASKS)}, jsonl:PATH or "
                          f"hf:NAME[:config]")
    if eval_file and task in TASKS:
        errors.append(f"--eval_file={eval_file!r}: only a dataset task (jsonl:/hf:) takes one")
    return errors


def load_task(task, difficulty, eval_size, eval_file=""):
    """(make_prompts, the task's own reward, held-out set [(question, example)])"""
    if task in TASKS:
        make_prompts, reward = TASKS[task]
        return make_prompts, reward, held_out_set(make_prompts, eval_size, difficulty)
    make_prompts, eval_set = dataset_task(task, eval_size, eval_file)
    return make_prompts, dataset_reward, eval_set


def held_out_set(make_prompts, n, difficulty):
    """n distinct questions, which training never sees (a small difficulty has few questions)"""
    out = {}  # question -> its example, the first drawn
    for q, t in make_prompts(50 * n, EVAL_SEED, difficulty):
        out.setdefault(q, t)
        if len(out) == n:
            return list(out.items())
    raise ValueError(f"--eval_size={n}: only {len(out)} distinct questions at "
                     f"difficulty={difficulty}: lower --eval_size or raise --difficulty")


def check_training_pool(make_prompts, seed, difficulty, exclude):
    """refuse, before anything loads, a held-out set that leaves training too few questions"""
    free = sum(q not in exclude for q, _ in make_prompts(1000, seed, difficulty))
    if free < 20:
        raise ValueError(f"--eval_size={len(exclude)} leaves only {free} of 1000 questions drawn "
                         f"at difficulty={difficulty}: lower --eval_size or raise --difficulty")


def train_prompts(make_prompts, n, seed, difficulty, exclude):
    """one step's n questions: the first n outside the held-out set in make_prompts(4n, seed), then
    in more rounds if that runs dry (check_training_pool bounds them); a function of the seed"""
    out = []
    for r in range(1000):
        drawn = make_prompts(4 * n, seed if r == 0 else seed * 1_000_003 + r, difficulty)
        out += [p for p in drawn if p[0] not in exclude]
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"the held-out set leaves too few training questions at "
                     f"difficulty={difficulty}: lower --eval_size")


def load_reward(spec):
    """a reward function from "module:function" (imported like any module, with the current
    directory on the path) or "path/to/file.py:function", in either form (see guard_reward)"""
    mod, sep, fn = spec.rpartition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"--reward={spec!r}: use module:function or path/file.py:function")
    if mod.endswith(".py"):
        path = os.path.realpath(os.path.expanduser(mod))
        s = importlib.util.spec_from_file_location(os.path.basename(mod)[:-3], path)
        if s is None or not os.path.isfile(path):
            raise ValueError(f"--reward={spec!r}: no file {mod}")
        if path not in FILE_MODULES:  # kept once its code ran through: one that raised raises again
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
            FILE_MODULES[path] = module
        module = FILE_MODULES[path]
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"--reward={spec!r}: cannot import {mod} ({e})") from None
    f = getattr(module, fn, None)
    if not callable(f):
        raise ValueError(f"--reward={spec!r}: {mod} has no function {fn}")
    return f


def reward_names(spec):
    """the log's name of each reward: "task" or the function's name (logged as reward/<name>)"""
    return [s.strip().rpartition(":")[2] for s in spec.split(",")] if spec else ["task"]


def parse_weights(spec, n):
    """--reward_weights="1,0.2" -> [1.0, 0.2]; "" -> all 1"""
    w = [float(x) for x in spec.split(",")] if spec else [1.0] * n
    if len(w) != n or not all(math.isfinite(x) for x in w):
        raise ValueError(f"--reward_weights={spec!r}: want {n} finite numbers, one per --reward")
    return w


def make_reward(task_reward, spec="", weights=""):
    """(reward_fn, counts) of --reward / --reward_weights: reward_fn(questions, completions,
    examples, completion_ids, truncated) -> [(total, correct, [each reward])], total = sum_i w_i r_i
    over the rewards that scored the row (TRL's nansum), correct the first one a reward reports.
    A built-in verifier scores a truncated row (no EOS by max_completion_len) (0.0, False)."""
    specs = [s.strip() for s in spec.split(",")] if spec else ["task"]
    w = parse_weights(weights, len(specs))
    counts = {"errors": 0, "metrics": {}, "state": SimpleNamespace(global_step=0, max_steps=0)}
    fns = [guard_reward(task_reward if s == "task" else load_reward(s), counts) for s in specs]
    refuses_truncated = [s == "task" and task_reward in VERIFIERS for s in specs]

    def reward_fn(questions, completions, examples, completion_ids, truncated):
        columns = []  # a list of (r, correct) per reward, one entry a row
        for fn, refuses in zip(fns, refuses_truncated):
            scored = fn(questions, completions, examples, completion_ids)
            if refuses:
                scored = [(0.0, False) if cut else s
                          for s, cut in zip(scored, truncated, strict=True)]
            columns.append(scored)
        out = []
        for parts in zip(*columns):  # one row: a (r, correct) per reward
            total = sum(wi * r for wi, (r, _) in zip(w, parts) if not math.isnan(r))
            correct = next((ok for _, ok in parts if ok is not None), False)
            out.append((total, bool(correct), [r for r, _ in parts]))
        return out
    return reward_fn, counts


def overlong_penalty(length, max_completion_len, soft_punish_cache, factor=1.0):
    """DAPO's soft overlong punishment (Eq. 13; TRL's get_soft_overlong_punishment), added to the
    reward, with L_max = max_completion_len and L_cache = soft_punish_cache:
        0                                                  if length <= L_max - L_cache
        factor * ((L_max - L_cache) - length) / L_cache    in the buffer: linear, -factor at L_max
    L_cache = 0 turns it off. length is in tokens, the EOS included."""
    if soft_punish_cache <= 0:
        return 0.0
    start = max_completion_len - soft_punish_cache
    return factor * max(-1.0, min(0.0, (start - length) / soft_punish_cache))


def guard_reward(reward_fn, counts):
    """reward_fn in either form (README) as safe(questions, completions, examples, completion_ids)
    -> [(r, correct)]; the per-completion form gets completion_ids if it asks; batched None is NaN.
    A call that raises or returns a non-finite reward scores (0.0, False) on each of its rows,
    counted in counts["errors"], the first traceback printed: a bad completion costs only itself."""
    sig = inspect.signature(reward_fn).parameters if reward_fn else {}  # the config check's None
    params = ["**" if p.kind is p.VAR_KEYWORD else name for name, p in sig.items()]
    batched = params[:1] in (["prompts"], ["completions"], ["completion_ids"], ["**"])
    wants_ids = "completion_ids" in params or "**" in params

    def failed(n):
        counts["errors"] += n
        if counts["errors"] == n:
            print(f"a reward failed on a completion, which scores 0 (later failures are only "
                  f"counted, as reward_errors):\n{traceback.format_exc()}", file=sys.stderr)
        return [(0.0, False)] * n

    def one(completion, example, ids):
        try:
            out = reward_fn(completion, example, **({"completion_ids": ids} if wants_ids else {}))
            r, ok = out if isinstance(out, tuple) else (out, None)
            if not math.isfinite(float(r)):
                raise ValueError(f"reward {r} is not finite")
            return float(r), None if ok is None else bool(ok)
        except Exception:  # noqa: BLE001 - the reward's failure is the completion's, not the run's
            return failed(1)[0]

    def log_metric(name, value):
        counts["metrics"].setdefault(name, []).append(float(value))

    def call_batched(questions, completions, examples, completion_ids):
        # TRL passes each dataset column as a list; a built-in task's example is column `answer`
        rows = [e if isinstance(e, dict) else {"answer": e} for e in examples]
        columns = {k: [r.get(k) for r in rows] for k in rows[0]
                   if k not in ("prompt", "completion", "completion_ids")}
        out = reward_fn(prompts=[[{"role": "user", "content": q}] for q in questions],
                        completions=[[{"role": "assistant", "content": c}] for c in completions],
                        completion_ids=completion_ids, trainer_state=counts["state"],
                        log_extra=lambda column, values: None, log_metric=log_metric, **columns)
        out = [math.nan if r is None else float(r) for r in out]
        if any(math.isinf(r) for r in out):
            raise ValueError(f"a reward is not finite: {out}")
        return out

    def safe(questions, completions, examples, completion_ids):
        if not batched:
            return [one(*row) for row in zip(completions, examples, completion_ids)]
        try:
            out = call_batched(questions, completions, examples, completion_ids)
        except Exception:  # noqa: BLE001 - as above, for every row of the call
            return failed(len(completions))
        if len(out) != len(completions):  # a bug of the function, not a completion's failure
            name = getattr(reward_fn, "__name__", reward_fn)
            raise ValueError(f"reward {name!r} returned {len(out)} rewards for {len(completions)} "
                             f"completions: want one per completion")
        return [(r, None) for r in out]
    return safe
