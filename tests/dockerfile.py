"""A small Dockerfile reader for static checks: which environment each RUN command sees.

It follows what a build does: `ARG` and `ENV` (both forms: `ENV A=1 B=2` and the legacy `ENV A 1`) set
variables for the stage's later RUN instructions, `FROM` starts a new stage (only the global ARGs'
names carry over, unset), line continuations are joined and comment lines inside them dropped. Inside
a RUN's shell command it splits simple commands on `&&`, `||`, `;`, `|`, newlines and the shell's
keywords, and applies `VAR=x cmd` (for that command), bare `VAR=x` / `export VAR=x` (for the rest of the
RUN), `env VAR=x cmd` and `env -u VAR cmd`.

`hub_fetch_under_offline_switch(text)` lists the commands that fetch from a model hub while one of the
hubs' offline switches is on (huggingface_hub then refuses every request, so the build fails there).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub reads as "on"
# calls that fetch through huggingface_hub (stanza's models come from its hub too)
HUB_FETCH = re.compile(r"stanza\.download\(|\bhf_hub_download\b|\bsnapshot_download\b|\.from_pretrained\("
                       r"|huggingface-cli\s+download|\bhf\s+download\b")
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for", "case", "esac", "!", "{", "}"}
REDIRECT_TO_FD = re.compile(r"\d*[<>]&[\d-]+|&>>?")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Instruction:
    line: int  # where it starts (1-based)
    keyword: str  # upper case
    args: str  # continuations joined


@dataclass(frozen=True)
class Finding:
    line: int
    command: str
    switches: tuple[str, ...]  # the offline switches that were on

    def __str__(self) -> str:
        return f"line {self.line}: {self.command[:120]!r} runs with {', '.join(self.switches)} on"


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile text, continuations joined, comments and blank lines dropped."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # a comment line, also inside a continuation (the builder drops those too)
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        keyword, _, args = " ".join(parts).partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
        parts = []
    if parts:
        raise ValueError(f"line {start}: the last instruction ends in a line continuation")
    return out


def expand(value: str, env: dict[str, str]) -> str:
    """`$VAR`, `${VAR}` and `${VAR:-default}` replaced from env (unset: the default or empty)."""
    return VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(3), m.group(2) or ""), value)


def _env_pairs(args: str, env: dict[str, str]) -> dict[str, str]:
    """`ENV A=1 B="two words"` or the legacy `ENV A 1` → {name: value}, values expanded."""
    words = shlex.split(args, posix=True)
    if words and "=" not in words[0]:
        name, _, value = args.partition(" ")
        return {name: expand(value.strip(), env)}
    pairs = {}
    for word in words:
        match = ASSIGNMENT.match(word)
        if not match:
            raise ValueError(f"ENV {args!r}: {word!r} is not NAME=value")
        pairs[match.group(1)] = expand(match.group(2), env)
    return pairs


def _shell_commands(command: str) -> list[list[str]]:
    """The simple commands of a shell command line: words, quotes removed, split on operators and keywords."""
    command = REDIRECT_TO_FD.sub(" ", command)  # `>&2`, `2>&1`, `&>`: not command separators
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS or (not commands[-1] and token in KEYWORDS):
            if commands[-1]:
                commands.append([])
            continue
        commands[-1].append(token)
    return [c for c in commands if c]


def run_environments(text: str) -> list[tuple[int, str, dict[str, str]]]:
    """For each simple command of each RUN: (line of the RUN, the command, the environment it runs with)."""
    out: list[tuple[int, str, dict[str, str]]] = []
    env: dict[str, str] = {}
    global_args: dict[str, str] = {}
    in_stage = False
    for ins in instructions(text):
        if ins.keyword == "FROM":
            env, in_stage = {}, True
            continue
        if ins.keyword == "ARG":
            for word in shlex.split(ins.args, posix=True):
                name, eq, default = word.partition("=")
                if not in_stage:
                    global_args[name] = default
                elif eq or name in global_args:  # an ARG with no value anywhere stays unset
                    env.setdefault(name, expand(default, env) if eq else global_args[name])  # ENV wins
            continue
        if ins.keyword == "ENV":
            env.update(_env_pairs(ins.args, env))
            continue
        if ins.keyword != "RUN":
            continue
        args = ins.args
        while args.startswith("--"):  # RUN --mount=... --network=... cmd
            args = args.split(None, 1)[1] if " " in args else ""
        if args.startswith("["):
            words = json.loads(args)
            out.append((ins.line, " ".join(words), dict(env)))
            continue
        exported = dict(env)  # ENV and ARG values are in the environment of the RUN's shell
        shell_only: dict[str, str] = {}  # assigned but not exported: not seen by the commands it runs
        for words in _shell_commands(args):
            if words[0] == "export":
                for word in words[1:]:
                    match = ASSIGNMENT.match(word)
                    if match:
                        exported[match.group(1)] = expand(match.group(2), {**exported, **shell_only})
                    elif word in shell_only:
                        exported[word] = shell_only.pop(word)
                continue
            n = next((i for i, w in enumerate(words) if not ASSIGNMENT.match(w)), len(words))
            pairs = [ASSIGNMENT.match(w).groups() for w in words[:n]]  # type: ignore[union-attr]
            words = words[n:]
            if not words:  # bare `A=1`: the shell's variable for the rest of the RUN (exported if it was)
                for name, value in pairs:
                    value = expand(value, {**exported, **shell_only})
                    (exported if name in exported else shell_only)[name] = value
                continue
            local = dict(exported)  # `A=1 cmd`: in cmd's environment only
            for name, value in pairs:
                local[name] = expand(value, {**exported, **shell_only})
            if words[0] == "env":
                words = words[1:]
                while words and (words[0].startswith("-") or ASSIGNMENT.match(words[0])):
                    word = words.pop(0)
                    if word in ("-u", "--unset") and words:
                        local.pop(words.pop(0), None)
                    elif word.startswith("--unset="):
                        local.pop(word.split("=", 1)[1], None)
                    elif word in ("-i", "--ignore-environment", "-"):
                        local = {}
                    elif (match := ASSIGNMENT.match(word)) is not None:
                        local[match.group(1)] = expand(match.group(2), local)
            if words:
                out.append((ins.line, " ".join(words), local))
    return out


def offline_switches(env: dict[str, str]) -> tuple[str, ...]:
    return tuple(name for name in OFFLINE_SWITCHES if env.get(name, "").strip().upper() in TRUE_VALUES)


def hub_fetch_under_offline_switch(text: str) -> list[Finding]:
    """The RUN commands that fetch from a model hub while an offline switch is on."""
    return [Finding(line, command, switches) for line, command, env in run_environments(text)
            if HUB_FETCH.search(command) and (switches := offline_switches(env))]
