"""Models: the plain single-device decoders, all built from the shared parts of common.py (decoder, pre-norm
block, grouped-query attention, SwiGLU; rotary positions in rope.py) by architecture (gpt.py: MLPerf gpt3 = GPT-2
architecture; llama.py: Llama 2, 3.1 and Qwen3 dense; gpt_oss.py: GPT-OSS; deepseek_v3.py: DeepSeek-V3), the
Mixture-of-Experts layer (moe.py), multi-head latent
attention (mla.py), their loss and label convention (loss.py), LoRA adapters (lora.py), layout-independent init
(init.py), FP8 linears (fp8.py), one ModelSpec per architecture (spec.py), the builder by `arch` (build.py), and
parameter/FLOP counts (flops.py).

Layer 2: may import `config`, `log`, `benchmarks`, `sim` and torch; never `data` (which reads `model.loss`) nor
anything above. Nothing here knows about devices, ranks or data: parallelism is applied from outside by
`parallel/`. This file imports nothing, so a user of one module (`data/` reads `model.loss`) loads only that one.
"""
