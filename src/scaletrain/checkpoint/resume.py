"""What a resume says besides restoring tensors: a warning when settings that define the experiment changed.

The training loop's own state comes back through train/loop.py (LoopState.restore), the MLLOG up to the checkpoint
through bench/mllog.py (restore_mllog).
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.log import get_logger

log = get_logger(__name__)

# Settings a resumed run may change but that make it a different experiment from the one saved.
_WATCHED = (("train", "global_batch_size"), ("train", "seed"), ("train", "dtype"))


def warn_changed_settings(path: Path, info: dict, cfg) -> list[str]:
    """One warning line naming every watched setting that differs from the checkpoint's config; the changes."""
    saved = info.get("config", {})
    changes = []
    for section, name in _WATCHED:
        before = saved.get(section, {}).get(name) if isinstance(saved.get(section), dict) else None
        now = getattr(getattr(cfg, section), name)
        if before is not None and before != now:
            changes.append(f"{section}.{name} {before} -> {now}")
    if changes:
        log.warning("resuming %s with changed settings: %s", path, ", ".join(changes))
    return changes
