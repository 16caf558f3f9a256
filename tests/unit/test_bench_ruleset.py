"""bench.ruleset: llama2_70b_lora logs and checks at the newest ruleset mlperf-logging ships for it (or the one
asked for), gpt3 stays on 4.1.0, and a ruleset the package has no rules for is a config error naming those it has."""

from __future__ import annotations

import pytest

from scaletrain import benchmarks
from scaletrain.bench.checker import check_log, checker_command, ruleset
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.scripted import lora_reference_config, scripted_run
from scaletrain.config import ConfigError

pytest.importorskip("mlperf_logging")

LOSSES = [0.95, 0.94, 0.935, 0.93, 0.924]
DISCLOSURE = ("lowest_numerical_precision_in_linear", "tensor_parallelism", "context_parallelism", "config_filename")


def _ruleset_of(cmd: list[str]) -> str:
    return cmd[cmd.index("--ruleset") + 1]


def test_rulesets_come_from_the_package_folders():
    lora = benchmarks.package_rulesets("llama2_70b_lora")
    assert (
        lora[0] == "4.1.0"
        and "6.1.0" in lora
        and lora == tuple(sorted(lora, key=lambda r: tuple(map(int, r.split(".")))))
    )
    assert benchmarks.package_rulesets("llama2_70b_lora-proxy") == lora
    assert benchmarks.package_rulesets("gpt3") == ("4.1.0",)  # retired after 4.1; 3.x logs need other keys
    assert ruleset("llama2_70b_lora") == ruleset("llama2_70b_lora-proxy") == lora[-1]
    assert ruleset("gpt3") == ruleset("gpt3-proxy") == "4.1.0"
    assert ruleset("llama2_70b_lora", "5.0.0") == "5.0.0"
    assert _ruleset_of(checker_command("log", "gpt3")) == "4.1.0"
    assert _ruleset_of(checker_command("log", "llama2_70b_lora", rules="5.1.0")) == "5.1.0"


@pytest.mark.parametrize("name,value", [("llama2_70b_lora", "3.1.0"), ("llama2_70b_lora", "9.9.9"), ("gpt3", "6.1.0")])
def test_a_ruleset_the_package_lacks_is_a_config_error(name, value):
    with pytest.raises(ConfigError) as err:
        lora_reference_config(f"bench.benchmark={name}", f"bench.ruleset={value}")
    msg = str(err.value)
    assert f"bench.ruleset={value!r}" in msg and name in msg
    assert ", ".join(benchmarks.package_rulesets(name)) in msg


def test_official_lora_log_passes_the_newest_and_the_asked_ruleset(tmp_path):
    newest = benchmarks.package_rulesets("llama2_70b_lora")[-1]
    _, _ = scripted_run(lora_reference_config(), tmp_path, LOSSES, dp_size=8, platform="8xTEST")
    init = {e["key"]: e["value"] for e in read_mllog(tmp_path / "mllog.txt")}
    assert all(k in init for k in DISCLOSURE) and init["config_filename"] == "config.json"
    for rules, expect in (("", newest), ("4.1.0", "4.1.0")):
        check = check_log(tmp_path / "mllog.txt", "llama2_70b_lora", rules=rules)
        assert check.ok, check.output
        assert _ruleset_of(check.command) == expect and f"training_{expect}/closed_llama2_70b_lora.yaml" in check.output


def test_newest_ruleset_fails_a_log_without_a_disclosure_key(tmp_path):
    scripted_run(lora_reference_config(), tmp_path, LOSSES, dp_size=8, platform="8xTEST")
    log = tmp_path / "mllog.txt"
    log.write_text("".join(ln + "\n" for ln in log.read_text().splitlines() if '"key": "tensor_parallelism"' not in ln))
    check = check_log(log, "llama2_70b_lora")
    assert not check.ok and "tensor_parallelism" in check.output


def test_proxy_log_passes_its_rules_at_the_newest_ruleset(tmp_path):
    cfg = lora_reference_config(
        "bench.benchmark=llama2_70b_lora-proxy", "model.seq_len=256", "train.target_eval_loss=2.5"
    )
    result, _ = scripted_run(cfg, tmp_path, [3.0, 2.7, 2.4], platform="1xCPU")
    check = check_log(tmp_path / "mllog.txt", "llama2_70b_lora-proxy")
    assert result["status"] == "success" and check.ok, check.output
    assert _ruleset_of(check.command) == benchmarks.package_rulesets("llama2_70b_lora")[-1]
