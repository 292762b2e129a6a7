"""The command substitutions slime's launch scripts use that can be known without running
anything: `$(( arithmetic ))` (`--update-weight-buffer-size $(( 4 * 512 * 1024 * 1024 ))`),
`$(seq ...)` (`--sglang-cuda-graph-bs 1 2 4 8 $(seq 16 8 256)`), and `$(dirname ...)` /
`$(basename ...)` of a known path (`SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)`,
whose `cd DIR && pwd` the reader takes as DIR normalized: slime_import/bash.py).

Bash arithmetic is on integers with C's rules: `/` truncates toward zero and `%` takes the sign of
the dividend (bash(1), ARITHMETIC EVALUATION), which Python's `//` and `%` do not. Anything else
(comparisons, `?:`, assignments, `++`) is refused by name: the value stays unknown and the importer
reports it, it is never guessed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_MAX_DEPTH = 8  # a variable whose text names itself would otherwise recurse forever


def arithmetic(expr: str, lookup: Callable[[str], str], _depth: int = 0) -> int:
    """The value of bash's `$(( expr ))`; `lookup(name)` gives a variable's text (its own error when
    it has none). Raises ValueError naming what is not supported."""
    if _depth > _MAX_DEPTH:
        raise ValueError("variables refer to each other too deeply")
    text = _VAR.sub(lambda m: m.group(1) or m.group(2), expr).strip()
    if not text:
        return 0  # bash: an empty expression is 0
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"arithmetic {expr.strip()!r} is not supported (only + - * / % ** << >> & | ^ ~ "
                         "and parentheses on whole numbers)") from None
    return _eval(tree.body, lookup, _depth, expr)


def _eval(node: ast.AST, lookup: Callable[[str], str], depth: int, expr: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        # bash evaluates a variable's value as an arithmetic expression of its own
        return arithmetic(lookup(node.id), lookup, depth + 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
        v = _eval(node.operand, lookup, depth, expr)
        return -v if isinstance(node.op, ast.USub) else ~v if isinstance(node.op, ast.Invert) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, lookup, depth, expr), _eval(node.right, lookup, depth, expr)
        op = node.op
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ValueError(f"arithmetic {expr.strip()!r} divides by zero")
        if isinstance(op, ast.Div):
            return _cdiv(a, b)
        if isinstance(op, ast.Mod):
            return a - b * _cdiv(a, b)
        if isinstance(op, ast.Pow):
            if b < 0:
                raise ValueError(f"arithmetic {expr.strip()!r}: a negative exponent")
            return a ** b
        simple = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.BitAnd: a & b, ast.BitOr: a | b,
                  ast.BitXor: a ^ b}
        if type(op) in simple:
            return simple[type(op)]
        if isinstance(op, (ast.LShift, ast.RShift)) and b >= 0:
            return a << b if isinstance(op, ast.LShift) else a >> b
    raise ValueError(f"arithmetic {expr.strip()!r} is not supported (only + - * / % ** << >> & | ^ ~ and "
                     "parentheses on whole numbers)")


def _cdiv(a: int, b: int) -> int:
    """C's integer division: toward zero (-7 / 2 == -3 in bash, -4 in Python's //)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def seq(args: list[str]) -> list[str]:
    """What `seq [FIRST [INCREMENT]] LAST` prints, for whole numbers (coreutils seq(1))."""
    if not 1 <= len(args) <= 3 or not all(re.fullmatch(r"[+-]?\d+", a) for a in args):
        raise ValueError("only `seq [FIRST [INCREMENT]] LAST` of whole numbers is supported")
    nums = [int(a) for a in args]
    first, step, last = (1, 1, nums[0]) if len(nums) == 1 else (nums[0], 1, nums[1]) if len(nums) == 2 else nums
    if step == 0:
        raise ValueError("seq with an increment of 0 never ends")
    return [str(v) for v in range(first, last + (1 if step > 0 else -1), step)]


def path_command(cmd: str, args: list[str]) -> str:
    """What `dirname NAME` or `basename NAME [SUFFIX]` prints (coreutils dirname(1), basename(1)),
    `--` first allowed; refused by name for anything else."""
    if args[:1] == ["--"]:
        args = args[1:]
    if cmd == "dirname" and len(args) == 1:
        name = args[0].rstrip("/") or "/"
        if "/" not in name:
            return "."
        head = name.rsplit("/", 1)[0].rstrip("/")
        return head or "/"
    if cmd == "basename" and len(args) in (1, 2):
        name = args[0].rstrip("/") or "/"
        base = name.rsplit("/", 1)[-1] if name != "/" else "/"
        if len(args) == 2 and base != args[1] and base.endswith(args[1]):
            base = base[: -len(args[1])]
        return base
    raise ValueError(f"only `{cmd} NAME`{' [SUFFIX]' if cmd == 'basename' else ''} is supported")
