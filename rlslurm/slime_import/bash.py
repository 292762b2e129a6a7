"""A reader for the bash of slime's launch scripts that never runs it.

It knows what those scripts use: `NAME=value` and `NAME=( ... )` assignments (comments and line
continuations inside), `$NAME` / `${NAME}` / `${NAME:-default}` / `${NAME[@]}` references to what
the script set earlier, `source FILE`, and the `... python3 train.py ARGS` command. A variable the
script does not set takes the value the caller gives (`--var NAME=VALUE`, then import-slime's own
environment), as bash would take it from its environment. A value it cannot know without running
something (a command substitution, a variable set nowhere, one set inside an if/for block) becomes
the placeholder `<unset:NAME>` (rlslurm/settings/placeholder.py) with the reason recorded, which
`rlslurm submit` refuses until it is filled; nothing is guessed. The `ray job submit
--runtime-env-json` of the launch and the script's `export`s are kept for the environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlslurm.errors import UserError
from rlslurm.secret_env import looks_secret
from rlslurm.settings.placeholder import placeholder

_OPS = ("&&", "||", ";;", ">>", "<<", "&>", ";", "&", "|", "(", ")", "<", ">")
_SEPARATORS = {"&&", "||", ";", ";;", "&", "|"}
_OPENERS = {"if", "for", "while", "until", "case", "{"}
_CLOSERS = {"fi", "done", "esac", "}"}
_LEADS = {"then", "do", "else", "elif", "!"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
LAUNCHERS = ("train.py", "train_async.py")


class ScriptError(UserError):
    """The script cannot be read as the supported bash; the message names file:line."""


@dataclass(frozen=True)
class Unresolved:
    reason: str


@dataclass
class Lit:
    text: str
    quoted: bool


@dataclass
class Var:
    name: str
    index: str | None      # "@", "*", a number, or None
    op: str | None         # ":-", "-", or None; anything else is refused at expansion
    arg: "Word | None"
    quoted: bool
    source: str            # as written, for messages


@dataclass
class Sub:
    text: str              # `$(...)`, backticks or `$((...))`, as written
    quoted: bool = False   # inside "...": no word splitting of what it gives


@dataclass
class Word:
    parts: list
    line: int

    def literal(self) -> str | None:
        """The word's text when it has no expansion at all."""
        if all(isinstance(p, Lit) for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None

    def literal_tail(self) -> str:
        """The literal text after the word's last expansion (`${DIR}/models/x.sh` -> `/models/x.sh`)."""
        tail = []
        for p in reversed(self.parts):
            if not isinstance(p, Lit):
                break
            tail.append(p.text)
        return "".join(reversed(tail))


class _Lexer:
    def __init__(self, text: str, path: str):
        self.s, self.i, self.line, self.path = text, 0, 1, path

    def fail(self, line: int, msg: str) -> ScriptError:
        return ScriptError(f"{self.path}:{line}: {msg}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def tokens(self) -> list:
        out: list = []
        heredocs: list[str] = []
        while self.i < len(self.s):
            c = self.peek()
            if c in " \t\r":
                self.i += 1
            elif c == "\\" and self.peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c == "\n":
                out.append(("nl", self.line))
                self.i += 1
                self.line += 1
                for delim in heredocs:
                    self._skip_heredoc(delim)
                heredocs = []
            elif c == "#":
                while self.i < len(self.s) and self.peek() != "\n":
                    self.i += 1
            elif op := next((o for o in _OPS if self.s.startswith(o, self.i)), None):
                self.i += len(op)
                out.append(("op", op, self.line))
                if op == "<<":
                    start = self.line
                    while self.peek() in " \t-":
                        self.i += 1
                    delim = self.word()
                    text = delim.literal() if delim.parts else None
                    if not text:
                        raise self.fail(start, "a here-document whose delimiter is not plain text")
                    heredocs.append(text)
            else:
                out.append(("word", self.word()))
        return out

    def _skip_heredoc(self, delim: str) -> None:
        start = self.line
        while self.i < len(self.s):
            end = self.s.find("\n", self.i)
            end = len(self.s) if end < 0 else end
            body = self.s[self.i:end]
            self.i, self.line = end + 1, self.line + 1
            if body.strip("\t") == delim:
                return
        raise self.fail(start, f"here-document never ends (no line {delim!r})")

    def word(self) -> Word:
        w = Word([], self.line)
        while self.i < len(self.s):
            c = self.peek()
            if c in " \t\r\n;&|()<>":
                break
            if c == "\\":
                if self.peek(1) == "\n":
                    self.i += 2
                    self.line += 1
                    continue
                w.parts.append(Lit(self.peek(1), True))
                self.i += 2
            elif c == "'":
                end = self.s.find("'", self.i + 1)
                if end < 0:
                    raise self.fail(self.line, "unterminated single quote")
                text = self.s[self.i + 1:end]
                w.parts.append(Lit(text, True))
                self.line += text.count("\n")
                self.i = end + 1
            elif c == '"':
                self._double(w)
            elif c == "$":
                w.parts.append(self.dollar(quoted=False))
            elif c == "`":
                w.parts.append(self._backtick())
            else:
                w.parts.append(Lit(c, False))
                self.i += 1
        return w

    def _double(self, w: Word) -> None:
        start = self.line
        self.i += 1
        while True:
            c = self.peek()
            if c == "":
                raise self.fail(start, "unterminated double quote")
            if c == '"':
                self.i += 1
                return
            if c == "\\" and self.peek(1) in '$`"\\\n':
                if self.peek(1) == "\n":
                    self.line += 1
                else:
                    w.parts.append(Lit(self.peek(1), True))
                self.i += 2
            elif c == "$":
                w.parts.append(self.dollar(quoted=True))
            elif c == "`":
                w.parts.append(self._backtick())
            else:
                self.line += c == "\n"
                w.parts.append(Lit(c, True))
                self.i += 1

    def _backtick(self) -> Sub:
        start = self.line
        end = self.i + 1
        while end < len(self.s) and self.s[end] != "`":
            end += 2 if self.s[end] == "\\" else 1
        if end >= len(self.s):
            raise self.fail(start, "unterminated backquote")
        text = self.s[self.i:end + 1]
        self.line += text.count("\n")
        self.i = end + 1
        return Sub(text)

    def _balanced(self, open_: str, close: str) -> int:
        """The index just past the bracket closing the one at self.i (quotes skipped)."""
        depth, j, start = 0, self.i, self.line
        while j < len(self.s):
            c = self.s[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"":
                end = self.s.find(c, j + 1)
                if end < 0:
                    break
                j = end + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise self.fail(start, f"unterminated {open_}")

    def dollar(self, quoted: bool) -> Lit | Var | Sub:
        nxt = self.peek(1)
        if nxt == "(":
            self.i += 1
            end = self._balanced("(", ")")
            text = "$" + self.s[self.i:end]
            self.line += text.count("\n")
            self.i = end
            return Sub(text, quoted)
        if nxt == "{":
            self.i += 1
            end = self._balanced("{", "}")
            inner = self.s[self.i + 1:end - 1]
            line = self.line
            self.line += inner.count("\n")
            self.i = end
            return self._braced(inner, quoted, line)
        m = _NAME.match(self.s, self.i + 1)
        if m:
            self.i = m.end()
            return Var(m.group(), None, None, None, quoted, "$" + m.group())
        if nxt and (nxt.isdigit() or nxt in "@*#?$!-"):
            self.i += 2
            return Var(nxt, None, None, None, quoted, "$" + nxt)
        self.i += 1
        return Lit("$", quoted)

    def _braced(self, inner: str, quoted: bool, line: int) -> Var:
        source = "${" + inner + "}"
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!])(\[([^\]]*)\])?", inner)
        if not m or inner.startswith(("#", "!")) and len(inner) > 1:
            return Var("", None, "?", None, quoted, source)  # ${#X}, ${!X}: refused at expansion
        rest = inner[m.end():]
        op, arg = None, None
        if rest:
            om = re.match(r":?[-=+?]", rest)
            if om is None:
                return Var(m.group(1), m.group(3), rest, None, quoted, source)
            op = om.group()
            sub = _Lexer(rest[om.end():], self.path)
            sub.line = line
            arg = sub.word() if sub.s else Word([], line)
            if quoted:  # inside "...", the default's own quotes are the only quoting left
                for p in arg.parts:
                    if isinstance(p, (Lit, Var)):
                        p.quoted = True
        return Var(m.group(1), m.group(3), op, arg, quoted, source)


# ------------------------------------------------------------------------------------ expansion


@dataclass
class Element:
    """One argument of an array or of the launch command: its text, or why it has none."""

    text: str | None
    unresolved: str | None
    line: int
    array: str | None = None


@dataclass
class Script:
    path: str
    scalars: dict[str, "str | Unresolved"] = field(default_factory=dict)
    arrays: dict[str, "list[Element] | Unresolved"] = field(default_factory=dict)
    sources: list[Word] = field(default_factory=list)
    launch: tuple[str, list[Element], int] | None = None   # (launcher, args, line)
    notes: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[tuple[int, str]] = field(default_factory=list)   # what the script likely got wrong
    # placeholders: the variable (or command) -> (line of its first use, why its value is not known)
    unknown: dict[str, tuple[int, str]] = field(default_factory=dict)
    exports: dict[str, int] = field(default_factory=dict)   # `export NAME[=...]` -> its line
    # the launch's `--runtime-env-json` (line, its text with placeholders), or (line, why it is not known)
    runtime_env: tuple[int, str | None, str | None] | None = None
    ray_gpus: tuple[int, str] | None = None   # `ray start --head ... --num-gpus N`: (line, N as expanded)
    _noted: set[str] = field(default_factory=set)


class _Expander:
    def __init__(self, script: Script, given: Mapping[str, str], environ: Mapping[str, str]):
        self.sc = script
        self.given = given        # --var NAME=VALUE: wins over what the script cannot know
        self.environ = environ    # import-slime's environment: for variables the script does not set
        self.used: set[str] = set()   # the --var names a value was taken from

    def _outside(self, name: str, line: int) -> str | None:
        """`name`'s value from --var, else from the environment, noted once; None when neither has it."""
        for where, values in (("--var", self.given), ("import-slime's environment", self.environ)):
            if name in values:
                if values is self.given:
                    self.used.add(name)
                if name not in self.sc._noted:
                    self.sc._noted.add(name)
                    shown = "(its value not shown)" if looks_secret(name) else repr(values[name])
                    self.sc.notes.append((line, f"${name} is not set in the script: {name} {shown} from {where}"))
                return values[name]
        return None

    def _unknown(self, name: str, why: str, line: int) -> str:
        """The text standing for a value that is not known here: --var's, else the placeholder."""
        if name in self.given:
            self.used.add(name)
            if name not in self.sc._noted:
                self.sc._noted.add(name)
                self.sc.notes.append((line, f"${name}: --var {name} stands for the script's own value ({why})"))
            return self.given[name]
        self.sc.unknown.setdefault(name, (line, why))
        return placeholder(name)

    def var(self, v: Var, line: int) -> list[str] | str:
        """A list for `${A[@]}`, else the variable's text; raises _Stop when unknown."""
        if v.op not in (None, ":-", "-") or not v.name:
            raise _Stop(f"{v.source}: this parameter expansion is not supported")
        if (v.name, v.index) in (("0", None), ("BASH_SOURCE", "0"), ("BASH_SOURCE", None)):
            return os.path.abspath(self.sc.path)  # the script itself, where it is read
        if not _NAME.fullmatch(v.name):
            raise _Stop(f"{v.source}: a positional or special parameter has no value outside a run")
        if v.index is not None:
            arr = self.sc.arrays.get(v.name)
            if isinstance(arr, Unresolved):
                raise _Stop(f"{v.source}: {arr.reason}")
            if arr is None and v.index in ("@", "*") and v.name not in self.sc.scalars:
                if v.name not in self.sc._noted:  # bash: an array never set expands to no word at all
                    self.sc._noted.add(v.name)
                    self.sc.notes.append((line, f"{v.source}: " + (
                        "the sourced model script's architecture flags: rlslurm reads the architecture from "
                        "--model's config or --hf-checkpoint's config.json" if v.name == "MODEL_ARGS" else
                        f"{v.name} is not set in the script, so it expands to nothing, as in bash")))
                return []
            if arr is None:
                raise _Stop(f"{v.source}: the array {v.name} is not set in the script")
            for e in arr:
                if e.text is None:
                    raise _Stop(f"{v.source}: {e.unresolved}")
            texts = [e.text for e in arr if e.text is not None]
            if v.index in ("@", "*"):
                return texts
            if v.index.isdigit():
                return texts[int(v.index)] if int(v.index) < len(texts) else ""
            raise _Stop(f"{v.source}: only [@], [*] and numeric subscripts are supported")
        have = v.name in self.sc.scalars or v.name in self.sc.arrays
        if have:
            val = self.sc.scalars.get(v.name)
            if val is None:  # an array used as a scalar is its first element
                arr = self.sc.arrays[v.name]
                if isinstance(arr, Unresolved):
                    raise _Stop(f"{v.source}: {arr.reason}")
                val = arr[0].text if arr and arr[0].text is not None else ""
            if isinstance(val, Unresolved):
                return self._unknown(v.name, val.reason, line)
            if v.op == ":-" and val == "":
                return self.single(v.arg, line) if v.arg else ""
            return val
        outside = self._outside(v.name, line)
        if outside is not None and not (v.op == ":-" and outside == ""):
            return outside
        if v.op in (":-", "-"):
            default = self.single(v.arg, line) if v.arg else ""
            if v.name not in self.sc._noted:
                self.sc._noted.add(v.name)
                self.sc.notes.append((line, f"{v.source}: {v.name} is not set in the script nor given; took its "
                                            f"default {default!r} (--var {v.name}=VALUE, or an environment "
                                            f"{v.name}, would win)"))
            return default
        return self._unknown(v.name, f"{v.name} is not set in the script, nor given with --var or in the "
                                     "environment", line)

    def sub(self, p: Sub, line: int) -> str:
        """What `$((...))`, `$(seq ...)`, `$(dirname ...)`, `$(basename ...)` or `$(cd DIR && pwd)`
        print (slime_import/shell_eval.py); any other command substitution would need the command run,
        so it stays unknown."""
        from rlslurm.slime_import.shell_eval import arithmetic, path_command, seq

        if p.text.startswith("$((") and p.text.endswith("))"):
            try:
                return str(arithmetic(p.text[3:-2], lambda name: self._number(name, line)))
            except ValueError as e:
                raise _Stop(f"{_short(p.text)}: {e}") from None
            except _Stop as e:  # a variable in it has no known value
                raise _Stop(f"{_short(p.text)}: {e.reason}") from None
        if p.text.startswith("$(") and p.text.endswith(")"):
            inner = _Lexer(p.text[2:-1], self.sc.path)
            inner.line = line
            toks = inner.tokens()
            if toks and all(t[0] == "word" for t in toks) and toks[0][1].literal() in ("seq", "dirname", "basename"):
                cmd = toks[0][1].literal()
                args = [f for t in toks[1:] for f in self.fields(t[1])]
                try:
                    return "\n".join(seq(args)) if cmd == "seq" else path_command(cmd, args)
                except ValueError as e:
                    raise _Stop(f"{_short(p.text)}: {e}") from None
            where = _cd_pwd(toks)
            if where is not None:  # `cd DIR && pwd`: the directory, when it is absolute
                text = self.single(where, line)
                if not text.startswith("/"):
                    raise _Stop(f"{_short(p.text)}: `cd` to a relative directory depends on where the script runs")
                return os.path.normpath(text)
        raise _Stop(f"{_short(p.text)}: a command substitution is not run")

    def _sub_or_placeholder(self, p: Sub, line: int) -> str:
        """A word's command substitution: its output where it is known (sub), else a placeholder
        named by the command (no blank in it, so that it stays one word)."""
        try:
            return self.sub(p, line)
        except _Stop as e:
            key = "".join(p.text.split())
            self.sc.unknown.setdefault(key, (line, e.reason))
            return placeholder(key)

    def _number(self, name: str, line: int) -> str:
        """A variable's text inside `$((...))` (bash evaluates it as an expression there too)."""
        from rlslurm.settings.placeholder import names

        text = self.single(Word([Var(name, None, None, None, True, "$" + name)], line), line)
        if names(text):
            raise _Stop(f"${name} has no known value ({self.sc.unknown[names(text)[0]][1]})")
        return text

    def fields(self, w: Word) -> list[str]:
        """The words `w` becomes (unquoted expansions split on blanks, an empty unquoted one dropped)."""
        out: list[str] = []
        cur: list[str] = []
        started = False
        for p in w.parts:
            if isinstance(p, Lit):
                cur.append(p.text)
                started = True
                continue
            val = self._sub_or_placeholder(p, w.line) if isinstance(p, Sub) else self.var(p, w.line)
            if isinstance(val, list):
                if p.quoted:
                    val = [" ".join(val)] if p.index == "*" else val
                for k, item in enumerate(val):
                    if k:
                        out.append("".join(cur))
                        cur = []
                    cur.append(item)
                    started = True
                continue
            if p.quoted:
                cur.append(val)
                started = True
                continue
            pieces = val.split()
            if val[:1].isspace() and (cur or started):
                out.append("".join(cur))
                cur, started = [], False
            for k, piece in enumerate(pieces):
                if k:
                    out.append("".join(cur))
                    cur = []
                cur.append(piece)
                started = True
            if val[-1:].isspace() and pieces:
                out.append("".join(cur))
                cur, started = [], False
        if started:
            out.append("".join(cur))
        return out

    def single(self, w: Word, line: int) -> str:
        """An assignment's value: one string, no splitting."""
        out = []
        for p in w.parts:
            if isinstance(p, Lit):
                out.append(p.text)
            elif isinstance(p, Sub):
                out.append(self.sub(p, line))
            else:
                val = self.var(p, line)
                out.append(" ".join(val) if isinstance(val, list) else val)
        return "".join(out)


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _cd_pwd(toks: list) -> "Word | None":
    """DIR of `cd [--] DIR [&>/dev/null] && pwd` (slime's SCRIPT_DIR idiom), else None."""
    words = [t for t in toks if t[0] != "nl"]
    if len(words) < 4 or words[0][0] != "word" or words[0][1].literal() != "cd":
        return None
    rest = words[1:]
    if rest[0][0] == "word" and rest[0][1].literal() == "--":
        rest = rest[1:]
    if not rest or rest[0][0] != "word":
        return None
    target, rest = rest[0][1], rest[1:]
    if len(rest) >= 2 and rest[0][0] == "op" and rest[0][1] in ("&>", ">") and rest[1][0] == "word" \
            and rest[1][1].literal() == "/dev/null":
        rest = rest[2:]
    if [(t[0], t[1] if t[0] == "op" else t[1].literal()) for t in rest] == [("op", "&&"), ("word", "pwd")]:
        return target
    return None


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------ statements


def read_script(text: str, path: str, given: Mapping[str, str] | None = None,
                environ: Mapping[str, str] | None = None) -> Script:
    """Walk the script's top level in order, recording what a run of it would have set. `given`:
    --var NAME=VALUE; `environ`: the environment variables the script does not set come from."""
    toks = _Lexer(text, path).tokens()
    sc = Script(path)
    ex = _Expander(sc, given or {}, environ or {})
    depth = 0
    block_line: list[int] = []
    i = 0
    launches: list[int] = []
    prev: tuple[int, str] | None = None   # the last command's last line, and what it was
    while i < len(toks):
        t = toks[i]
        if t[0] != "word":
            i += 1
            continue
        words, i = _words(toks, i, ex, depth, block_line)
        if not words:
            continue
        if prev is not None and _flag_like(words[0]):
            sc.warnings.append((words[0].line, _broken_continuation(words[0], prev)))
        launcher = next((b for w in words if (b := w.literal_tail().rsplit("/", 1)[-1]) in LAUNCHERS), None)
        prev = (words[-1].line,
                f"the {launcher} launch" if launcher else f"`{_short(words[0].literal() or '...')} ...`")
        head = words[0].literal()
        while head in _LEADS and words:
            words = words[1:]
            head = words[0].literal() if words else None
        if not words:
            continue
        if head in _OPENERS:
            depth += 1
            block_line.append(words[0].line)
            if head == "{" and len(words) > 1:
                words = words[1:]
                head = words[0].literal()
            else:
                if head in ("for", "case"):
                    continue
                words = words[1:]
                if not words:
                    continue
                head = words[0].literal()
        if head in _CLOSERS:
            depth = max(0, depth - 1)
            if block_line:
                block_line.pop()
            continue
        if head in ("export", "declare", "local", "readonly", "typeset"):
            _declare(ex, head, words[1:], depth, block_line)
            continue
        k = 0
        while k < len(words) and _ASSIGN.match(_first_lit(words[k])):
            k += 1
        if k == len(words):
            for w in words:
                _assign_scalar(sc, ex, w, depth, block_line)
            continue
        _command(ex, words[k:], depth, launches)
    for name in sorted(set(given or {}) - ex.used):
        sets = name in sc.scalars or name in sc.arrays
        sc.notes.append((0, f"--var {name}: not used: " + (
            "the script sets it itself, and its own value wins, as in bash" if sets else "the script does not use it")))
    if len(launches) > 1:
        raise ScriptError(f"{path}:{launches[1]}: a second {sc.launch[0] if sc.launch else 'train.py'} launch "
                          f"(the first is at line {launches[0]}); import a script with one")
    return sc


def _words(toks: list, i: int, ex: "_Expander", depth: int, block_line: list[int]) -> tuple[list[Word], int]:
    """One simple command from token `i`: its words up to a separator, and the token after it. An
    array assignment `A=(...)` inside it is recorded on the way."""
    words: list[Word] = []
    while i < len(toks):
        t = toks[i]
        if t[0] == "nl" or (t[0] == "op" and t[1] in _SEPARATORS | {")"}):
            return words, i + 1
        if t[0] == "op" and t[1] == "(" and words and _ASSIGN.fullmatch(words[-1].literal() or ""):
            name_word = words.pop()
            elems, i = _array_body(toks, i + 1, ex.sc.path, name_word.line)
            _assign_array(ex.sc, ex, name_word, elems, depth, block_line)
            continue
        if t[0] == "word":  # else a `(` of a subshell, `for ((...))` or `name() {`: its body is read as a block
            words.append(t[1])
        i += 1
    return words, i


def _declare(ex: "_Expander", head: str, args: list[Word], depth: int, block_line: list[int]) -> None:
    """`export`/`declare`/`local`/... NAME[=VALUE]...: the assignments, and the names exported."""
    for w in args:
        m = _ASSIGN.match(_first_lit(w))
        if m:
            _assign_scalar(ex.sc, ex, w, depth, block_line)
        if head == "export" and (m or _NAME.fullmatch(w.literal() or "")):
            ex.sc.exports.setdefault(m.group(1) if m else w.literal(), w.line)  # type: ignore[arg-type]


def _command(ex: "_Expander", cmd: list[Word], depth: int, launches: list[int]) -> None:
    """A command that is not an assignment: `ray start --head` (its GPUs), `source`, or the launch."""
    sc = ex.sc
    if [w.literal() for w in cmd[:2]] == ["ray", "start"] and any(w.literal() == "--head" for w in cmd):
        at = next((i for i, w in enumerate(cmd) if w.literal() == "--num-gpus"), None)
        if at is not None and at + 1 < len(cmd) and depth == 0:
            try:
                sc.ray_gpus = (cmd[at].line, ex.single(cmd[at + 1], cmd[at].line))
            except _Stop:
                pass
        return
    if cmd[0].literal() in ("source", "."):
        if len(cmd) > 1:
            sc.sources.append(cmd[1])
        return
    for j, w in enumerate(cmd):
        base = w.literal_tail().rsplit("/", 1)[-1]
        if base in LAUNCHERS and (j == 0 or w.literal_tail().endswith("/" + base) or w.literal() == base):
            launches.append(w.line)
            sc.launch = (base, _launch_args(sc, ex, cmd[j + 1:]), w.line)
            sc.runtime_env = _runtime_env(ex, cmd[:j]) or sc.runtime_env
            return


def _runtime_env(ex: _Expander, words: list[Word]) -> tuple[int, str | None, str | None] | None:
    """`ray job submit --runtime-env-json=JSON` (or `... --runtime-env-json JSON`) before the launcher:
    (line, the JSON's text, None), or (line, None, why it is not known)."""
    for k, w in enumerate(words):
        lead = _first_lit(w) or (w.literal() or "")
        if not lead.startswith("--runtime-env-json"):
            continue
        value = w if "=" in lead else (words[k + 1] if k + 1 < len(words) else None)
        if value is None:
            return (w.line, None, "--runtime-env-json has no value")
        try:
            text = ex.single(value, value.line)
        except _Stop as e:
            return (w.line, None, e.reason)
        return (w.line, text.split("=", 1)[1] if value is w else text, None)
    return None


def _flag_like(w: Word) -> bool:
    """A command that starts as an argument list would: `--flag ...` or `${ARGS[@]} ...`."""
    if (w.literal() or "").startswith("-"):
        return True
    return len(w.parts) == 1 and isinstance(w.parts[0], Var) and w.parts[0].index in ("@", "*")


def _broken_continuation(w: Word, prev: tuple[int, str]) -> str:
    first = w.literal() or (w.parts[0].source if isinstance(w.parts[0], Var) else "")
    last_line, what = prev
    return (f"{first} starts a command of its own: line {last_line} ({what}) does not end with `\\`, so bash "
            "ends that command there and runs this line and its continuation separately; their flags are not "
            f"imported (add the missing `\\` to line {last_line} if they belong to it)")


def _first_lit(w: Word) -> str:
    out = []
    for p in w.parts:
        if not isinstance(p, Lit) or p.quoted:
            break
        out.append(p.text)
    return "".join(out)


def _array_body(toks: list, i: int, path: str, line: int) -> tuple[list[Word], int]:
    elems: list[Word] = []
    while i < len(toks):
        t = toks[i]
        if t[0] == "op" and t[1] == ")":
            return elems, i + 1
        if t[0] == "word":
            elems.append(t[1])
        elif t[0] == "op":
            raise ScriptError(f"{path}:{t[2]}: {t[1]!r} inside an array assignment")
        i += 1
    raise ScriptError(f"{path}:{line}: the array assignment never ends (no ')')")


def _block_reason(depth: int, block_line: list[int]) -> str | None:
    if depth <= 0:
        return None
    return (f"set inside an if/loop block or function (line {block_line[-1] if block_line else '?'}), "
            "so its value depends on the run")


def _assign_scalar(sc: Script, ex: _Expander, w: Word, depth: int, block_line: list[int]) -> None:
    m = _ASSIGN.match(_first_lit(w))
    assert m is not None
    name, append = m.group(1), m.group(2)
    value = _strip_prefix(w, m.end())
    reason = _block_reason(depth, block_line)
    if reason:
        sc.scalars[name] = Unresolved(f"{name} is {reason}")
        sc.arrays.pop(name, None)
        return
    try:
        text = ex.single(value, w.line)
    except _Stop as e:
        sc.scalars[name] = Unresolved(f"{name} (line {w.line}) has no known value: {e.reason}")
        return
    old = sc.scalars.get(name, "")
    if append and isinstance(old, Unresolved):
        return
    sc.scalars[name] = (old + text) if append else text
    sc.arrays.pop(name, None)


def _strip_prefix(w: Word, n: int) -> Word:
    parts, left = [], n
    for p in w.parts:
        if left > 0 and isinstance(p, Lit):
            take = min(left, len(p.text))
            left -= take
            if take < len(p.text):
                parts.append(Lit(p.text[take:], p.quoted))
            continue
        parts.append(p)
    return Word(parts, w.line)


def _assign_array(sc: Script, ex: _Expander, name_word: Word, elems: list[Word], depth: int,
                  block_line: list[int]) -> None:
    m = _ASSIGN.fullmatch(name_word.literal() or "")
    assert m is not None
    name, append = m.group(1), m.group(2)
    reason = _block_reason(depth, block_line)
    if reason:
        sc.arrays[name] = Unresolved(f"{name} is {reason}")
        sc.scalars.pop(name, None)
        return
    items: list[Element] = []
    for w in elems:
        try:
            items += [Element(f, None, w.line, name) for f in ex.fields(w)]
        except _Stop as e:
            items.append(Element(None, e.reason, w.line, name))
    old = sc.arrays.get(name)
    if append and isinstance(old, list):
        items = old + items
    elif append and isinstance(old, Unresolved):
        return
    sc.arrays[name] = items
    sc.scalars.pop(name, None)


def _launch_args(sc: Script, ex: _Expander, words: list[Word]) -> list[Element]:
    """The launch command's arguments; `${A[@]}` keeps each element's own line and array."""
    out: list[Element] = []
    for w in words:
        only = w.parts[0] if len(w.parts) == 1 else None
        if isinstance(only, Var) and only.index in ("@", "*") and only.op is None:
            arr = sc.arrays.get(only.name)
            if isinstance(arr, list):
                out += arr
                continue
            if arr is None and only.name not in sc.scalars:
                ex.var(only, w.line)  # bash: no word at all; noted once
                continue
            reason = arr.reason if isinstance(arr, Unresolved) else f"the array {only.name} is not set in the script"
            out.append(Element(None, f"{only.source}: {reason}", w.line, only.name))
            continue
        try:
            out += [Element(f, None, w.line) for f in ex.fields(w)]
        except _Stop as e:
            out.append(Element(None, e.reason, w.line))
    return out
