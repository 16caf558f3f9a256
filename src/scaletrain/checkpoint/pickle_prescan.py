"""The opcode pre-scan of DCP's `.metadata` pickle: run the pickle on a model stack, before anything is unpickled,
and refuse any opcode or state change DCP's own metadata never makes.

Resolving only allowed globals (safe_load's unpickler) is not enough: BUILD on an allowed class or function would
setattr on it for the whole process. `prescan` models what each stack entry is and lets state be set only on a
DCP metadata object the pickle itself just created. `ALLOWED` is the one list of globals DCP pickles, shared with
the unpickler and the post-load snapshot in safe_load.
"""

from __future__ import annotations

import pickle
import pickletools
from typing import Any

__all__ = ["ALLOWED", "DCP", "prescan"]

DCP = "torch.distributed.checkpoint."
# Exactly what DCP pickles into .metadata (torch 2.11-2.13; FSDP, TP, PP, LoRA and optimizer state alike), plus
# the dtypes a tensor of ours may have. pathlib moved PosixPath to pathlib._local in Python 3.13.
ALLOWED = frozenset(
    {
        (DCP + "metadata", "Metadata"),
        (DCP + "metadata", "TensorStorageMetadata"),
        (DCP + "metadata", "BytesStorageMetadata"),
        (DCP + "metadata", "ChunkStorageMetadata"),
        (DCP + "metadata", "TensorProperties"),
        (DCP + "metadata", "MetadataIndex"),
        (DCP + "metadata", "StorageMeta"),
        (DCP + "metadata", "_MEM_FORMAT_ENCODING"),
        (DCP + "filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        *(
            ("torch", dtype)
            for dtype in (
                "float32",
                "float64",
                "float16",
                "bfloat16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
                "float8_e4m3fn",
                "float8_e5m2",
            )
        ),
    }
)


# find_class alone is not enough: BUILD on an allowed *global* runs setattr on the class or function itself
# (PosixPath._str, _get_layout.cache, Metadata.__repr__), changing it for the whole process. So before anything is
# unpickled, prescan runs the opcodes on a model stack that only knows what kind of thing each entry is, and
# allows state to be set only on an instance this pickle has just created of one of these classes:
_BUILT = frozenset(
    (DCP + "metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
) | {(DCP + "filesystem", "_StorageInfo")}
# TensorProperties has its own __setstate__ (a 5-tuple); the others are dataclasses whose state is their __dict__.
_TUPLE_STATE = frozenset({(DCP + "metadata", "TensorProperties")})
# What REDUCE may call, with how many arguments (None: any). Enum lookup returns a shared member and
# _get_layout a shared layout, so their results are never fresh instances.
_CALLS = {
    ("torch", "Size"): 1,
    ("torch.serialization", "_get_layout"): 1,
    (DCP + "metadata", "_MEM_FORMAT_ENCODING"): 1,
    ("pathlib", "PosixPath"): None,
    ("pathlib._local", "PosixPath"): None,
}
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_VALUES = frozenset(
    {
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "FLOAT",
        "BINFLOAT",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
    }
)
_CONTAINER_OPS = {"APPEND": "list", "APPENDS": "list", "SETITEM": "dict", "SETITEMS": "dict", "ADDITEMS": "set"}
_MARK = ("mark", None)


def _slot(arg: object) -> int:
    """A memo slot number as genops reports it."""
    if not isinstance(arg, int):
        raise pickle.UnpicklingError(f"memo slot {arg!r} is not a number")
    return arg


def _dotted(key: object) -> str:
    return ".".join(key) if isinstance(key, tuple) else str(key)


def _describe(item: tuple[Any, ...]) -> str:
    """A model stack entry of `prescan` in words."""
    kind, detail = item[0], item[1]
    if kind == "global":
        return f"the global {_dotted(detail)}"
    if kind == "instance":
        return f"a new {_dotted(detail)}"
    if kind == "value":
        return "a shared object (a call's result or a constant)"
    return f"a {kind}"


def prescan(data: bytes) -> None:
    """Refuse (pickle.UnpicklingError) a pickle that could set state on anything but a fresh DCP metadata object.

    Every stack and memo entry is modelled as (kind, detail): ("global", (module, name)), ("instance", (module,
    name), where it was created) for an object this pickle created with NEWOBJ, ("str", text), ("tuple", length),
    a fresh "dict"/"list"/"set", or a plain "value". Each instance is built once (a second BUILD would call a
    `__setstate__` the first one put in its __dict__). Opcodes DCP never writes (INST, OBJ, NEWOBJ_EX, EXT*,
    PERSID, out-of-band buffers, memo overwrites) are refused outright, so the model cannot drift from the real
    unpickler.
    """
    stack: list[tuple[Any, ...]] = []
    memo: dict[int, tuple[Any, ...]] = {}
    built: set[int] = set()

    def pop_mark() -> list[tuple[Any, ...]]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise pickle.UnpicklingError("a collection without its MARK")

    def pop() -> tuple[Any, ...]:
        if not stack or stack[-1] is _MARK:
            raise pickle.UnpicklingError("stack underflow")
        return stack.pop()

    def top() -> tuple[Any, ...]:
        if not stack or stack[-1] is _MARK:
            raise pickle.UnpicklingError("stack underflow")
        return stack[-1]

    def put(index: int) -> None:
        # Pickle numbers memo slots 0, 1, 2, ...: a reused slot could alias a global with an instance, and a far
        # one makes the unpickler allocate the memo up to it (LONG_BINPUT 2**32-1: tens of GB).
        if index != len(memo):
            raise pickle.UnpicklingError(f"memo slot {index} written out of order (next is {len(memo)})")
        memo[index] = top()

    def global_(module: object, name: object) -> tuple[Any, ...]:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")
        return ("global", (module, name))

    for op, arg, pos in pickletools.genops(data):
        name = op.name
        where = f"{name} at byte {pos}"
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            pop()
            if stack:
                raise pickle.UnpicklingError(f"{where} leaves {len(stack)} objects behind")
            return
        if name in _STRINGS:
            stack.append(("str", arg))
        elif name in _VALUES:
            stack.append(("value", None))
        elif name == "EMPTY_TUPLE":
            stack.append(("tuple", 0))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            for _ in range(int(name[-1])):
                pop()
            stack.append(("tuple", int(name[-1])))
        elif name == "TUPLE":
            stack.append(("tuple", len(pop_mark())))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            stack.append((name[6:].lower(), None))
        elif name in ("LIST", "DICT"):
            pop_mark()
            stack.append((name.lower(), None))
        elif name == "FROZENSET":
            pop_mark()
            stack.append(("value", None))
        elif name in _CONTAINER_OPS:
            if name in ("APPEND", "SETITEM"):
                for _ in range(1 if name == "APPEND" else 2):
                    pop()
            else:
                pop_mark()
            # On anything but a container made here, these call __setitem__/append/extend/add of that object.
            if top()[0] != _CONTAINER_OPS[name]:
                raise pickle.UnpicklingError(f"{where} targets {_describe(top())}, not a {_CONTAINER_OPS[name]}")
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "POP":
            pop()
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(top())
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            put(_slot(arg))
        elif name == "MEMOIZE":
            put(len(memo))
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if _slot(arg) not in memo:
                raise pickle.UnpicklingError(f"{where} reads memo slot {arg}, never written")
            stack.append(memo[_slot(arg)])
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(global_(module, attr))
        elif name == "STACK_GLOBAL":
            name_item, module_item = pop(), pop()
            if name_item[0] != "str" or module_item[0] != "str":
                raise pickle.UnpicklingError(f"{where} names a global with a computed name")
            stack.append(global_(module_item[1], name_item[1]))
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = pop(), pop()
            if args[0] != "tuple":
                raise pickle.UnpicklingError(f"{where} passes a {args[0]} as arguments")
            if name == "NEWOBJ":
                if func[0] != "global" or func[1] not in _BUILT:
                    raise pickle.UnpicklingError(f"{where} creates {_describe(func)}, not a DCP metadata object")
                stack.append(("instance", func[1], pos))
                continue
            if func[0] != "global" or func[1] not in _CALLS:
                raise pickle.UnpicklingError(f"{where} calls {_describe(func)}, which DCP metadata never calls")
            arity = _CALLS[func[1]]
            if arity is not None and args[1] != arity:
                raise pickle.UnpicklingError(f"{where} calls {_dotted(func[1])} with {args[1]} arguments, not {arity}")
            stack.append(("value", None))
        elif name == "BUILD":
            state, target = pop(), top()
            if target[0] != "instance":
                # The finding this guards: BUILD on a class or function (fetched directly or from the memo).
                raise pickle.UnpicklingError(f"{where} sets state on {_describe(target)}, not on an object it created")
            if target[2] in built:
                raise pickle.UnpicklingError(f"{where} sets the state of a {_dotted(target[1])} a second time")
            built.add(target[2])
            want = "tuple" if target[1] in _TUPLE_STATE else "dict"
            if state[0] != want:
                raise pickle.UnpicklingError(
                    f"{where} sets a {_dotted(target[1])} from {_describe(state)}, not a {want}"
                )
        else:  # INST, OBJ, NEWOBJ_EX, EXT1/2/4, PERSID, BINPERSID, NEXT_BUFFER, READONLY_BUFFER, anything newer
            raise pickle.UnpicklingError(f"opcode {where}, which DCP metadata never uses")
    raise pickle.UnpicklingError("no STOP opcode")
