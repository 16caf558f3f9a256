"""Checkpoints: atomic verified DCP directories (store.py), full training state in any layout (checkpointer.py),
and Hugging Face GPT-2 export/import (hf.py)."""
