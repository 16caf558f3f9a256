"""MLPerf benchmark layer: the timed protocol (harness), MLLOG writing (mllog), the gpt3 rules (rules, rules/*.yaml),
MLCommons' compliance checker (checker), olympic scoring (score), and a model-free engine for dry runs (scripted).

May import everything below it: `config`, `data`, `model`, `parallel`, `checkpoint`, `train` and `sim`; only `cli`
should import it (issue 13's target; today `train/` and `checkpoint/resume.py` still import from here).

Import the submodules directly (`from scaletrain.bench.harness import run_benchmark`); this package imports nothing
so that `import scaletrain.bench` stays cheap.
"""
