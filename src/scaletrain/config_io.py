"""Reading configuration dataclasses from TOML: presets, files (TOML, or a run's config.json), --set overrides,
field docstrings.

Generic over any tree of dataclasses, so it knows nothing of `Config`'s fields; `scaletrain.config` builds the one
Config with it and re-exports what callers use (`list_presets`, `parse_override`, `ConfigError`). Stdlib only.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import math
import os
import re
import stat
import sys
import textwrap
from dataclasses import fields
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value, preset or override is wrong; the message names the field."""


def list_presets() -> list[str]:
    """Names of the TOML presets shipped in the package."""
    files = resources.files("scaletrain.presets").iterdir()
    return sorted(p.name[:-5] for p in files if p.name.endswith(".toml"))


TEXT_FILE_MAX = 16 * 2**20
"""Largest config or catalog file read: such files are a few kB; a bigger one is the wrong file."""


def read_text_file(path: str | os.PathLike, what: str, error: type[ValueError] = ConfigError) -> str:
    """The UTF-8 text of a small config-like file; `error` (ConfigError) with one line naming `what` (e.g.
    "--config FILE") when it is missing, not a regular file, unreadable, too large, binary or empty.

    A FIFO or device would block or never end, so only regular files are opened.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as exc:
        raise error(f"{what}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{what}: is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what}: not a regular file")
    if info.st_size > TEXT_FILE_MAX:
        raise error(f"{what}: {info.st_size} bytes, more than the {TEXT_FILE_MAX} a config file may have")
    try:
        with open(path, "rb") as fh:
            data = fh.read(TEXT_FILE_MAX + 1)
    except OSError as exc:
        raise error(f"{what}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not a UTF-8 text file (byte {exc.start} is 0x{data[exc.start]:02x})") from None
    if "\x00" in text:
        raise error(f"{what}: not a text file (it holds NUL bytes)")
    if not text.strip():
        raise error(f"{what}: the file is empty")
    return text


def load_toml(text: str, where: str) -> dict[str, Any]:
    """The table of TOML `text`; ConfigError naming `where` when it does not parse."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"{where}: not valid TOML: nested too deeply") from None


def load_config_file(text: str, where: str) -> dict[str, Any]:
    """The table of a config file: JSON when `where` ends in .json (a run directory's config.json, the resolved
    config a run wrote), TOML otherwise; ConfigError naming `where` when it does not parse."""
    if not where.endswith(".json"):
        return load_toml(text, where)
    table = loads_bounded(text, where)
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: a config is a JSON object of sections, got {type(table).__name__}")
    return table


# ---------------------------------------------------------------- JSON from files nobody vouches for
MAX_JSON_DEPTH = 64
"""Nesting a JSON file read from a run or Hugging Face directory may have: theirs is 3 or 4 deep. The stdlib parser
recurses once per level, so a 10^5-deep file is a RecursionError (a traceback) without a bound checked first."""
MAX_JSON_BYTES = 64 << 20
"""Size such a JSON file may have (a sharded index of a 100k-tensor model is ~10 MB)."""


class FileFormatError(ConfigError):
    """A file read as untrusted data (a run directory's or a Hugging Face directory's JSON) does not parse, is too
    deep or too big, is not a regular file, or holds a value of the wrong type or range; the message is one line
    naming the file."""


def _json_depth_over(text: str, max_depth: int) -> bool:
    """Whether JSON `text` opens more than `max_depth` levels (brackets inside strings do not count). No Python
    loop per character: strings cut by a regular expression, the rest reduced to its brackets by bytes.translate,
    the running depth by accumulate (~1 s for 20 MB of brackets)."""
    if text.count("[") + text.count("{") <= max_depth:  # the common case: cannot be that deep
        return False
    brackets = _JSON_STRING.sub("", text).encode("utf-8", "replace").translate(None, _ALL_BUT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > max_depth


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_ALL_BUT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))


def loads_bounded(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON `text` parsed, refused (FileFormatError naming `where`, one line) when it is not JSON, not UTF-8 or
    nests deeper than `max_depth`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileFormatError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    if _json_depth_over(text, max_depth):
        raise FileFormatError(f"{where}: JSON nested more than {max_depth} levels deep; refusing to parse it")
    try:
        return json.loads(text)
    except RecursionError:  # unreachable after the depth check; kept so no input can make a traceback
        raise FileFormatError(f"{where}: JSON nested too deep") from None
    except ValueError as exc:  # JSONDecodeError, and ints longer than sys.get_int_max_str_digits()
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FileFormatError(f"{where}: not valid JSON: {msg}") from None


def read_bytes_bounded(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of regular file `path`, at most `max_bytes` of them; FileNotFoundError when it is missing,
    FileFormatError (one line naming it) when it is not a regular file (a FIFO would block the read forever, a
    device never end), is larger or cannot be read."""
    try:
        # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, before fstat can tell what it is.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileFormatError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise FileFormatError(f"{path}: {st.st_size} bytes, more than the {max_bytes} this file may have")
        chunks, size = [], 0
        while size <= max_bytes:  # the file may grow while it is read: never more than the bound
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise FileFormatError(f"{path}: more than the {max_bytes} bytes this file may have")
    return b"".join(chunks)


def load_json_bounded(path: str | os.PathLike, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The parsed JSON of file `path`, read as untrusted data: FileNotFoundError when missing, FileFormatError
    (one line naming the file) when it is not a regular file, over `max_bytes`, not UTF-8, not JSON or nested
    deeper than `max_depth`."""
    return loads_bounded(read_bytes_bounded(path, max_bytes), str(path), max_depth)


def preset_dict(name: str) -> dict[str, Any]:
    """The raw TOML table of preset `name`."""
    if name not in list_presets():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    text = resources.files("scaletrain.presets").joinpath(f"{name}.toml").read_text()
    return load_toml(text, f"preset {name}")


def merge(cfg: Any, table: dict[str, Any], where: str, prefix: str = "") -> None:
    """Set the fields of dataclass `cfg` named in `table` (nested tables: sections); ConfigError on an unknown
    field or a value of the wrong type, naming `where`."""
    known = {f.name: f for f in fields(cfg)}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{where}: unknown field {path!r}; known: {', '.join(known)}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {path!r} is a section, got {value!r}")
            merge(current, value, where, path + ".")
        else:
            setattr(cfg, key, _coerce(value, current, path, where, str(known[key].type)))


INT_OR_AUTO = frozenset({"checkpoint.interval_steps"})
"""Integer fields that also take the word "auto" (the trainer computes the value when the run starts)."""


def _coerce(value: Any, current: Any, path: str, where: str, annotation: str = "") -> Any:
    if path in INT_OR_AUTO:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return _coerce(value, 0, "", where)
        except ConfigError:
            raise ConfigError(f"{where}: {path}={value!r} is not a valid int or 'auto'") from None
    kind = type(current)
    if kind is list and annotation == "list[int]":
        return _int_list(value, path, where)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else _bad(path, value, kind, where)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        return str(value)
    elif kind is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str):
            # --set lora.targets=qkv,proj
            return [v.strip() for v in value.strip("[]").replace("'", "").replace('"', "").split(",") if v.strip()]
    return _bad(path, value, kind, where)


def _int_list(value: Any, path: str, where: str) -> list[int]:
    """A list of integers from TOML's list, `--set K=[3,4]` (a list), `--set K=3,4` (a tuple) or `--set K=3` (one
    int); ConfigError naming the entry that is not an integer."""
    if isinstance(value, str):
        value = [v.strip() for v in value.strip("[]()").split(",") if v.strip()]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        _bad(path, value, list, where)
    out = []
    for v in value:
        if isinstance(v, str) and v.lstrip("-").isdecimal():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{where}: {path}={list(value)!r}: {v!r} is not an integer")
        out.append(v)
    return out


def _bad(path: str, value: Any, kind: type, where: str):
    raise ConfigError(f"{where}: {path}={value!r} is not a valid {kind.__name__}")


def parse_override(text: str) -> tuple[str, Any]:
    """Split 'a.b=c' into ('a.b', c) with c read as a Python/TOML literal when possible."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. train.seed=7")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key, value


def nest(key: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for key "a.b"."""
    out: dict[str, Any] = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def describe(cls: type, prefix: str = "", values: Any = None) -> list[tuple[str, str, str]]:
    """(dotted name, value, docstring) for every field, read from the field docstrings in the source of `cls`.

    The value is the dataclass default, or the field's value in `values` (a resolved Config) when given.
    """
    docs = field_docs(cls)
    rows = []
    for f in fields(cls):
        if values is not None:
            value = getattr(values, f.name)
        else:
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), f"{prefix}{f.name}.", value if values is not None else None))
        else:
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal under its annotation in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node0 = tree.body[0]
    if not isinstance(node0, ast.ClassDef):
        raise TypeError(f"{cls!r}: source does not start with its class statement")
    body = node0.body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value
    return docs


def nonfinite(section: Any, prefix: str = ""):
    """Every float field that is NaN or infinite: NaN passes every `<= 0` range check below, so catch it first."""
    for f in fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from nonfinite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            yield f"{prefix}{f.name}={value}: must be a finite number"


# ---------------------------------------------------------------- --section.field flags of the CLI
_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def field_kinds(section: Any, prefix: str = "") -> dict[str, type]:
    """Dotted field name -> type of its default, for every field of every section of a config dataclass instance."""
    kinds: dict[str, type] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            kinds.update(field_kinds(value, f"{prefix}{f.name}."))
        else:
            kinds[f"{prefix}{f.name}"] = type(value)
    return kinds


def expand_field_flags(argv: list[str], root: Any) -> list[str]:
    """CLI argv: turn `--section.field VALUE` and `--section.field=VALUE` into `--set section.field=VALUE`.

    So `torchrun ... -m scaletrain train --parallel.tp 2` reads like any other flag. Every section of `root` (a
    Config) works; a boolean field given alone (`--train.compile`) means true, and takes the next
    argument only when that is a boolean word, so it never swallows the next flag.
    """
    kinds = field_kinds(root)
    sections = {name.split(".", 1)[0] for name in kinds if "." in name}
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        head = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in head and head.split(".", 1)[0] in sections:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if "=" in arg:
                out += ["--set", arg[2:]]
            elif kinds.get(head) is bool and (nxt is None or nxt.lower() not in _BOOL_WORDS):
                out += ["--set", f"{head}=true"]
            elif nxt is not None and not nxt.startswith("--"):
                out += ["--set", f"{head}={nxt}"]
                i += 1
            else:
                raise ConfigError(f"{arg}: missing value")
        else:
            out.append(arg)
        i += 1
    return out
