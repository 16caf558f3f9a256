"""Checkpoints: atomic verified DCP directories (store.py), every file read as data only (safe_load.py), full
training state in any layout (checkpointer.py), the changed-settings warning of a resume (resume.py), a run's
initial weights from another checkpoint or a Hugging Face directory, and a plain model loaded from any checkpoint
(init_from.py), and Hugging Face GPT-2/Llama export/import (hf/: common.py, gpt2.py, llama.py; sharded.py and
sharded_export.py read and write each rank's slices).

Layer 4: may import `config`, `log`, `benchmarks`, `sim`, `data`, `model`, `parallel` and torch; never `train`,
`bench` or `cli`. Inside it, store <- safe_load <- checkpointer <- init_from (init_from reads hf/), so no module
needs a local import to dodge a loop. This file imports nothing.
"""
