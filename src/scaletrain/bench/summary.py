"""The benchmark summary as a rich table: per-run status, checker verdict, which runs the olympic mean dropped."""

from __future__ import annotations

from typing import Any

from .mllog import C

__all__ = ["print_summary"]


def print_summary(console: Any, summary: dict) -> None:
    """Print `summary` (run_benchmark's dict) to a rich console."""
    from rich.table import Table

    table = Table(title=f"MLPerf {summary['benchmark']} (ruleset {summary['ruleset']})")
    for col in ("run", "seed", "status", "evals", "steps", "time to train", "eval loss", "checker", "score"):
        table.add_column(col, justify="right" if col not in ("status", "checker", "score") else "left", no_wrap=True)
    dropped = set(summary["dropped"])
    for r in summary["runs"]:
        ok = r["compliance"]["ok"]
        verdict = "skipped" if ok is None else ("[green]pass[/green]" if ok else "[red]FAIL[/red]")
        status = "[green]success[/green]" if r["status"] == C.SUCCESS else f"[red]{r['status']}[/red]"
        ttt = "-" if r["time_to_train_s"] is None else f"{r['time_to_train_s']:.1f} s"
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        counted = "dropped" if r["run"] in dropped else "counted"
        table.add_row(
            str(r["run"]), str(r["seed"]), status, str(len(r["evals"])), str(r["steps"]), ttt, loss, verdict, counted
        )
    console.print(table)
    for r in summary["runs"]:
        if r.get("reason"):
            console.print(f"run {r['run']}: {r['reason']}")
    if summary["score_s"] is None:
        console.print(f"[bold]score:[/bold] n/a ({summary['score_reason']})")
    else:
        console.print(
            f"[bold]score:[/bold] {summary['score_s']:.1f} s = {summary['score_min']:.2f} min "
            f"(olympic mean of {summary['n_runs']} runs, {summary['n_converged']} converged)"
        )
    if summary.get("rcp_ok") is not None:
        verdict = (
            "[green]pass[/green]" if summary["rcp_ok"] else "[red]FAIL[/red] (converged faster than the RCPs allow)"
        )
        console.print(f"[bold]RCP check:[/bold] {verdict}, see rcp_checker.txt")
    if summary["compliant_all"] is False:
        console.print(
            "[red]not compliant:[/red] see run_<i>/compliance.txt"
            + ("" if summary["seed_check_ok"] else " and the seed check")
        )
