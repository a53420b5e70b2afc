"""Measurements as data (``iclab measure``): the record, what is generated from it, and the README that shows it.

The README's experiments table, ``iclab show``'s runtimes and ``iclab list --markdown`` are generated from the
records in ``docs/measurements``; these tests fail when the README and the records disagree, and hold the README
to its size, its links and its lack of dated prose."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from iclab import measure
from iclab.experiments import all_experiments

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _record(date: str, experiments: dict, benches: dict | None = None, cpu: str = "Test CPU") -> dict:
    return {"schema": measure.SCHEMA, "date": date, "command": "iclab measure",
            "machine": {"cpu_model": cpu, "cores": 2, "cores_available": 2, "memory_gib": 8.0,
                        "load_average": [0.5, 0.4, 0.3]},
            "software": {"python": "3.11", "packages": {}}, "experiments": experiments, "benches": benches or {}}


def _run(wall: float, passed: int, total: int, **extra) -> dict:
    return {"command": "iclab run", "wall_s": wall, "cpu_s": 2 * wall, "exit_code": 0 if passed == total else 1,
            "status": "done", "passed": passed == total, "checks_passed": passed, "checks_total": total,
            "failed_checks": [], "backend": "native", **extra}


@pytest.fixture
def records(tmp_path):
    folder = tmp_path / "measurements"
    folder.mkdir()
    old = _record("2026-01-01T00:00:00+00:00", {"linattn.fig1": {"quick": _run(9.0, 7, 7)},
                                                 "linattn.fig3": {"quick": _run(5.2, 9, 9), "paper": _run(750.0, 8, 9)}})
    new = _record("2026-02-01T00:00:00+00:00", {"linattn.fig1": {"quick": _run(6.14, 7, 7)}}, cpu="Newer CPU")
    (folder / "a-old.json").write_text(json.dumps(old))
    (folder / "b-new.json").write_text(json.dumps(new))
    # a record still being written is not read
    (folder / "c-partial.json.partial").write_text(json.dumps(_record("2026-03-01T00:00:00+00:00",
                                                                      {"linattn.fig1": {"quick": _run(1.0, 0, 7)}})))
    (folder / "notes.json").write_text("[1, 2]")  # not a record: ignored
    return folder


# ------------------------------------------------------------------------------------------------
# Generation from the records


def test_the_newest_record_that_measured_a_preset_is_the_one_shown(records):
    m = measure.load(records)
    assert m.run("linattn.fig1", "quick")["wall_s"] == 6.14 and m.run("linattn.fig1", "quick")["record"] == "b-new.json"
    assert m.run("linattn.fig3", "quick")["record"] == "a-old.json"  # the newer record did not measure it
    assert m.run("linattn.fig3", "paper")["checks_passed"] == 8
    assert m.run("linattn.fig4", "quick") is None
    assert m.used() == ["a-old.json", "b-new.json"]


def test_the_table_is_generated_from_the_records(records):
    exps = all_experiments()
    block = measure.experiments_markdown(exps.values(), measure.load(records))
    rows = {row.split("`")[1]: row for row in block.splitlines() if row.startswith("| `")}
    assert sorted(rows) == sorted(exps)
    cells = [c.strip() for c in rows["linattn.fig1"].strip("|").split(" | ")]
    assert cells[2:] == ["6.1 s", "not measured", "quick 7/7"]
    cells = [c.strip() for c in rows["linattn.fig3"].strip("|").split(" | ")]
    assert cells[2:] == ["5.2 s", "12 min", "quick 9/9, paper 8/9"]
    assert rows["linattn.fig4"].endswith("| not measured | not measured | not measured |")
    assert all(row.count(" | ") == 4 for row in rows.values())  # a "|" inside a title would split a cell
    ids = list(rows)
    assert ids.index("linattn.fig3") < ids.index("linattn.fig10")  # natural order
    assert "a-old.json" in block and "Newer CPU" in block  # the sources are named


def test_no_record_says_so(tmp_path):
    block = measure.experiments_markdown(all_experiments().values(), measure.load(tmp_path / "none"))
    assert "No measurement record yet" in block and "| not measured | not measured | not measured |" in block


def test_format_seconds():
    assert [measure.format_seconds(s) for s in (6.14, 43.4, 412, 1250, 9000, None)] == \
        ["6.1 s", "43 s", "412 s", "21 min", "2.5 h", "not measured"]


def test_iclab_show_prints_the_records_runtime(records):
    env = dict(os.environ, CI="true")
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "show", "linattn.fig1", "--measurements", str(records)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    quick = [line for line in r.stdout.splitlines() if line.startswith("runtime (quick):")]
    assert quick and "6.1 s wall" in quick[0] and "7/7 checks" in quick[0] and "b-new.json" in quick[0]
    assert "runtime (paper): not measured" in r.stdout
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "show", "linattn.fig3", "--json", "--measurements",
                        str(records)], capture_output=True, text=True, env=env, timeout=300)
    runtime = json.loads(r.stdout)["runtime"]
    assert runtime["paper"].startswith("12 min wall") and "8/9 checks" in runtime["paper"]


def test_update_readme_rewrites_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{measure.TABLE_BEGIN}\nold table\n{measure.TABLE_END}\nafter\n")
    assert measure.update_readme(readme, "new table\n")
    assert readme.read_text() == f"# x\n\nbefore\n{measure.TABLE_BEGIN}\nnew table\n{measure.TABLE_END}\nafter\n"
    assert not measure.update_readme(readme, "new table\n")
    readme.write_text("no markers\n")
    with pytest.raises(ValueError):
        measure.update_readme(readme, "x")


# ------------------------------------------------------------------------------------------------
# The committed records and the README


def _readme_block() -> str:
    text = README.read_text(encoding="utf-8")
    begin, end = text.index(measure.TABLE_BEGIN), text.index(measure.TABLE_END)
    return text[begin + len(measure.TABLE_BEGIN):end].strip("\n") + "\n"


def test_readme_table_is_what_the_records_generate():
    expected = measure.experiments_markdown(all_experiments().values(), measure.load())
    assert _readme_block() == expected, \
        "the README's experiments table differs from the records: run `iclab list --markdown --update README.md`"


def test_iclab_show_runtimes_are_the_records():
    m = measure.load()
    for exp in all_experiments().values():
        for preset, line in measure.runtime_lines(exp, m).items():
            entry = m.run(exp.id, preset)
            if entry is None:
                assert line.startswith("not measured")
            elif "error" not in entry:
                assert line.startswith(f"{measure.format_seconds(entry['wall_s'])} wall") and entry["record"] in line


def test_committed_records_are_whole_and_measured():
    m = measure.load()
    for name, record in m.records.items():
        assert record.get("complete") is True and not record.get("in_process"), name
        assert record["machine"]["cpu_model"] and record["machine"]["cores"] >= 1, name
        for exp_id, presets in record["experiments"].items():
            assert exp_id in all_experiments(), f"{name}: {exp_id} is not a registered experiment"
            for preset, entry in presets.items():
                assert "error" in entry or (entry["wall_s"] > 0 and entry["checks_total"] >= 1), (name, exp_id, preset)
        for bench, entry in record["benches"].items():
            assert "error" in entry or (entry["wall_s"] > 0 and isinstance(entry["result"], dict)), (name, bench)


def test_readme_is_short_and_undated():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert not re.search(r"(Nov|Dec)(ember)? 2026|this VM|slow hour", text)
    assert "make demo" in text and "make test" in text


def test_the_sources_carry_no_dates_run_histories_or_tracker_references():
    # notes say what and why; when something was measured is in git log and the measurement records
    dated = re.compile(r"(Nov|Dec)(ember)? 20[0-9][0-9]|this VM|slow hour")
    tracker = re.compile(r"issue [0-9]+|spec §")
    sources = sorted((ROOT / "src" / "iclab").rglob("*.py"))
    assert len(sources) > 50  # the scan reads the package
    sources += sorted((ROOT / "docs").rglob("*.py"))  # the tutorials and the site's hook, which users read too
    for path in sources:
        text = path.read_text(encoding="utf-8")
        assert not dated.search(text), f"{path.relative_to(ROOT)}: {dated.search(text)[0]!r}"
        assert not tracker.search(text), f"{path.relative_to(ROOT)}: {tracker.search(text)[0]!r}"


def test_readme_and_docs_do_not_cite_the_developers_folder():
    docs = sorted(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".py", ".js", ".yml"))
    code = sorted(p for folder in ("src", "tests") for p in (ROOT / folder).rglob("*.py") if p.name != "test_measure.py")
    for path in [README, *docs, *code]:
        assert "shared/" not in path.read_text(encoding="utf-8"), path


def test_every_readme_link_resolves():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target = link.split("#")[0]
        assert target and (ROOT / target).exists(), f"README links to {link}, which does not exist"


# ------------------------------------------------------------------------------------------------
# Measuring


def test_measure_in_process_writes_a_record(tmp_path):
    log = []
    path = measure.measure(tmp_path / "m", quick=["mhsa.fig7"], benches=[], in_process=True, log=log.append,
                           results=tmp_path / "results")
    assert path.name.endswith("c.json") and not list((tmp_path / "m").glob("*.partial"))
    record = json.loads(path.read_text())
    assert record["schema"] == measure.SCHEMA and record["complete"] and record["in_process"]
    assert record["machine"]["cores"] >= 1 and record["software"]["packages"]["iclab"]
    entry = record["experiments"]["mhsa.fig7"]["quick"]
    assert entry["status"] == "done" and entry["checks_passed"] == entry["checks_total"] >= 1
    assert entry["wall_s"] > 0 and entry["cpu_s"] > 0 and entry["backend"]
    assert len(log) == 1 and "mhsa.fig7" in log[0]
    assert measure.load(tmp_path / "m").run("mhsa.fig7", "quick")["wall_s"] == entry["wall_s"]


def test_measure_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="linattn.fig99"):
        measure.measure(tmp_path, quick=["linattn.fig99"], benches=[])
    with pytest.raises(ValueError, match="nosuch"):
        measure.measure(tmp_path, quick=[], benches=["nosuch"])
    with pytest.raises(ValueError, match="nothing to measure"):
        measure.measure(tmp_path, quick=[], benches=[])
    assert not list(tmp_path.iterdir())


def test_measure_cli_dry_run_and_bad_input(tmp_path):
    env = dict(os.environ, CI="true")
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "measure", "--only", "linattn.fig1", "--paper",
                        "gating.fig2", "--bench", "mhsa", "--out", str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:3] == ["iclab run linattn.fig1 --preset quick --json --force",
                                         "iclab run gating.fig2 --preset paper --json --force",
                                         "iclab bench mhsa --json"]
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "measure", "--only", "linattn.fig99", "--no-bench",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "linattn.fig99" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_measure_in_fresh_processes(tmp_path):
    """What a record holds: a fresh ``iclab run`` process per preset, and a benchmark's output with its ratios."""
    path = measure.measure(tmp_path, quick=["mhsa.fig7"], benches=[], log=lambda line: None)
    entry = json.loads(path.read_text())["experiments"]["mhsa.fig7"]["quick"]
    assert entry["exit_code"] == 0 and entry["checks_passed"] == entry["checks_total"]
    assert entry["wall_s"] >= entry["run_wall_s"] > 0  # the process's time includes its imports
    bench = measure.measure_bench("mhsa", in_process=True, kwargs={"batch": 64, "steps": 2, "seeds": 2})
    assert bench["exit_code"] == 0 and [s["value"] > 0 for s in bench["ratios"]["speedups"]] == [True, True]


# ------------------------------------------------------------------------------------------------
# The ratios the Benchmarks page plots


BENCH_OUTPUTS = {
    "linattn": {"speedup_per_step_by_backend": {"xla": 3800.0, "native": 15000.0},
                "speedup_per_seed_step_6_seeds_by_backend": {"xla": 5000.0, "native": 30000.0}},
    "gating": {"speedup_1_seed": 11.0, "speedup_10_seeds": 6.3,
               "fast_1_seed": {"fraction_of_matmul_peak": 0.05},
               "fig1_paper": {"kernels": {"xla": {"loss_grad_s": 1.8}, "native": {"loss_grad_s": 0.2}},
                              "floor_ratio_step": 3.0, "fraction_of_matmul_peak_step_rounds": [0.25, 0.4, 0.3]},
               "fig2_paper": {"kernels": {"xla": {"loss_grad_s": 2.4}, "native": {"loss_grad_s": 0.24}},
                              "floor_ratio_step": 2.0, "fraction_of_matmul_peak_step_rounds": [0.5, 0.45, 0.55]}},
    "drift": {"fig1": {"forms": {"xla": {"loss_grad_s": 0.9}, "native": {"loss_grad_s": 0.09},
                                 "native_shared": {"loss_grad_s": 0.06}},
                       "sample_s_xla": 0.31, "sample_s": 0.031, "floor_ratio_step": 3.1,
                       "fraction_of_matmul_peak_step_rounds": [0.3, 0.33, 0.35]},
              "fig2": {"forms": {"parallel": {"loss_grad_s": 12.0}, "native": {"loss_grad_s": 0.32}},
                       "sample_s_xla": 0.2, "sample_s": 0.023, "floor_ratio_step": 3.0,
                       "fraction_of_matmul_peak_step_rounds": [0.3, 0.36, 0.33]},
              "native_layer_kernels": {"ir_forward_fraction_of_matmul_peak": 0.7}},
    "mhsa": {"full_1_seed": {"steps_per_s": 10.0}, "spectral_1_seed": {"steps_per_s": 400.0},
             "full_6_seeds": {"steps_per_s": 2.0}, "spectral_6_seeds": {"steps_per_s": 90.0}},
    "sweep": {"cores": 2, "sweep_speedup_per_core_vs_1": 1.2,
              "sweeps": {"1 worker per core": {"wall_s": 30.0}, "2 workers per core": {"wall_s": 40.0}}},
}


def test_bench_ratios_read_each_benchmarks_output():
    r = measure.bench_ratios("linattn", BENCH_OUTPUTS["linattn"])
    assert sorted(s["value"] for s in r["speedups"]) == [3800.0, 5000.0, 15000.0, 30000.0] and not r["floors"]
    r = measure.bench_ratios("gating", BENCH_OUTPUTS["gating"])
    values = {s["label"]: s["value"] for s in r["speedups"]}
    assert values["gating.fig1 paper: loss and gradient, compiled kernels vs XLA"] == pytest.approx(9.0)
    assert pytest.approx(11.0) in values.values()
    fig2 = next(f for f in r["floors"] if f["label"] == "gating.fig2 paper step")
    assert fig2["value"] == 2.0 and fig2["low"] == pytest.approx(1 / 0.55) and fig2["high"] == pytest.approx(1 / 0.45)
    r = measure.bench_ratios("drift", BENCH_OUTPUTS["drift"])
    values = {s["label"]: s["value"] for s in r["speedups"]}
    assert values["drift.fig1 paper: loss and gradient, compiled kernels vs XLA"] == pytest.approx(15.0)  # shared layout
    assert values["drift.fig2 paper: loss and gradient, compiled layers vs XLA"] == pytest.approx(37.5)
    assert len(r["floors"]) == 3  # two steps and the one layer kernel given
    r = measure.bench_ratios("mhsa", BENCH_OUTPUTS["mhsa"])
    assert sorted(s["value"] for s in r["speedups"]) == [pytest.approx(40.0), pytest.approx(45.0)]
    r = measure.bench_ratios("sweep", BENCH_OUTPUTS["sweep"])
    assert [s["value"] for s in r["speedups"]] == [pytest.approx(1.2), pytest.approx(40 / 30)]
    assert measure.bench_ratios("gating", {}) == {"speedups": [], "floors": []}  # missing numbers are left out


@pytest.mark.slow  # needs the docs extra, which `make docs` installs before CI's slow set (not before `make test`)
def test_benchmarks_page_and_figures_from_a_record(tmp_path):
    pytest.importorskip("mkdocs")
    import importlib.util

    spec = importlib.util.spec_from_file_location("_iclab_docs_hook", ROOT / "docs" / "_hooks" / "iclab_docs.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    benches = {name: {"command": f"iclab bench {name} --json", "wall_s": 60.0, "cpu_s": 100.0, "exit_code": 0,
                      "result": {"setting": f"{name} setting", **out}, "ratios": measure.bench_ratios(name, out)}
               for name, out in BENCH_OUTPUTS.items()}
    (tmp_path / "r.json").write_text(json.dumps(_record("2026-01-01T00:00:00+00:00", {}, benches)))
    markdown, figures = hook.benchmarks_section(measure.load(tmp_path))
    assert sorted(figures) == ["floors.png", "speedups.png"]
    assert all(png.startswith(b"\x89PNG") and len(png) > 5000 for png in figures.values())
    assert "benchmarks/speedups.png" in markdown and "benchmarks/floors.png" in markdown
    for name in BENCH_OUTPUTS:
        assert f"### `iclab bench {name}`" in markdown
    assert "measurements/r.json" in markdown
