"""A crafted `.metadata` must not change this process (issue 25, finding 1), nor resume a half-loaded optimizer.

The allowlist unpickler once checked globals only: a BUILD opcode on an allowed class or function ran setattr on
it, for the whole process. `PosixPath._str` made every Path name the attacker's file, which the run lock's release
then deleted; `_get_layout.cache` made `torch.strided` resolve to `torch.float32`. Each gadget below is planted in
a real checkpoint (the attacker fixes the manifest too) and loaded in a process of its own (a fork, or the CLI in
a subprocess): the load must fail with one line naming `.metadata`, and nothing outside the checkpoint may change.
`test_gadgets_are_live` proves that each gadget does change the process when unpickled by find_class alone.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import shutil
import sys

import pytest
import torch
from test_train_e2e import tiny_config, tiny_overrides

from scaletrain.checkpoint.store import CheckpointError, sha256
from scaletrain.cli.main import main
from scaletrain.train.engine import Trainer

pytestmark = pytest.mark.hostile

_DCP = "torch.distributed.checkpoint."
_MD = _DCP + "metadata"
STEP = 2


@pytest.fixture(scope="module")
def saved(excerpt_corpus, tmp_path_factory):
    """A run directory with one complete checkpoint at step 2 (Adam state for every parameter)."""
    run = tmp_path_factory.mktemp("mutation") / "run"
    trainer = Trainer(tiny_config(excerpt_corpus, run, "checkpoint.keep=0"), run)
    trainer.init()
    for _ in range(STEP):
        trainer.train_step()
    trainer.save_checkpoint({})
    trainer.finish({})
    return run


def _ckpt(run):
    return run / "checkpoints" / f"step_{STEP:08d}"


def _rehash(ckpt, *names):
    """What an attacker does after editing files: make the manifest match them again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in names:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": sha256(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- gadgets, written opcode by opcode
def _text(s: str) -> bytes:
    b = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b


def _stack_global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _global_op(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _dict(*pairs: tuple[bytes, bytes]) -> bytes:
    return pickle.EMPTY_DICT + b"".join(pickle.MARK + k + v + pickle.SETITEMS for k, v in pairs)


def _memo_slot(original: bytes, module: str, name: str) -> int:
    """The memo slot where the real metadata keeps the global module.name (DCP memoizes every object).

    The module is usually fetched from the memo too, so the global is known by its name (unique in DCP's list).
    """
    slots, last, want = 0, None, False
    for op, arg, _ in pickletools.genops(original):
        if op.name == "MEMOIZE":
            if want:
                return slots
            slots += 1
        elif op.name == "SHORT_BINUNICODE":
            last = arg
        elif op.name == "STACK_GLOBAL":
            want = last == name
    raise AssertionError(f"{module}.{name} is not in the metadata")


def _push(original: bytes, module: str, name: str, how: str) -> bytes:
    """Opcodes that leave the global module.name on the stack, fetched `how`."""
    if how == "stack_global":
        return _stack_global(module, name)
    if how == "global_op":
        return _global_op(module, name)
    if how == "own_memo":  # memoized, dropped, fetched back: a BUILD target that no GLOBAL precedes directly
        slot = sum(op.name == "MEMOIZE" for op, _, _ in pickletools.genops(original)).to_bytes(4, "little")
        return _stack_global(module, name) + pickle.LONG_BINPUT + slot + pickle.POP + pickle.LONG_BINGET + slot
    if how == "dup":
        return _stack_global(module, name) + pickle.DUP + pickle.POP
    if how == "metadata_memo":  # the metadata's own memoized global, with no global named in the gadget at all
        return pickle.LONG_BINGET + _memo_slot(original, module, name).to_bytes(4, "little")
    raise ValueError(how)


def _slotstate(attrs: bytes, form: str) -> bytes:
    """BUILD's (state, slotstate) argument: the unpickler runs setattr(target, k, v) for each slotstate item."""
    return (pickle.NONE if form == "none" else pickle.EMPTY_DICT) + attrs + pickle.TUPLE2


def _gadget(original: bytes, precious: str, case: str) -> bytes:
    """The opcodes of one case: push a target, BUILD state onto it, leave the stack as it was."""
    target, _, how = case.partition("/")
    how, _, form = how.partition("/")
    layout = ("torch.serialization", "_get_layout")
    if target == "posix_str":
        state = _slotstate(_dict((_text("_str"), _text(precious))), form)
        return _push(original, "pathlib", "PosixPath", how) + state + pickle.BUILD
    if target == "posix_fspath":
        state = _slotstate(_dict((_text("__fspath__"), _stack_global(*layout))), form)
        return _push(original, "pathlib", "PosixPath", how) + state + pickle.BUILD
    if target.startswith("repr_"):  # a DCP metadata class: every repr of it now calls _get_layout
        state = _slotstate(_dict((_text("__repr__"), _stack_global(*layout))), form)
        return _push(original, _MD if target != "repr__StorageInfo" else _DCP + "filesystem", target[5:], how) + (
            state + pickle.BUILD
        )
    if target == "layout_cache":  # a function's state is its __dict__: torch.strided now resolves to float32
        cache = _dict((_text("cache"), _dict((_text("torch.strided"), _stack_global("torch", "float32")))))
        return _push(original, *layout, how) + cache + pickle.BUILD
    if target == "layout_defaults":
        state = _slotstate(_dict((_text("__defaults__"), _text("torch.strided") + pickle.TUPLE1)), form)
        return _push(original, *layout, how) + state + pickle.BUILD
    if target == "enum_class":
        state = _slotstate(_dict((_text("_missing_"), _stack_global(*layout))), form)
        return _push(original, _MD, "_MEM_FORMAT_ENCODING", how) + state + pickle.BUILD
    if target == "enum_member":  # a lookup returns the shared member: BUILD rewrites its value for everyone
        member = _push(original, _MD, "_MEM_FORMAT_ENCODING", how) + pickle.BININT1 + b"\x00" + pickle.TUPLE1
        return member + pickle.REDUCE + _dict((_text("_value_"), pickle.BININT1 + b"\x07")) + pickle.BUILD
    raise ValueError(case)


def plant(ckpt, precious, case: str, where: str = "end") -> None:
    """Put gadget `case` into ckpt/.metadata: before its STOP ("end": the metadata still loads) or "alone"."""
    original = (ckpt / ".metadata").read_bytes()
    gadget = _gadget(original if where == "end" else pickle.PROTO + b"\x04" + pickle.STOP, str(precious), case)
    if where == "alone":
        data = pickle.PROTO + b"\x04" + gadget + pickle.STOP
    else:
        # Frames only tell the reader how much to buffer; dropped, so the gadget can go anywhere.
        frames = [pos for op, _, pos in pickletools.genops(original) if op.name == "FRAME"]
        body = bytearray(original)
        for pos in reversed(frames):
            del body[pos : pos + 9]
        assert body[-1:] == pickle.STOP
        data = bytes(body[:-1]) + gadget + pickle.POP + pickle.STOP
    (ckpt / ".metadata").write_bytes(data)
    _rehash(ckpt, ".metadata")


_HOWS = ("stack_global", "global_op", "own_memo", "dup")
_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_StorageInfo",
)
CASES = [
    *(f"posix_str/{how}/{form}" for how in (*_HOWS, "metadata_memo") for form in ("none", "dict")),
    "posix_fspath/stack_global/none",
    # TensorProperties is left out: its own __setstate__ takes BUILD's state, so BUILD cannot setattr on it.
    *(f"repr_{cls}/stack_global/none" for cls in _METADATA_CLASSES if cls != "TensorProperties"),
    "repr_Metadata/metadata_memo/dict",
    "repr_TensorStorageMetadata/own_memo/none",
    *(f"layout_cache/{how}" for how in (*_HOWS, "metadata_memo")),
    "layout_defaults/stack_global/none",
    "layout_defaults/dup/dict",
    "enum_class/stack_global/none",
    "enum_member/stack_global",
    "enum_member/metadata_memo",
]


# ---------------------------------------------------------------- what must not change
_PROBE = """
import pathlib, torch, torch.serialization as ser
from torch.distributed.checkpoint import filesystem as fs, metadata as md
classes = [getattr(md, n) for n in {classes!r} if hasattr(md, n)] + [fs._StorageInfo, pathlib.PosixPath,
           md._MEM_FORMAT_ENCODING]
probe = {{
    "path": lambda: str(pathlib.Path("/a/b")) + " " + repr(pathlib.Path("/a/b")),
    "strided": lambda: str(ser._get_layout("torch.strided")),
    "layout": lambda: sorted((k, str(v)) for k, v in ser._get_layout.cache.items()),
    "layout_fn": lambda: [repr(ser._get_layout.__defaults__), sorted(ser._get_layout.__dict__)],
    "classes": lambda: [[c.__name__, sorted((k, id(v)) for k, v in vars(c).items())] for c in classes],
    "repr": lambda: repr(md.Metadata(state_dict_metadata={{}})),
    "enum": lambda: [[m._name_, m._value_] for m in md._MEM_FORMAT_ENCODING],
}}
"""


def _probe() -> dict:
    """What a crafted pickle could change about this process, as plain data (compared before and after)."""
    scope: dict = {}
    exec(_PROBE.format(classes=list(_METADATA_CLASSES)), scope)
    out = {}
    for name, fn in scope["probe"].items():
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a probe that now fails is a change too
            out[name] = repr(exc)
    return out


def _in_fork(fn, *args, timeout=60.0):
    """fn(*args) (returning JSON data) in a forked child: whatever it does to its process dies with it."""
    import select
    import time

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            out = json.dumps(fn(*args)).encode()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, whatever it is
            out, code = json.dumps({"child error": repr(exc)}).encode(), 1
        with os.fdopen(write, "wb") as f:
            f.write(out)
        os._exit(code)
    os.close(write)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(read, "rb") as f:
        while time.monotonic() < deadline:
            if select.select([f], [], [], 1.0)[0]:
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            os.kill(pid, 9)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"child error": "timed out"}')


def _load_and_probe(ckpt: str, precious: str) -> dict:
    from pathlib import Path

    from scaletrain.checkpoint.safe_load import read_metadata

    before = _probe()
    try:
        read_metadata(Path(ckpt))
        outcome = "loaded"
    except CheckpointError as exc:
        outcome = str(exc)
    return {"outcome": outcome, "before": before, "after": _probe(), "precious": Path(precious).is_file()}


@pytest.fixture
def ckpt_copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for name in (".metadata", "manifest.json"):  # all that read_metadata and plant touch
        shutil.copy(_ckpt(saved) / name, dst / name)
    precious = tmp_path / "PRECIOUS.txt"
    precious.write_text("keep me")
    return dst, precious


@pytest.mark.parametrize(
    "case,where",
    [
        *((case, "end") for case in CASES),
        # Alone, the pickle's result is the mutated global itself (no metadata memo to fetch from).
        *((case, "alone") for case in CASES if "/metadata_memo" not in case),
    ],
)
def test_metadata_gadget_is_refused_and_changes_nothing(case, where, ckpt_copy):
    ckpt, precious = ckpt_copy
    plant(ckpt, precious, case, where)
    got = _in_fork(_load_and_probe, str(ckpt), str(precious))
    assert "child error" not in got, got
    assert got["after"] == got["before"], f"{case} changed the process"
    assert got["precious"]
    msg = got["outcome"]
    assert msg.startswith(f"{ckpt / '.metadata'}: not DCP metadata (") and "\n" not in msg, msg
    assert "BUILD at byte" in msg, msg  # refused by the pre-scan, before anything was unpickled


def _load_unscanned(ckpt: str, precious: str) -> dict:
    """_load_and_probe with the pre-scan switched off: the post-load check alone must catch and undo the change."""
    from scaletrain.checkpoint import safe_load

    safe_load.prescan = lambda data: None
    return _load_and_probe(ckpt, precious)


@pytest.mark.parametrize("case", CASES)
def test_post_load_check_restores_what_the_prescan_would_have_refused(case, ckpt_copy):
    """Belt and braces: were the pre-scan to miss a gadget, the change is undone and the load refused."""
    ckpt, precious = ckpt_copy
    plant(ckpt, precious, case)
    got = _in_fork(_load_unscanned, str(ckpt), str(precious))
    assert "child error" not in got, got
    assert got["after"] == got["before"], f"{case}: not restored"
    assert got["precious"]
    msg = got["outcome"]
    assert msg.startswith(f"{ckpt / '.metadata'}: not DCP metadata (loading it changed ") and msg.endswith(
        "; restored)"
    ), msg


def test_gadgets_are_live(saved, tmp_path):
    """find_class alone lets each gadget through and it changes the process: the test above can fail."""
    from scaletrain.checkpoint.safe_load import _MetadataOnly

    def unguarded(ckpt: str) -> dict:
        import io

        before = _probe()
        try:
            _MetadataOnly(io.BytesIO((tmp_path / ckpt / ".metadata").read_bytes())).load()
        except Exception:  # noqa: BLE001 - the change, if any, is made before a later opcode fails
            pass
        return {"changed": _probe() != before}

    for i, case in enumerate(CASES):
        ckpt = tmp_path / f"c{i}"
        ckpt.mkdir()
        for name in (".metadata", "manifest.json"):
            shutil.copy(_ckpt(saved) / name, ckpt / name)
        plant(ckpt, tmp_path / "PRECIOUS.txt", case)
        assert _in_fork(unguarded, ckpt.name) == {"changed": True}, case


# ---------------------------------------------------------------- well-formed, yet not what DCP writes
def _tail(extra: bytes):
    """Opcodes run on the finished Metadata (top of the stack) just before STOP."""

    def edit(ckpt):
        body = bytearray((ckpt / ".metadata").read_bytes())
        for pos in reversed([p for op, _, p in pickletools.genops(bytes(body)) if op.name == "FRAME"]):
            del body[pos : pos + 9]
        (ckpt / ".metadata").write_bytes(bytes(body[:-1]) + extra + pickle.STOP)

    return edit


def _objects(change):
    """Re-pickle the real metadata after `change(md)`: DCP classes only, so find_class alone lets it through."""

    def edit(ckpt):
        from scaletrain.checkpoint.safe_load import read_metadata

        md = read_metadata(ckpt)
        change(md)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))

    return edit


def _first_entry(md):
    return next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))


WELL_FORMED = {
    # A second BUILD on one object calls the __setstate__ the first one planted in its __dict__.
    "second_build_calls_planted_setstate": (
        _tail(_dict((_text("__setstate__"), _stack_global("torch", "Size"))) + pickle.BUILD + _dict() + pickle.BUILD),
        "sets the state of a torch.distributed.checkpoint.metadata.Metadata a second time",
    ),
    # Harmless here (8 MiB), but slot 2**32-1 would make the unpickler allocate and clear a 32 GiB memo.
    "memo_slot_far_away": (
        _tail(pickle.NONE + pickle.LONG_BINPUT + (1 << 20).to_bytes(4, "little") + pickle.POP),
        "memo slot 1048576 written out of order",
    ),
    "planted_setstate_on_an_entry": (
        _objects(lambda md: setattr(_first_entry(md), "__setstate__", torch.Size)),
        "TensorStorageMetadata.__setstate__ is not a field of its class",
    ),
    "undeclared_attribute_on_a_chunk": (
        _objects(lambda md: setattr(_first_entry(md).chunks[0], "offsets_", 0)),
        "ChunkStorageMetadata.offsets_ is not a field of its class",
    ),
    "storage_meta_is_a_path": (
        _objects(lambda md: setattr(md, "storage_meta", md.storage_meta.checkpoint_id)),
        "storage_meta is a PosixPath",
    ),
    "storage_data_keyed_by_text": (
        _objects(lambda md: setattr(md, "storage_data", {i.fqn: v for i, v in md.storage_data.items()})),
        "storage_data is not keyed by MetadataIndex",
    ),
    "chunk_offsets_not_sizes": (
        _objects(lambda md: setattr(_first_entry(md).chunks[0], "offsets", [0, 0])),
        "has malformed properties or chunks",
    ),
    "dtype_is_a_layout": (
        _objects(lambda md: setattr(_first_entry(md).properties, "dtype", torch.strided)),
        "has malformed properties or chunks",
    ),
}


@pytest.mark.parametrize("case", list(WELL_FORMED))
def test_well_formed_but_foreign_metadata_is_refused(case, ckpt_copy):
    """Each of these once passed read_metadata; nothing here can change the process, so no fork is needed."""
    from scaletrain.checkpoint.safe_load import read_metadata

    ckpt, _ = ckpt_copy
    edit, needle = WELL_FORMED[case]
    edit(ckpt)
    with pytest.raises(CheckpointError) as err:
        read_metadata(ckpt)
    msg = str(err.value)
    assert msg.startswith(f"{ckpt / '.metadata'}: not DCP metadata (") and needle in msg and "\n" not in msg, msg


# ---------------------------------------------------------------- through the CLI, each in its own process
def _cli(args: list[str], errfile: str) -> dict:
    """`scaletrain ARGS` in this (forked) process, its stderr in `errfile`; exit code and whether it changed us."""
    from scaletrain.cli.main import main as cli_main

    before = _probe()
    with open(errfile, "w") as err:
        os.dup2(err.fileno(), 2)
        sys.stderr = err
        code = cli_main(args)
        sys.stderr.flush()
    return {"code": code, "same": _probe() == before}


def _train_args(loader, corpus, run, ckpt, tmp_path):
    over = [a for o in [*tiny_overrides(corpus), "train.max_steps=3"] for a in ("--set", o)]
    if loader == "resume":
        return ["train", "--resume", str(ckpt), "--run-dir", str(tmp_path / "new"), *over]
    if loader == "resume_auto":
        (run / "result.json").unlink(missing_ok=True)  # as after a kill: the run is unfinished
        return ["train", "--resume", "auto", "--run-dir", str(run), *over]
    return ["train", "--set", f"checkpoint.init_from={ckpt}", "--run-dir", str(tmp_path / "new"), *over]


@pytest.mark.parametrize(
    "case", ["posix_str/metadata_memo/dict", "layout_cache/stack_global", "repr_Metadata/own_memo/none"]
)
@pytest.mark.parametrize("loader", ["resume", "resume_auto", "init_from"])
def test_cli_refuses_the_gadget_and_the_lock_release_deletes_nothing(loader, case, excerpt_corpus, saved, tmp_path):
    """The finding as reported: through the CLI, the run lock's release used to unlink the attacker's file."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt, precious = _ckpt(run), tmp_path / "PRECIOUS.txt"
    precious.write_text("keep me")
    plant(ckpt, precious, case)
    errfile = tmp_path / "stderr"
    result = _in_fork(_cli, _train_args(loader, excerpt_corpus, run, ckpt, tmp_path), str(errfile), timeout=120)
    assert precious.is_file() and precious.read_text() == "keep me", f"{loader}: the attacker's file was deleted"
    err = errfile.read_text().strip().splitlines()
    assert result == {"code": 2, "same": True}, (result, err[-5:])
    assert len(err) == 1 and err[0].startswith(f"scaletrain: error: {ckpt / '.metadata'}: not DCP metadata"), err


# ---------------------------------------------------------------- entries of the wrong kind: no silent fresh state
_QKV = "optim.state.blocks.0.attn.qkv.weight."


def _edit_metadata(ckpt, edit) -> None:
    from scaletrain.checkpoint.safe_load import read_metadata

    md = read_metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))  # DCP classes only: passes the unpickler
    _rehash(ckpt, ".metadata")


def _as_bytes(key):
    """Retype a tensor entry as BYTE_IO whose blob is that very tensor: DCP used to load it beside the optimizer."""

    def edit(md):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        index = next(i for i in md.storage_data if i.fqn == key)
        md.state_dict_metadata[key] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(key)] = md.storage_data.pop(index)

    return edit


def _drop(key):
    def edit(md):
        del md.state_dict_metadata[key]
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]

    return edit


def _as_tensor(key):
    def edit(md):
        md.state_dict_metadata[key] = md.state_dict_metadata[_QKV + "step"]

    return edit


def _resize(key, size, chunk=None):
    def edit(md):
        entry = md.state_dict_metadata[key]
        entry.size = torch.Size(size)
        entry.chunks[0].sizes = torch.Size(chunk or size)

    return edit


def _retype_dtype(key, dtype):
    def edit(md):
        md.state_dict_metadata[key].properties.dtype = dtype

    return edit


RETYPES = {
    "exp_avg_as_bytes": (
        _as_bytes(_QKV + "exp_avg"),
        "'optim.state.blocks.0.attn.qkv.weight.exp_avg' is saved as "
        "bytes, not as the [192, 64] float32 tensor this optimizer holds",
    ),
    "step_as_bytes": (_as_bytes(_QKV + "step"), "'optim.state.blocks.0.attn.qkv.weight.step' is saved as bytes"),
    "exp_avg_sq_as_bytes": (_as_bytes("optim.state.embed.tok.weight.exp_avg_sq"), "is saved as bytes"),
    "model_weight_as_bytes": (_as_bytes("model.blocks.1.mlp.fc.weight"), "is saved as bytes"),
    "missing_exp_avg": (
        _drop(_QKV + "exp_avg"),
        "no entry 'optim.state.blocks.0.attn.qkv.weight.exp_avg', which this optimizer holds",
    ),
    "missing_step": (_drop("optim.state.head.weight.step"), "no entry 'optim.state.head.weight.step'"),
    "missing_lr": (_drop("optim.param_groups.blocks.0.attn.qkv.weight.lr"), "no entry 'optim.param_groups"),
    "lr_as_tensor": (
        _as_tensor("optim.param_groups.blocks.0.attn.qkv.weight.lr"),
        "is saved as a tensor, this optimizer holds a float",
    ),
    "exp_avg_wrong_shape": (_resize(_QKV + "exp_avg", [192, 32]), "has shape [192, 32], not that of the [192, 64]"),
    "step_wrong_shape": (_resize(_QKV + "step", [1]), "has shape [1], not that of the [] float32"),
    "exp_avg_half_chunk": (_resize(_QKV + "exp_avg", [192, 64], [96, 64]), "chunks hold 6144 elements, not the 12288"),
    "exp_avg_chunk_outside": (_resize(_QKV + "exp_avg", [192, 64], [193, 64]), "has a chunk at [0, 0] outside"),
    "exp_avg_as_int": (_retype_dtype(_QKV + "exp_avg", torch.int64), "is saved as torch.int64, not as the"),
}


@pytest.mark.parametrize("loader", ["resume", "resume_auto"])
@pytest.mark.parametrize("retype", list(RETYPES))
def test_entry_of_the_wrong_kind_is_refused(retype, loader, excerpt_corpus, saved, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt = _ckpt(run)
    edit, needle = RETYPES[retype]
    _edit_metadata(ckpt, edit)
    code = main(_train_args(loader, excerpt_corpus, run, ckpt, tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"scaletrain: error: {ckpt / '.metadata'}: ") and needle in err[0], err[0]
