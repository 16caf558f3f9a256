"""Models: the plain single-device decoders (gpt.py: MLPerf gpt3 = GPT-2 architecture; llama.py: Llama 2), their
loss and label convention (loss.py), LoRA adapters (lora.py), layout-independent init (init.py), FP8 linears
(fp8.py), one ModelSpec per architecture (spec.py), the builder by `arch` (build.py), and parameter/FLOP
counts (flops.py).

May import `config`, torch and itself only; nothing here knows about devices, ranks or data (parallelism is applied
from outside by `parallel/`). This file imports nothing, so torch-free users (`sim/` reads `model.flops`, `data/`
reads `model.loss.IGNORE_INDEX`) load only the module they name.
"""
