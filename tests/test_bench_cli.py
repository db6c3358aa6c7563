"""``python -m bench``: every top-level script is a suite, and ``--quick`` keeps the stored
results."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_main", ROOT / "bench" / "__main__.py")
cli = importlib.util.module_from_spec(_spec)
sys.modules["bench_main"] = cli  # its dataclass looks its module up
_spec.loader.exec_module(cli)


def test_every_top_level_script_is_a_suite_and_no_helper_is():
    on_disk = {p.stem for p in (ROOT / "bench").glob("*.py")
               if not p.name.startswith("_")}
    found = cli.suites()
    assert set(found) == on_disk
    assert {"pipeline_vs_torch", "collectives", "zb_split_cost"} <= set(found)
    assert all(s.summary for s in found.values()), [n for n, s in found.items() if not s.summary]


def test_a_new_script_is_listed_without_registration(tmp_path, monkeypatch):
    (tmp_path / "fresh.py").write_text('"""A fresh suite: it measures nothing."""\n'
                                      'QUICK_ARGS = ["--rounds", "1"]\n')
    (tmp_path / "_helper.py").write_text('"""Not a suite."""\n')
    monkeypatch.setattr(cli, "BENCH", tmp_path)
    found = cli.suites()
    assert list(found) == ["fresh"]
    assert found["fresh"].summary == "A fresh suite: it measures nothing"
    assert found["fresh"].quick_args == ("--rounds", "1")


def test_quick_resolves_to_the_suites_own_flag_or_its_quick_args_and_writes_elsewhere():
    found = cli.suites()
    own = cli.command(found["pipeline_vs_torch"], ["--quick"])
    assert own[:2] == [sys.executable, str(ROOT / "bench" / "pipeline_vs_torch.py")]
    assert own[2:] == ["--quick", "--out", str(cli.QUICK_RESULTS / "pipeline_vs_torch.json")]
    declared = cli.command(found["zb_split_cost"], ["--quick", "--dim", "64"])
    assert declared[2:] == ["--dim", "64", *found["zb_split_cost"].quick_args]
    given = cli.command(found["fsdp"], ["--quick", "--out", "/tmp/x.json"])
    assert given.count("--out") == 1 and given[-1] != str(cli.QUICK_RESULTS / "fsdp.json")
    plain = cli.command(found["fsdp"], ["--rounds", "2"])
    assert plain[2:] == ["--rounds", "2"]  # a full run writes where the suite says


def test_a_launched_suite_runs_under_the_launcher():
    found = cli.suites()
    cmd = cli.command(found["mpmd_step_timeline"], ["1f1b"])
    assert cmd[:3] == [sys.executable, "-m", "jaxpg.run"]
    assert cmd[-2:] == [str(ROOT / "bench" / "mpmd_step_timeline.py"), "1f1b"]


def test_bad_requests_name_the_fix():
    found = cli.suites()
    with pytest.raises(SystemExit, match="gpu --quick: this suite has no quick form"):
        cli.command(found["gpu"], ["--quick"])
    with pytest.raises(SystemExit, match="no suite 'nope'.*python -m bench --list"):
        cli.main(["nope"])


def test_list_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    names = [line.split()[0] for line in out.splitlines()]
    assert names == sorted(cli.suites())


_rspec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "_results.py")
results = importlib.util.module_from_spec(_rspec)
_rspec.loader.exec_module(results)


def test_every_results_file_is_named_after_a_suite():
    """One ``<suite>.json`` per suite; a run with other arguments is a configuration inside
    it, never a file of its own (``throughput_n8.json``)."""
    found = cli.suites()
    stored = sorted(p.stem for p in (ROOT / "bench" / "results").glob("*.json"))
    assert stored, "bench/results/ holds no results"
    strays = [f"{s}.json" for s in stored if s not in found]
    assert not strays, (f"bench/results/ files not named after a suite (python -m bench "
                        f"--list): {strays}; store the run as a configuration of its suite's "
                        f"file (--configuration NAME, bench/_results.py)")
    for stem in stored:
        data = results.load(ROOT / "bench" / "results" / f"{stem}.json")
        assert results.CONFIGURATIONS not in data
        configurations = json.loads((ROOT / "bench" / "results" / f"{stem}.json")
                                    .read_text()).get(results.CONFIGURATIONS, {})
        if configurations:  # the suite can write what its file holds
            assert "--configuration" in found[stem].path.read_text() or \
                "add_flag(" in found[stem].path.read_text(), stem
            assert all(isinstance(v, dict) and v for v in configurations.values()), stem


def test_a_configuration_and_the_default_run_keep_each_other(tmp_path):
    path = tmp_path / "suite.json"
    results.save(path, {"ms": 1.0})
    results.save(path, {"ms": 2.0}, "n8")
    results.save(path, {"ms": 3.0}, "smoke")
    results.save(path, {"ms": 4.0})  # a new default run keeps the configurations
    results.save(path, {"ms": 5.0}, "n8")  # a configuration's new run replaces its old one
    assert json.loads(path.read_text()) == {
        "ms": 4.0, "configurations": {"n8": {"ms": 5.0}, "smoke": {"ms": 3.0}}}
    assert results.load(path) == {"ms": 4.0}
    assert results.load(path, "smoke") == {"ms": 3.0}
    with pytest.raises(SystemExit, match="no configuration 'n4'; it has n8, smoke"):
        results.load(path, "n4")
    with pytest.raises(ValueError, match="configuration='_n8'"):
        results.save(path, {"ms": 6.0}, "_n8")


def test_fault_stress_quick_writes_elsewhere():
    suite = cli.suites()["fault_stress"]
    assert suite.default_out == "fault_stress.json"
    assert cli.command(suite, ["--quick"])[-2:] == [
        "--out", str(cli.QUICK_RESULTS / "fault_stress.json")]


def test_planner_repredict_prices_the_stored_measurements_with_the_current_model(tmp_path):
    # a stored run from the stored results (its calibrated profile and measured steps), its
    # predictions spoiled: --repredict must give back the planner's own, measurements kept
    from jaxpg.plan import Job, Layout, evaluate
    from jaxpg.plan.hardware import Hardware

    stored = json.loads((ROOT / "bench" / "results" / "planner.json").read_text())
    run = stored["configurations"]["processes2_moe"]
    measured = [r["measured_s"] for r in run["layouts"]]
    for r in run["layouts"]:
        r["predicted_s"] = 1.0
    run["spearman"] = 0.0
    path = tmp_path / "planner.json"
    path.write_text(json.dumps({"configurations": {"processes2_moe": run}}))
    subprocess.run([sys.executable, str(ROOT / "bench" / "planner.py"), "--repredict",
                    "--out", str(path)], cwd=ROOT, capture_output=True, text=True,
                   timeout=120, check=True)
    again = json.loads(path.read_text())["configurations"]["processes2_moe"]
    assert [r["measured_s"] for r in again["layouts"]] == measured
    sys.path.insert(0, str(ROOT / "bench"))
    from _planner_cases import MOE, spearman

    job = Job(model=MOE, devices=8, hardware=Hardware.from_dict(run["calibrated"]),
              seq_len=run["seq_len"], global_batch=run["global_batch"], dtype="fp32",
              param_dtype="fp32")
    expect = [evaluate(Layout.parse(r["layout"]), job).step_s for r in again["layouts"]]
    assert [r["predicted_s"] for r in again["layouts"]] == pytest.approx(expect)
    assert again["spearman"] == pytest.approx(spearman(expect, measured))
    assert again["spearman"] != 0.0


def test_the_planner_page_s_tables_are_the_stored_results():
    # docs/planner.md's layout tables are report.py's, from bench/results/planner.json: a
    # page edited by hand, or results stored without running report.py, fails here
    sys.path.insert(0, str(ROOT / "bench"))
    rspec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(rspec)
    rspec.loader.exec_module(report)
    page = (ROOT / "docs" / "planner.md").read_text()
    blocks = page.count("<!-- planner: ")
    assert blocks >= 3 and page.count("<!-- /planner -->") == blocks
    assert report.fill_planner(page) == page, "run: python bench/report.py"
    assert "(no planner run" not in page
