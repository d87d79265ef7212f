"""How vLLM reads a `vllm serve` argument, so that a flag the operator manages or its policy
denies is found in every spelling vLLM accepts. Pure.

vLLM's FlexibleArgumentParser (vllm/utils/argparse_utils.py) rewrites each `--` argument before
argparse sees it: `_` becomes `-` in the name (`--trust_remote_code`), `--name=value` carries
its value, and `--name.key value` sets a key of the JSON flag `--name`. argparse then accepts an
unambiguous prefix of a flag (allow_abbrev, which vLLM leaves on): `--trust-remote` is
`--trust-remote-code`, `-t` is `-tp`. So an argument names a listed flag when its name, as
rewritten, is that flag or a proper prefix of it. No vLLM 0.32.0 flag is a proper prefix of a
flag the operator lists (its 347 option strings, checked), so refusing prefixes refuses no
other flag; a prefix shared by several flags is one argparse refuses itself (ambiguous).

`--config FILE` reads more flags from a YAML file in the pod (its keys are flags too), which
the operator cannot read: validation refuses it in every spelling.
"""

from __future__ import annotations

from collections.abc import Iterable

CONFIG_FLAG = "--config"


def flag_name(arg: str) -> str | None:
    """The flag `arg` names as vLLM rewrites it (`--Hf_token=x` -> `--Hf-token`), or None when
    it is no flag (a value, `-` or `--`)."""
    if arg.startswith("--"):
        name = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        return "--" + name if name else None
    if arg.startswith("-") and len(arg) > 1:
        return arg.split("=", 1)[0].split(".", 1)[0]
    return None


def listed_flag(arg: str, flags: Iterable[str]) -> str | None:
    """The flag of `flags` that `arg` names in any spelling vLLM accepts: exactly, with '_'
    for '-', with `=value` or `.key`, or abbreviated; None when it names none of them."""
    name = flag_name(arg)
    if name is None:
        return None
    flags = list(flags)
    if name in flags:
        return name
    long_name = name.startswith("--")
    for flag in flags:
        if flag.startswith(name) and flag.startswith("--") == long_name:
            return flag
    return None


def spelled(arg: str, flag: str) -> str:
    """How a message names the flag `arg` names: the flag, or what was written and what vLLM
    reads it as."""
    written = arg.split("=", 1)[0]
    return flag if written == flag else f"{written} (to vLLM: {flag})"
