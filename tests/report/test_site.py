"""The report: page content from a real store, and a real browser over a loopback HTTP server."""

import functools
import http.server
import threading
from pathlib import Path

import pytest

from iclab.launch import run_experiment
from iclab.report import build_site, collect_runs, write_curves_csv
from iclab.store import Store

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    """A store with a real passing run and a fabricated run whose checks fail."""
    root = tmp_path_factory.mktemp("results")
    run_experiment("linattn.fig1", "quick", root=root)
    failing = run_experiment("linattn.fig1", "quick", {"steps": 40, "P": 100}, root=root)
    assert not failing.passed  # 40 steps stay on the plateau: the final-loss checks fail
    return root


def test_collect_runs_keeps_the_newest_per_preset(store_root):
    entries = collect_runs(store_root)
    assert [e.experiment for e in entries] == ["linattn.fig1"]
    assert entries[0].config["steps"] == 40  # the newest quick run


def test_pages_show_every_experiment_and_mark_failures(store_root, tmp_path):
    index = build_site(store_root, tmp_path / "site")
    text = index.read_text()
    assert "linattn.fig1" in text and "FAIL" in text
    page = (tmp_path / "site" / "linattn.fig1-quick" / "index.html").read_text()
    assert '<img class="figure" src="figure.png"' in page and 'href="figure.pdf"' in page
    assert page.count('class="failing"') >= 1 and "FAIL" in page
    assert "iclab run linattn.fig1 --preset quick --set steps=40 --set P=100" in page
    assert "our choice" in page and "paper</span>" in page
    assert (tmp_path / "site" / "linattn.fig1-quick" / "curves.csv").read_text().startswith("population_attn_m[0]")


def test_every_stored_experiment_gets_a_page(tmp_path):
    root = tmp_path / "r"
    store = Store(root)
    for exp in ("linattn.fig1", "other.fig2"):
        key = exp[-1] * 16  # a run key: 16 hex digits
        store.write(exp, key, {
            "config.json": {"experiment": exp, "preset": "paper", "config": {"D": 4}},
            "metrics.json": {"checks": [{"name": "c", "measured": 1.0, "expected": 1.0, "tolerance": 0.1,
                                         "comparison": "abs", "passed": True, "note": ""}], "wall_s": 1.0},
        })
        row = store.begin(exp, key, "paper")
        store.end(row, "done", 1.0, 1, 1)
    build_site(root, tmp_path / "site")
    for exp in ("linattn.fig1", "other.fig2"):
        assert (tmp_path / "site" / f"{exp}-paper" / "index.html").is_file()
    assert "other" in (tmp_path / "site" / "index.html").read_text()


def test_empty_store_builds_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_site(tmp_path / "empty", tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_curves_csv_expands_seeds(tmp_path):
    import numpy as np

    n = write_curves_csv({"t": np.arange(4.0), "loss": np.ones((2, 4)), "levels": np.ones(3)}, tmp_path / "c.csv")
    assert n == 3
    assert (tmp_path / "c.csv").read_text().splitlines()[0] == "t,loss[0],loss[1]"


def test_report_in_a_real_browser(store_root, tmp_path, chromium_browser):
    browser = chromium_browser
    site = tmp_path / "site"
    build_site(store_root, site)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    errors, broken = [], []
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        to_visit, seen = [base + "index.html"], set()
        while to_visit:
            url = to_visit.pop()
            if url in seen:
                continue
            seen.add(url)
            if not url.endswith(".html"):  # data and PDF links: fetched, not rendered
                if page.request.get(url).status != 200:
                    broken.append(url)
                continue
            response = page.goto(url)
            if response is None or response.status != 200:
                broken.append(url)
                continue
            images = page.eval_on_selector_all("img", "els => els.map(e => [e.src, e.complete && e.naturalWidth])")
            assert images or url == base + "index.html", f"no images on {url}"
            for src, width in images:
                assert width and width > 0, f"image not loaded: {src} on {url}"
            links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
            for link in links:
                if link.startswith(base):
                    to_visit.append(link.split("#")[0])
                else:
                    broken.append(f"{link} (leaves the site, from {url})")
            if url == base + "index.html":
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "report-index.png"), full_page=True)
    finally:
        server.shutdown()
    assert not broken, broken
    assert not errors, errors
    assert any(u.endswith("figure.pdf") for u in seen) and any(u.endswith("curves.csv") for u in seen)
    assert (ARTIFACTS / "report-index.png").stat().st_size > 0
