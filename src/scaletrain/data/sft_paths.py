"""Where a config's SFT datasets are: `data.train_prefix` / `data.valid_prefix`, else the prepared KJV proxy set.

Kept apart from kjv.py (which builds that set and imports sft.py) so that sft.py can find the default set
without importing its builder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import default_data_dir
from .corpus import default_paths
from .indexed import DataError

SUBDIR = "kjv"


@dataclass(frozen=True)
class KJVCorpus:
    """Paths of a prepared KJV directory (nothing is checked by constructing one)."""

    root: Path
    train_prefix: Path
    valid_prefix: Path

    @classmethod
    def at(cls, root: str | Path) -> KJVCorpus:
        root = Path(root)
        return cls(root, root / "train", root / "valid")

    @property
    def stamp(self) -> Path:
        """kjv.json, written last when a build completes."""
        return self.root / "kjv.json"

    def info(self) -> dict:
        """The stamp's contents."""
        try:
            return json.loads(self.stamp.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.stamp}: cannot read KJV stamp ({exc})") from None


def kjv_paths(data_dir: str | Path) -> KJVCorpus:
    """Where fetch_kjv(data_dir) puts the set; does no work."""
    return KJVCorpus.at(Path(data_dir).expanduser() / SUBDIR)


def resolve_paths(data_cfg) -> tuple[Path, Path, Path | None]:
    """(train_prefix, valid_prefix, tokenizer) of an SFT DataConfig; empty fields mean DATA_DIR/kjv.

    An empty tokenizer means the default Shakespeare one when a default dataset is used (the sidecars'
    sha256 must match it), else None (only the id range is checked).
    """
    data_dir = default_data_dir(data_cfg)
    default = kjv_paths(data_dir)
    uses_default = not (data_cfg.train_prefix and data_cfg.valid_prefix)
    if uses_default and not default.stamp.is_file():
        raise DataError(
            f"{default.root}: KJV SFT set not prepared; run `scaletrain data fetch --corpus kjv` "
            f"or set data.train_prefix / data.valid_prefix"
        )
    train = Path(data_cfg.train_prefix) if data_cfg.train_prefix else default.train_prefix
    valid = Path(data_cfg.valid_prefix) if data_cfg.valid_prefix else default.valid_prefix
    tok = (
        Path(data_cfg.tokenizer)
        if data_cfg.tokenizer
        else (default_paths(data_dir).tokenizer if uses_default else None)
    )
    return train, valid, tok
