"""MLPerf benchmark layer: the timed protocol (harness), MLLOG writing (mllog), the gpt3 rules (rules, rules/*.yaml),
MLCommons' compliance checker (checker), olympic scoring (score), and a model-free engine for dry runs (scripted).

Layer 6: may import every layer below it (`config`, `log`, `benchmarks`, `sim`, `data`, `model`, `parallel`,
`checkpoint`, `train`); only `cli` imports it.

Import the submodules directly (`from scaletrain.bench.harness import run_benchmark`); this package imports nothing
so that `import scaletrain.bench` stays cheap.
"""
