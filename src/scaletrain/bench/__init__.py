"""MLPerf benchmark layer: the timed protocol as an observer of the training loop and the N-run benchmark
(harness), the `scaletrain bench` entry point (run), MLLOG writing and its resume (mllog), the gpt3 and
llama2_70b_lora rules (rules, rules/*.yaml), MLCommons' compliance checker (checker), olympic scoring (score), the
llama2_70b_lora proxy's base model (proxy_base), and a model-free engine for dry runs (scripted).

Layer 6: may import every layer below it (`config`, `log`, `benchmarks`, `sim`, `data`, `model`, `parallel`,
`checkpoint`, `train`); only `cli` imports it.

Import the submodules directly (`from scaletrain.bench.harness import run_benchmark`); this package imports nothing
so that `import scaletrain.bench` stays cheap.
"""
