"""Malicious checkpoints: no loading path ever runs code from a checkpoint (issue 12, section 1).

Each payload would create a marker file if unpickled the way torch/pickle do by default (test_payloads_are_live
proves it), and the attacker rewrites the manifest so the sha256 check passes. Every loader (`train --resume
PATH`, `train --resume auto`, `checkpoint.init_from`, `scaletrain export`) must refuse with one line naming the
file, without creating the marker.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch
from test_train_e2e import tiny_config, tiny_overrides

from scaletrain.checkpoint.store import sha256
from scaletrain.cli.main import main
from scaletrain.train.engine import Trainer

pytestmark = pytest.mark.hostile


STEP = 10  # the checkpoint: saved after the first evaluation; the run's budget is one step more


@pytest.fixture(scope="module")
def saved(excerpt_corpus, tmp_path_factory):
    """A benchmark run directory (MLLOG, loop state) with one complete checkpoint at step 10."""
    from scaletrain.bench.harness import run_once

    run = tmp_path_factory.mktemp("untrusted") / "run"
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.interval_steps=1", f"train.max_steps={STEP + 1}")
    run_once(cfg, Trainer(cfg, run), run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEP + 1:08d}")  # the final save: the one under attack stays newest
    return run


def _ckpt(run):
    return run / "checkpoints" / f"step_{STEP:08d}"


def _rehash(ckpt, *names):
    """What an attacker does after editing files: make the manifest match them again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in names:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": sha256(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class _Touch:
    """Creates the marker when unpickled by anything that resolves builtins (pickle, torch weights_only=False)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def dotted_name_pickle(command: str) -> bytes:
    """Protocol 4: STACK_GLOBAL(module 'torch.distributed.checkpoint.filesystem', name 'os.system')(command).

    The module passes a prefix check; the dotted name is resolved attribute by attribute to os.system.
    """

    def text(s):
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    return (
        pickle.PROTO
        + b"\x04"
        + text("torch.distributed.checkpoint.filesystem")
        + text("os.system")
        + pickle.STACK_GLOBAL
        + text(command)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _metadata_payload(ckpt, marker):
    (ckpt / ".metadata").write_bytes(dotted_name_pickle(f"touch {marker}"))
    _rehash(ckpt, ".metadata")


def _byte_io_payload(ckpt, marker):
    """Replace the optimizer's first non-tensor entry (a param_groups value) in its shard with a payload."""
    from scaletrain.checkpoint.safe_load import read_metadata

    md = read_metadata(ckpt)
    key = next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata")
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    shard = ckpt / info.relative_path
    payload = _torch_bytes(_Touch(marker))
    info.offset, info.length = shard.stat().st_size, len(payload)
    with open(shard, "ab") as f:
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))  # legitimate classes only: passes vetting
    _rehash(ckpt, ".metadata", info.relative_path)
    return info.relative_path


def _rng_payload(ckpt, marker):
    (ckpt / "rng_rank0.pt").write_bytes(_torch_bytes({"cpu": _Touch(marker)}))
    _rehash(ckpt, "rng_rank0.pt")


def _trainer_payload(text):
    def build(ckpt, marker):
        (ckpt / "trainer.json").write_text(text)
        _rehash(ckpt, "trainer.json")

    return build


def _loop_payload(ckpt, marker):
    # The loop's saved state is data the loop checks itself (train/loop.py); weights-only loaders never read it.
    info = json.loads((ckpt / "trainer.json").read_text())
    info["loop"]["evals"] = {"__reduce__": str(marker)}
    (ckpt / "trainer.json").write_text(json.dumps(info))
    _rehash(ckpt, "trainer.json")


def _manifest_payload(text):
    def build(ckpt, marker):
        (ckpt / "manifest.json").write_text(text)

    return build


# name: (builder, file the error must name, loaders that never read that file)
PAYLOADS = {
    "metadata_dotted_name": (_metadata_payload, ".metadata", ()),
    "byte_io_reduce": (_byte_io_payload, "__0_0.distcp", ("init_from", "export")),  # they read model.* only
    "rng_full_pickle": (_rng_payload, "rng_rank0.pt", ("init_from", "export")),
    "trainer_not_json": (_trainer_payload("{'step': 1"), "trainer.json", ()),
    "trainer_bad_types": (_trainer_payload('{"step": "1", "config": []}'), "trainer.json", ()),
    "trainer_missing_harness_keys": (
        _trainer_payload('{"step": 1, "config": {}, "harness": {"steps": 1}}'),
        "trainer.json",
        (),
    ),
    "trainer_bad_loop_state": (_loop_payload, "trainer.json", ("init_from", "export")),
    "manifest_not_json": (_manifest_payload("\x00garbage"), "manifest.json", ()),
    "manifest_path_escape": (
        _manifest_payload('{"files": {"../../x": {"bytes": 1, "sha256": "00"}}}'),
        "manifest.json",
        (),
    ),
}
LOADERS = ("resume", "resume_auto", "init_from", "export")


def _load(loader, corpus, run, ckpt, tmp_path):
    steps = 1 if loader == "init_from" else STEP + 1  # where a load succeeds, train as little as possible
    over = [
        a
        for o in tiny_overrides(corpus)
        + [f"train.max_steps={steps}", "train.target_eval_loss=0.1", "checkpoint.interval_steps=1"]
        for a in ("--set", o)
    ]
    if loader == "resume":
        return main(["train", "--resume", str(ckpt), "--run-dir", str(tmp_path / "new"), *over])
    if loader == "resume_auto":
        # As after a kill: no result.json, so the run is unfinished and --resume auto loads its newest checkpoint.
        (run / "result.json").unlink(missing_ok=True)
        return main(["train", "--resume", "auto", "--run-dir", str(run), *over])
    if loader == "init_from":
        return main(["train", "--set", f"checkpoint.init_from={ckpt}", "--run-dir", str(tmp_path / "new"), *over])
    return main(["export", str(ckpt), "--hf", str(tmp_path / "hf")])


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_malicious_checkpoint_never_runs(payload, loader, excerpt_corpus, saved, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt, marker = _ckpt(run), tmp_path / "pwned"
    build, named, unread = PAYLOADS[payload]
    build(ckpt, marker)
    code = _load(loader, excerpt_corpus, run, ckpt, tmp_path)
    err = capsys.readouterr().err.strip()
    assert not marker.exists(), f"{payload} ran code through {loader}"
    if loader in unread:
        assert code in (0, 1), err  # the file is never opened: the load itself succeeds
        return
    lines = err.splitlines()
    if loader == "resume_auto" and named == "manifest.json":
        # A checkpoint that fails verification is moved aside with a one-line warning; the run starts fresh.
        assert code in (0, 1) and len(lines) == 1 and "warning: skipping damaged checkpoint" in lines[0]
        assert named in lines[0] and len(list(ckpt.parent.glob(ckpt.name + ".damaged-*"))) == 1
        return
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("scaletrain: error: ") and named in lines[0], lines[0]


def test_payloads_are_live(saved, tmp_path):
    """Without the guards each payload runs: so the test above can fail (unrestricted pickle / torch.load)."""
    markers = [tmp_path / f"m{i}" for i in range(3)]
    pickle.loads(dotted_name_pickle(f"touch {markers[0]}"))
    torch.load(io.BytesIO(_torch_bytes(_Touch(markers[1]))), weights_only=False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(saved), ckpt)
    assert _byte_io_payload(ckpt, markers[2]) == "__0_0.distcp"
    import torch.distributed.checkpoint as dcp

    dcp.load(_load_target(saved), checkpoint_id=str(ckpt), no_dist=True)  # torch's own loader, tampered shard
    assert all(m.exists() for m in markers), [m.exists() for m in markers]


def _load_target(run):
    """A state dict shaped like the checkpoint's (model and optimizer entries), for dcp.load."""
    from scaletrain.checkpoint.safe_load import read_metadata

    md = read_metadata(_ckpt(run))
    out = {}
    for key, value in md.state_dict_metadata.items():
        if type(value).__name__ == "TensorStorageMetadata":
            out[key] = torch.empty(tuple(value.size), dtype=value.properties.dtype)
        else:
            out[key] = None
    return out


def test_legit_checkpoint_loads_through_every_path(excerpt_corpus, saved, tmp_path, capsys):
    """The guards refuse nothing we write: resume, auto, init_from and export all succeed on a clean copy."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    for loader in LOADERS:
        assert _load(loader, excerpt_corpus, run, _ckpt(run), tmp_path / loader) in (0, 1), loader
    err = capsys.readouterr().err
    assert "error" not in err, err
    assert (tmp_path / "export" / "hf" / "model.safetensors").is_file()


def test_rng_state_of_wrong_shape_is_one_line(excerpt_corpus, saved, tmp_path):
    """Plain tensors, but not an RNG state: refused by name, not a traceback from torch.set_rng_state."""
    from scaletrain.checkpoint.store import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt = _ckpt(run)
    torch.save({"cpu": torch.zeros(3, dtype=torch.uint8)}, ckpt / "rng_rank0.pt")
    _rehash(ckpt, "rng_rank0.pt")
    trainer = Trainer(tiny_config(excerpt_corpus, tmp_path / "new", f"checkpoint.resume={ckpt}"), tmp_path / "new")
    with pytest.raises(CheckpointError) as err:
        trainer.init()
    assert "rng_rank0.pt: not an RNG state" in str(err.value) and "\n" not in str(err.value)
    assert os.path.isfile(ckpt / "rng_rank0.pt")


def test_init_from_loop_in_a_lora_checkpoint_is_one_line(excerpt_corpus, tmp_path, capsys):
    """A LoRA checkpoint names its base in its config; one naming itself is refused, not a RecursionError."""
    run = tmp_path / "lora"
    trainer = Trainer(tiny_config(excerpt_corpus, run, "lora.rank=4", "lora.alpha=8"), run)
    trainer.init()
    trainer.save_checkpoint({})
    ckpt = run / "checkpoints" / "step_00000000"
    info = json.loads((ckpt / "trainer.json").read_text())
    info["config"]["checkpoint"]["init_from"] = str(run)
    (ckpt / "trainer.json").write_text(json.dumps(info))
    _rehash(ckpt, "trainer.json")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.init_from leads back to this checkpoint" in err


def test_init_from_a_garbage_hf_directory_is_one_line(excerpt_corpus, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"')
    (hf / "model.safetensors").write_bytes(b"\x00" * 64)
    over = [a for o in tiny_overrides(excerpt_corpus) for a in ("--set", o)]
    assert main(["train", "--set", f"checkpoint.init_from={hf}", "--run-dir", str(tmp_path / "r"), *over]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"checkpoint.init_from={hf}:" in err


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda md: setattr(next(iter(md.storage_data.values())), "relative_path", "../../etc/passwd"),
            "points at '../../etc/passwd', not a shard of this checkpoint",
        ),
        (
            lambda md: setattr(next(iter(md.storage_data.values())), "transform_descriptors", ["zstd/1"]),
            "unexpected transforms",
        ),
        (lambda md: md.state_dict_metadata.update({7: None}), "entry 7 is a NoneType"),
    ],
)
def test_metadata_of_allowed_classes_but_wrong_content_is_refused(saved, tmp_path, edit, needle):
    """Only DCP classes, yet pointing outside the checkpoint or asking for a decoder: refused by name."""
    from scaletrain.checkpoint.safe_load import read_metadata
    from scaletrain.checkpoint.store import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(saved), ckpt)
    md = read_metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(CheckpointError) as err:
        read_metadata(ckpt)
    assert str(err.value).startswith(f"{ckpt / '.metadata'}: not DCP metadata") and needle in str(err.value)
