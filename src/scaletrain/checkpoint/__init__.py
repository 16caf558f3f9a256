"""Checkpoints: atomic verified DCP directories (store.py), every file read as data only (safe_load.py), full
training state in any layout (checkpointer.py), the changed-settings warning of a resume (resume.py), a run's
initial weights from another checkpoint or a Hugging Face directory (init_from.py), and Hugging Face GPT-2/Llama
export/import (hf/: common.py, gpt2.py, llama.py).

May import `config`, `model`, `parallel` and torch; never `data`, `train`, `bench` or `cli`. This file imports
nothing.
"""
