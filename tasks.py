"""
nanoGRPO's tasks: make_prompts(n, seed, difficulty) -> [(question, example)], reward(completion, example) ->
(reward, correct); plain functions: swap TASKS[name] for your own (the example: README). Imports nothing of the project.
The answer is the last "The answer is X": correct 1.0, the format with a wrong X 0.1, else 0. Read anywhere, not only at
the end: the policy then repeats its answer block to max_completion_len, but read only at the reply's end it dropped the
equation (held-out accuracy stayed at 0.70). SmolLM2-135M-Instruct half-follows the format (75%, correct 19%: greedy,
1-digit, before ARITHMETIC_FORMAT's example) but never wrote <answer>X</answer>, even if told to: tags give no signal.

A reward must be safe on any string: parse_int reads numbers (bounded: int() of a 4,300+ digit string raises), safe_eval
expressions (never eval: 60 unary minus signs raised RecursionError, 9**9**9 never returns).
"""
import ast
import importlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import sys
import traceback
from fractions import Fraction
from types import SimpleNamespace

NUMBER_RE = re.compile(r"answer is:?\s*(-?\d[\d,]*)", re.I)
EXPR_RE = re.compile(r"answer is:?\s*([\d\s+\-*/()]*\d[\d\s+\-*/()]*)", re.I)
MAX_DIGITS = 20  # longest number a reward reads; no task asks for more
MAX_EXPR_CHARS = 200  # longest expression safe_eval reads (a countdown answer at difficulty 10 is ~60)
MAX_DEPTH = 32  # deepest nesting of operators / parentheses / unary signs
MAX_ABS = 10**15  # largest |numerator| or denominator of any intermediate value


def parse_int(s):
    """int of a digit string with optional commas and leading minus; None past MAX_DIGITS digits or on junk"""
    s = s.replace(",", "")
    if not 0 < len(s.lstrip("-")) <= MAX_DIGITS:
        return None
    try:
        return int(s)
    except ValueError:  # (a non-ASCII digit that int() does not take)
        return None


def _value(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        v = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand, depth + 1)
        v = -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _value(node.left, depth + 1), _value(node.right, depth + 1)
        op = type(node.op)
        v = a + b if op is ast.Add else a - b if op is ast.Sub else a * b if op is ast.Mult else a / b
    else:
        raise ValueError(f"{type(node).__name__} is not allowed")  # **, //, %, names, calls, floats, ...
    if abs(v.numerator) > MAX_ABS or v.denominator > MAX_ABS:  # bounds every later step's cost
        raise ValueError("too large")
    return v


def safe_eval(expr):
    """exact value (a Fraction) of integer literals combined with + - * / and parentheses; None for anything else,
    a division by zero, or past MAX_EXPR_CHARS / MAX_DEPTH / MAX_ABS. Never raises."""
    if len(expr) > MAX_EXPR_CHARS:
        return None
    try:
        return _value(ast.parse(expr.strip(), mode="eval").body, 0)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError, OverflowError):
        return None


# The format line asks for the equation before the answer and shows a negative one. Asked only for "The answer is
# NUMBER.", SmolLM2-135M-Instruct wrote no negative number (0 of 256 samples right on the 23% of 1-digit questions with
# a negative answer: no gradient there, runs sat under 0.77); a shown "-3" is only copied. Runs that broke through wrote
# the equation first ("1 - 6 = -5. The answer is -5.": the operands right before the digit to produce). With this line
# held-out greedy hit 0.90 in under 5 minutes in 9 of 10 default seeds, against 2 of 28 runs with an example-only line.
ARITHMETIC_FORMAT = ("Write the equation with its result, then end your reply with: The answer is NUMBER. "
                     "For example, for 2 - 5: 2 - 5 = -3. The answer is -3.")


def arithmetic_prompts(n, seed, difficulty):
    """a + b or a - b with `difficulty`-digit operands"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hi = 10 ** difficulty - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice("+-")
        q = f"What is {a} {op} {b}? {ARITHMETIC_FORMAT}"
        out.append((q, a + b if op == "+" else a - b))
    return out


def arithmetic_reward(completion, target):
    found = NUMBER_RE.findall(completion)
    answer = parse_int(found[-1]) if found else None
    if answer is None:
        return 0.0, False  # no answer, or not a number we read (over MAX_DIGITS digits): no format credit either
    correct = answer == target
    return (1.0 if correct else 0.1), correct


def countdown_prompts(n, seed, difficulty):
    """difficulty + 1 numbers in 1..20 and a target reachable with + - * (each number used once; built so it is). A draw
    is kept if its target is in 1..200, rarer with each number (77% at difficulty 1, 7% at 10, 0.005% at 30)."""
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 1000 + 100 * n:
            raise ValueError(f"countdown_prompts: only {len(out)} of {n} prompts in {tries - 1} draws at difficulty="
                             f"{difficulty} (a target in 1..200 gets rarer with every number): use difficulty <= "
                             f"{MAX_DIFFICULTY['countdown']}")
        nums = [rng.randint(1, 20) for _ in range(difficulty + 1)]
        order = rng.sample(nums, len(nums))
        expr, target = str(order[0]), order[0]
        for x in order[1:]:
            op = rng.choice("+-*")
            expr = f"({expr} {op} {x})"
            target = target + x if op == "+" else target - x if op == "-" else target * x
        if 0 < target <= 200:
            q = (f"Using the numbers {nums}, each exactly once, and + - * / ( ), write an expression equal to "
                 f"{target}. End your reply with: The answer is EXPRESSION.")
            out.append((q, (tuple(sorted(nums)), target)))
    return out


def countdown_reward(completion, target):
    nums, value = target
    found = EXPR_RE.findall(completion)
    expr = found[-1].strip() if found else ""
    got = safe_eval(expr) if found else None
    if got is None:
        return 0.0, False  # no answer, or none we evaluate (syntax, **, past the limits): no format credit either
    used = tuple(sorted(parse_int(x) for x in re.findall(r"\d+", expr)))  # (short: safe_eval took every literal)
    correct = used == nums and got == value
    return (1.0 if correct else 0.1), correct


# ------------------------------------------------------------------------------------------------------------------
# dataset tasks: jsonl:PATH (one JSON object a line) and hf:NAME[:config] (through `datasets`, when installed)
QUESTION_KEYS = ("question", "prompt", "problem")  # the first one a row has is its question
ANSWER_KEYS = ("answer", "solution", "target")
ANSWER_RE = re.compile(r"answer is:?\s*(.+?)\s*\.?\s*$", re.I | re.M)  # the text after the last "answer is"


def dataset_answer(example):
    """the reference answer of a row: GSM8K's "...reasoning...\n#### 1,234" -> "1234"; else the field as text"""
    a = str(next(example[k] for k in ANSWER_KEYS if k in example))
    if "####" in a:
        a = a.rsplit("####", 1)[1]
    return a.strip().replace(",", "") if re.fullmatch(r"\s*-?[\d,]*\.?\d+\s*", a) else a.strip()


def same_answer(got, want):
    """numbers compare by value (exactly, as fractions: "3.50" == "3.5", "$1,234" == "1234"), else case-folded text"""
    def num(x):
        x = x.replace(",", "").replace("$", "").strip()
        if not re.fullmatch(r"-?\d*\.?\d+", x) or len(x) > MAX_DIGITS + 2:
            return None
        return Fraction(x)
    a, b = num(got), num(want)
    return a == b if a is not None and b is not None else got.strip().casefold() == want.strip().casefold()


def dataset_reward(completion, example):
    """the same rule as arithmetic: the last "The answer is X"; correct 1.0, the format with a wrong X 0.1, else 0"""
    found = ANSWER_RE.findall(completion[-2000:])
    if not found:
        return 0.0, False
    correct = same_answer(found[-1], dataset_answer(example))
    return (1.0 if correct else 0.1), correct


def dataset_question(example):
    q = next(example[k] for k in QUESTION_KEYS if k in example)
    return f"{q}\nEnd your reply with: The answer is ANSWER."


def read_rows(spec, split="train"):
    """the rows (dicts) of jsonl:PATH or hf:NAME[:config]; ValueError naming the line or field that is wrong"""
    if spec.startswith("jsonl:"):
        path, rows = spec[6:], []
        with open(os.path.expanduser(path)) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {i} is not JSON ({e})") from None
                    if not isinstance(rows[-1], dict):
                        raise ValueError(f"{path} line {i}: want a JSON object, got {type(rows[-1]).__name__}")
    else:  # hf:NAME[:config]
        import datasets  # optional: only an hf: task needs it (check_task said so if it is missing)
        name, _, config = spec[3:].partition(":")
        rows = list(datasets.load_dataset(name, config or None, split=split))
    for i, r in enumerate(rows, 1):
        if not any(k in r for k in QUESTION_KEYS) or not any(k in r for k in ANSWER_KEYS):
            raise ValueError(f"{spec} row {i} has no question ({'/'.join(QUESTION_KEYS)}) or no answer "
                             f"({'/'.join(ANSWER_KEYS)}) field: it has {sorted(r)[:10]}")
    if not rows:
        raise ValueError(f"{spec}: no rows")
    return rows


def dataset_task(spec, eval_size, eval_file=""):
    """(make_prompts, eval_set): held out are eval_file's first eval_size rows (hf: "test" split), else eval_size rows
    drawn with EVAL_SEED (the same for any --seed: runs compare); training samples the rest with replacement"""
    rows = read_rows(spec)
    if eval_file:
        held = read_rows(eval_file if eval_file.startswith(("jsonl:", "hf:")) else "jsonl:" + eval_file,
                         split="test")[:eval_size]
        train = rows
    else:
        if len(rows) <= eval_size:
            raise ValueError(f"{spec} has {len(rows)} rows: --eval_size={eval_size} would hold out all of them "
                             f"(lower --eval_size, or give --eval_file)")
        order = list(range(len(rows)))
        random.Random(EVAL_SEED).shuffle(order)
        held, train = [rows[i] for i in order[:eval_size]], [rows[i] for i in order[eval_size:]]

    def make_prompts(n, seed, difficulty):  # (difficulty: a dataset has none)
        rng = random.Random(seed)
        return [(dataset_question(r), r) for r in (rng.choice(train) for _ in range(n))]
    return make_prompts, [(dataset_question(r), r) for r in held]


TASKS = {"arithmetic": (arithmetic_prompts, arithmetic_reward), "countdown": (countdown_prompts, countdown_reward)}
# the largest difficulty each generator samples in reasonable time (arithmetic: answers within MAX_DIGITS digits)
MAX_DIFFICULTY = {"arithmetic": 18, "countdown": 10}


# ------------------------------------------------------------------------------------------------------------------
# what the trainer does with any task: the held-out split, the training prompt stream, the reward guard
EVAL_SEED = 10**9 + 7  # held-out set: a seed no training step uses (see step_seed)


def step_seed(seed, step, draw=0):
    """the prompt seed of step `step`'s draw `draw` (dynamic sampling draws again): unique per (step, draw), never
    EVAL_SEED, a function of the config's seed alone, so a resumed run draws what an unbroken one would"""
    return seed * 100_003 + step + draw * 7_919_000_003


def check_task(task, eval_file=""):
    """errors (a list of strings) for a --task / --eval_file that cannot load, said before anything else loads"""
    errors = []
    for flag, spec in (("task", task), ("eval_file", eval_file)):
        if flag == "eval_file" and (not spec or spec.startswith("hf:")):
            continue
        if flag == "eval_file" and not spec.startswith("jsonl:"):
            spec = "jsonl:" + spec
        if spec in TASKS:
            continue
        if spec.startswith("jsonl:"):
            if not os.path.isfile(os.path.expanduser(spec[6:])):
                errors.append(f"--{flag}={spec!r}: no such file")
        elif spec.startswith("hf:"):
            if importlib.util.find_spec("datasets") is None:
                errors.append(f"--{flag}={spec!r} needs the `datasets` package (pip install datasets); offline, "
                              f"export the rows to a file and use --task=jsonl:PATH")
        else:
            errors.append(f"--{flag}={spec!r}: use one of {', '.join(TASKS)}, jsonl:PATH or hf:NAME[:config]")
    if eval_file and task in TASKS:
        errors.append(f"--eval_file={eval_file!r}: only a dataset task (jsonl: / hf:) takes a held-out file")
    return errors


def load_task(task, difficulty, eval_size, eval_file=""):
    """(make_prompts, the task's own reward, held-out set [(question, example)])"""
    if task in TASKS:
        make_prompts, reward = TASKS[task]
        return make_prompts, reward, held_out_set(make_prompts, eval_size, difficulty)
    make_prompts, eval_set = dataset_task(task, eval_size, eval_file)
    return make_prompts, dataset_reward, eval_set


def held_out_set(make_prompts, n, difficulty):
    """n distinct questions; training never sees them (1-digit arithmetic has only 200 questions, so this matters)"""
    out, seen = [], set()
    for q, t in make_prompts(50 * n, EVAL_SEED, difficulty):
        if q not in seen:
            seen.add(q)
            out.append((q, t))
        if len(out) == n:
            return out
    raise ValueError(f"--eval_size={n}: only {len(out)} distinct questions at difficulty={difficulty}: lower "
                     f"--eval_size or raise --difficulty")


def check_training_pool(make_prompts, seed, difficulty, exclude):
    """refuse, before anything loads, a held-out set leaving training too few questions (train_prompts never ends)"""
    free = sum(q not in exclude for q, _ in make_prompts(1000, seed, difficulty))
    if free < 20:
        raise ValueError(f"--eval_size={len(exclude)} holds out {1000 - free} of 1000 questions drawn at difficulty="
                         f"{difficulty}: too few left to train on; lower --eval_size or raise --difficulty")


def train_prompts(make_prompts, n, seed, difficulty, exclude):
    """the n questions of one step: the first n outside the held-out set in make_prompts(4n, seed), then in more rounds
    (one can run dry); a function of the seed alone (step_seed); check_training_pool bounds the rounds."""
    out = []
    for r in range(1000):
        out += [p for p in make_prompts(4 * n, seed if r == 0 else seed * 1_000_003 + r, difficulty)
                if p[0] not in exclude]
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"the held-out set leaves too few training questions at difficulty={difficulty}: lower "
                     f"--eval_size")


FILE_MODULES = {}  # real path -> module: a file.py reward runs its top-level code once (the config check loads it too)


def load_reward(spec):
    """a reward function from "module:function" (imported like any module: the current directory is on the path)
    or "path/to/file.py:function", in either form (guard_reward)"""
    mod, sep, fn = spec.rpartition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"--reward={spec!r}: use module:function or path/file.py:function")
    if mod.endswith(".py"):
        path = os.path.realpath(os.path.expanduser(mod))
        s = importlib.util.spec_from_file_location(os.path.basename(mod)[:-3], path)
        if s is None or not os.path.isfile(path):
            raise ValueError(f"--reward={spec!r}: no file {mod}")
        if path not in FILE_MODULES:  # (kept only once its code ran through: a file that raised raises again)
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
    """the names the log uses, one per reward: "task" or the function's name ("reward/<name>")"""
    return [s.strip().rpartition(":")[2] for s in spec.split(",")] if spec else ["task"]


def parse_weights(spec, n):
    """--reward_weights="1,0.2" -> [1.0, 0.2]; "" -> all 1"""
    if not spec:
        return [1.0] * n
    w = [float(x) for x in spec.split(",")]
    if len(w) != n or not all(math.isfinite(x) for x in w):
        raise ValueError(f"--reward_weights={spec!r}: want {n} finite numbers, one per --reward")
    return w


def make_reward(task_reward, spec="", weights=""):
    """(reward_fn(questions, completions, examples, completion_ids) -> [(total, correct, [each reward])], counts) of
    --reward / --reward_weights: total = sum_i w_i r_i over the rewards that scored the row (TRL's nansum)."""
    specs = [s.strip() for s in spec.split(",")] if spec else ["task"]
    w = parse_weights(weights, len(specs))
    counts = {"errors": 0, "metrics": {}, "state": SimpleNamespace(global_step=0, max_steps=0)}
    fns = [guard_reward(task_reward if s == "task" else load_reward(s), counts) for s in specs]

    def reward_fn(questions, completions, examples, completion_ids):
        rows = zip(*(fn(questions, completions, examples, completion_ids) for fn in fns))  # a row: [(r, ok)] a reward
        return [(sum(wi * r for wi, (r, _) in zip(w, parts) if not math.isnan(r)),
                 bool(next((ok for _, ok in parts if ok is not None), False)), [r for r, _ in parts]) for parts in rows]
    return reward_fn, counts


def overlong_penalty(length, max_completion_len, soft_punish_cache, factor=1.0):
    """DAPO's soft overlong punishment (Eq. 13; TRL get_soft_overlong_punishment), added to the reward:
        0                                           if length <= L_max - L_cache
        factor * ((L_max - L_cache) - length) / L_cache   in the buffer: linear, -factor at L_max
    soft_punish_cache = L_cache = 0 turns it off. length in tokens (the EOS included)."""
    if soft_punish_cache <= 0:
        return 0.0
    start = max_completion_len - soft_punish_cache
    return factor * max(-1.0, min(0.0, (start - length) / soft_punish_cache))


def guard_reward(reward_fn, counts):
    """reward_fn in either form (README) as safe(questions, completions, examples, completion_ids) -> [(r, correct)],
    a batched form's None a NaN. A failed call (or a non-finite reward) scores (0.0, False) for each of its rows,
    counted in counts["errors"], the first traceback printed: one odd completion costs that completion, not the run."""
    sig = inspect.signature(reward_fn).parameters if callable(reward_fn) else {}  # (the config check's None)
    params = ["**" if p.kind is p.VAR_KEYWORD else name for name, p in sig.items()]
    batched = params[:1] in (["prompts"], ["completions"], ["completion_ids"], ["**"])
    ids_kw = "completion_ids" in params or "**" in params  # the per-completion form asks for them

    def failed(n):
        counts["errors"] += n
        if counts["errors"] == n:
            print(f"the reward function failed on a completion (it scores 0; later failures are only counted, as "
                  f"reward_errors in the log):\n{traceback.format_exc()}", file=sys.stderr)
        return [(0.0, False)] * n

    def one(completion, example, ids):
        try:
            out = reward_fn(completion, example, **({"completion_ids": ids} if ids_kw else {}))
            r, ok = out if isinstance(out, tuple) else (out, None)
            if not math.isfinite(r := float(r)):
                raise ValueError(f"reward {r} is not finite")
            return r, None if ok is None else bool(ok)
        except Exception:  # noqa: BLE001 - any failure of the reward is the completion's, not the run's
            return failed(1)[0]

    def safe(questions, completions, examples, completion_ids):
        if not batched:
            return [one(*row) for row in zip(completions, examples, completion_ids)]
        rows = [e if isinstance(e, dict) else {"answer": e} for e in examples]  # a built-in task's column: answer
        try:
            out = [math.nan if r is None else float(r) for r in reward_fn(
                prompts=[[{"role": "user", "content": q}] for q in questions], completion_ids=completion_ids,
                completions=[[{"role": "assistant", "content": c}] for c in completions],
                **{k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")},
                trainer_state=counts["state"], log_extra=lambda column, values: None,
                log_metric=lambda name, value: counts["metrics"].setdefault(name, []).append(float(value)))]
            if any(math.isinf(r) for r in out):
                raise ValueError(f"a reward is not finite: {out}")
        except Exception:  # noqa: BLE001 - as above, for every row of the call
            return failed(len(completions))
        if len(out) != len(completions):  # (a bug of the function: not a completion's failure)
            raise ValueError(f"reward {getattr(reward_fn, '__name__', reward_fn)!r} returned {len(out)} rewards for "
                             f"{len(completions)} completions: want one per completion")
        return [(r, None) for r in out]
    return safe
