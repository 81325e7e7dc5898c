"""
nanoGRPO's tasks: make_prompts(n, seed, difficulty) -> [(question, target)], reward(completion, target) ->
(reward, correct). Plain functions: swap TASKS[name] for your own. Then what the trainer does with any task: the
held-out split, the endless training prompt stream, and the guard that keeps a raising reward from ending a run.
Imports nothing from the project.

The answer is the last "The answer is X": correct 1.0, the format with a wrong X 0.1, else 0. This format is one
SmolLM2-135M-Instruct half-follows (greedy, 1-digit arithmetic: format 75%, correct 19%); it never wrote
<answer>X</answer> even when told to, so a tag format gives GRPO no signal.

A reward runs on whatever the policy writes, so it must be safe on any string: numbers are read with parse_int
(bounded: int() of a 4,300+ digit string raises), expressions with safe_eval (never Python's eval: 60 unary
minus signs raised RecursionError there, and 9**9**9 would never return).
"""
import ast
import math
import random
import re
import sys
import traceback
from fractions import Fraction

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


def arithmetic_prompts(n, seed, difficulty):
    """a + b or a - b with `difficulty`-digit operands"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hi = 10 ** difficulty - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice("+-")
        out.append((f"What is {a} {op} {b}? End your reply with: The answer is NUMBER.", a + b if op == "+" else a - b))
    return out


def arithmetic_reward(completion, target):
    found = NUMBER_RE.findall(completion)
    if not found:
        return 0.0, False
    answer = parse_int(found[-1])
    if answer is None:
        return 0.0, False  # not a number we read (over MAX_DIGITS digits): no format credit either
    correct = answer == target
    return (1.0 if correct else 0.1), correct


def countdown_prompts(n, seed, difficulty):
    """difficulty + 1 numbers in 1..20 and a target reachable with + - * (each number used once; built so it is).
    A draw is kept when its target lands in 1..200; each extra number makes that rarer (77% of draws at
    difficulty 1, 7% at 10, 0.005% at 30, where this loop used to run for hours), so the tries are bounded."""
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
            q = (f"Using the numbers {nums}, each exactly once, and + - * / ( ), write an expression equal to {target}. "
                 f"End your reply with: The answer is EXPRESSION.")
            out.append((q, (tuple(sorted(nums)), target)))
    return out


def countdown_reward(completion, target):
    nums, value = target
    found = EXPR_RE.findall(completion)
    if not found:
        return 0.0, False
    expr = found[-1].strip()
    got = safe_eval(expr)
    if got is None:
        return 0.0, False  # no expression we evaluate (syntax, **, past the limits): no format credit either
    used = tuple(sorted(parse_int(x) for x in re.findall(r"\d+", expr)))  # (short: safe_eval took every literal)
    correct = used == nums and got == value
    return (1.0 if correct else 0.1), correct


TASKS = {"arithmetic": (arithmetic_prompts, arithmetic_reward), "countdown": (countdown_prompts, countdown_reward)}
# the largest difficulty each generator samples in reasonable time (arithmetic: answers within MAX_DIGITS digits)
MAX_DIFFICULTY = {"arithmetic": 18, "countdown": 10}


# ------------------------------------------------------------------------------------------------------------------
# what the trainer does with any task: the held-out split, the training prompt stream, the reward guard
# ------------------------------------------------------------------------------------------------------------------
EVAL_SEED = 10**9 + 7  # held-out set: a seed no training step uses (training step s uses seed * 100_003 + s)


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
    """refuse, before anything loads, a held-out set that leaves training (almost) no questions: train_prompts would
    have to draw for ever"""
    free = sum(q not in exclude for q, _ in make_prompts(1000, seed, difficulty))
    if free < 20:
        raise ValueError(f"--eval_size={len(exclude)} holds out {1000 - free} of 1000 questions drawn at difficulty="
                         f"{difficulty}: too few left to train on; lower --eval_size or raise --difficulty")


def train_prompts(make_prompts, n, seed, difficulty, exclude):
    """the n questions of one step: the first n outside the held-out set in the endless stream make_prompts(4n, seed),
    then make_prompts(4n, seed * 1_000_003 + r) for r = 1, 2, ... (one draw used to be all there was: with
    prompts_per_step=1 and 1-digit arithmetic, half of whose questions are held out, it ran dry at step 11, and at
    that same step again on every resume). It depends on (seed, step) alone, so a resumed run draws exactly what an
    unbroken one would; check_training_pool makes sure a few rounds suffice."""
    out = []
    for r in range(1000):
        out += [p for p in make_prompts(4 * n, seed if r == 0 else seed * 1_000_003 + r, difficulty)
                if p[0] not in exclude]
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"the held-out set leaves too few training questions at difficulty={difficulty}: lower "
                     f"--eval_size")


def guard_reward(reward_fn):
    """reward_fn that never raises: a call that raises (or returns a non-finite reward) scores (0.0, False) for that
    completion and is counted in counts["errors"] (the step log's reward_errors); the first traceback is printed,
    once. A user's reward meeting one odd completion should cost that completion, not a week-long run."""
    counts = {"errors": 0}

    def safe(completion, target):
        try:
            r, ok = reward_fn(completion, target)
            r = float(r)
            if not math.isfinite(r):
                raise ValueError(f"reward {r} is not finite")
            return r, bool(ok)
        except Exception:  # noqa: BLE001 - any failure of the reward is the completion's, not the run's
            counts["errors"] += 1
            if counts["errors"] == 1:
                print(f"the reward function failed on a completion (it scores 0; later failures are only counted, as "
                      f"reward_errors in the log):\n{traceback.format_exc()}", file=sys.stderr)
            return 0.0, False
    return safe, counts
