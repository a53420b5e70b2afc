"""The CLI through a subprocess, as a user runs it."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest

ICLAB = [sys.executable, "-m", "iclab.cli"]


def iclab(*args, root=None, timeout=300):
    env = dict(os.environ, CI="true")
    if root is not None:
        env["ICLAB_RESULTS"] = str(root)
    return subprocess.run([*ICLAB, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_list_json_names_fig1():
    r = iclab("list", "--json")
    assert r.returncode == 0, r.stderr
    ids = [e["id"] for e in json.loads(r.stdout)]
    assert "linattn.fig1" in ids


def test_list_markdown_is_the_readme_table_in_natural_order():
    r = iclab("list", "--markdown")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| `")]
    ids = [row.split("`")[1] for row in rows]
    from iclab.experiments import all_experiments
    from iclab.measure import TABLE_BEGIN, TABLE_END

    assert sorted(ids) == sorted(all_experiments())
    linattn = [i for i in ids if i.startswith("linattn.")]
    assert linattn.index("linattn.fig3") < linattn.index("linattn.fig10")
    assert all(row.count(" | ") == 4 for row in rows)  # a "|" inside a title would split a cell
    # the README's table is this output, generated from the measurement records (`iclab list --markdown --update
    # README.md` rewrites it; tests/test_measure.py checks it against the records)
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    block = readme[readme.index(TABLE_BEGIN) + len(TABLE_BEGIN):readme.index(TABLE_END)].strip("\n") + "\n"
    assert block == r.stdout, "the README's experiment table differs: run `iclab list --markdown --update README.md`"


def test_show_prints_every_field_with_presets_and_paper_value():
    r = iclab("show", "linattn.fig1", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    fields = {f["name"]: f for f in info["fields"]}
    for name in ("D", "N", "H", "w_init", "lr", "steps", "P", "seeds"):
        assert fields[name]["description"]
        assert set(fields[name]["presets"]) == {"quick", "paper"}
    assert fields["N"]["paper_value"] == 31 and fields["H"]["paper_value"] == 8
    text = iclab("show", "linattn.fig1")
    assert text.returncode == 0 and "paper's value" in text.stdout


@pytest.mark.parametrize(
    "args,field",
    [
        (["--set", "D=0"], "D"),
        (["--set", "H=0"], "H"),
        (["--set", "N=0"], "N"),
        (["--set", "lr=-0.1"], "lr"),
        (["--set", "D=four"], "D"),
        (["--set", "eigenvalues=[0.4,0.3,-0.2,0.1]"], "eigenvalues"),
        (["--set", "eigenvalues=[0.4,0.3]"], "eigenvalues"),
        (["--set", "bogus=1"], "bogus"),
        (["--seeds", "0"], "seeds"),
        (["--preset", "huge"], "preset"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, field):
    r = iclab("run", "linattn.fig1", *args, root=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in r.stderr
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_unknown_experiment_and_unknown_option(tmp_path):
    r = iclab("run", "linattn.fig99", root=tmp_path)
    assert r.returncode == 2 and "linattn.fig99" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = iclab("run", "linattn.fig1", "--no-such-flag", root=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # 61 s on 2 cores (three CLI processes); test_failing_check_exits_non_zero keeps a CLI run fast
def test_run_quick_end_to_end_then_reuse_then_force(tmp_path):
    r = iclab("run", "linattn.fig1", "--preset", "quick", "--json", root=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["passed"] and not res["reused"] and len(res["checks"]) >= 7
    run_dir = tmp_path / os.path.basename(res["path"])
    for name in ("config.json", "metrics.json", "trajectories.npz", "figure.png", "figure.pdf", "log.txt"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "metrics.json").read_text())["passed"] is True

    again = iclab("run", "linattn.fig1", "--preset", "quick", "--json", root=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["reused"] is True
    assert json.loads(again.stdout)["path"] == res["path"]

    forced = iclab("run", "linattn.fig1", "--preset", "quick", "--json", "--force", root=tmp_path)
    assert forced.returncode == 0 and json.loads(forced.stdout)["reused"] is False
    rows = sqlite3.connect(tmp_path / "index.sqlite").execute(
        "SELECT experiment, status, checks_passed, checks_total FROM runs ORDER BY id").fetchall()
    assert len(rows) == 2 and all(r[0] == "linattn.fig1" and r[1] == "done" and r[2] == r[3] for r in rows)


@pytest.mark.slow
def test_failing_check_exits_non_zero(tmp_path):
    # 50 steps end on the plateau: the final-loss checks must fail, and the exit code say so.
    r = iclab("run", "linattn.fig1", "--set", "steps=50", "--set", "P=200", "--json", root=tmp_path)
    assert r.returncode == 1, r.stderr
    res = json.loads(r.stdout)
    failed = [c["name"] for c in res["checks"] if not c["passed"]]
    assert any("final population loss" in name for name in failed)
