"""The documentation site: built in strict mode (the tutorials executed, their theory asserts passing),
then opened from the file system in a real browser.

CI runs ``make docs`` before the slow set, and this test reuses that build when it is newer than every
source of the site; otherwise it builds the site itself (minutes: the seven tutorials run)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
TUTORIALS = ("linattn", "gating", "drift", "mhsa", "model_family", "nonstationary", "task_diversity")
ARTIFACTS = ROOT / "test-artifacts"


def _newest_source() -> float:
    paths = [ROOT / "mkdocs.yml", *(ROOT / "docs").rglob("*"), *(ROOT / "src" / "iclab").rglob("*.py")]
    return max(p.stat().st_mtime for p in paths if p.is_file())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    stamp = SITE / "tutorial-seconds.json"  # written last by the build
    if stamp.is_file() and stamp.stat().st_mtime >= _newest_source():
        return SITE
    pytest.importorskip("mkdocs")
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("the docs build needs node and npm (KaTeX)")
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


def test_build_executed_every_tutorial(site):
    seconds = json.loads((site / "tutorial-seconds.json").read_text())
    assert sorted(seconds) == sorted(TUTORIALS)
    for name in TUTORIALS:
        page = (site / "tutorials" / f"{name}.html").read_text()
        assert "Traceback" not in page and "AssertionError" not in page
        assert (site / "tutorials" / name / "figure-1.png").stat().st_size > 10_000


def test_site_in_a_real_browser_from_the_file_system(site, chromium_browser):
    browser = chromium_browser
    errors, outside = [], []
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def only_files(route):
        if route.request.url.startswith(("file://", "data:", "blob:")):
            route.continue_()
        else:  # nothing may be fetched at view time
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_files)

    page.goto((site / "index.html").as_uri())
    assert "iclab" in page.title()
    text = page.inner_text("article")
    assert "make demo" in text and "make test" in text
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "docs-index.png"), full_page=True)

    # the API reference: plateau_losses with its formula rendered by KaTeX, in KaTeX's own fonts
    page.goto((site / "api" / "iclab.theory.linattn.html").as_uri())
    heading = page.locator('[id="iclab.theory.linattn.plateau_losses"]')
    assert heading.count() == 1
    entry = heading.locator("xpath=..")
    assert entry.locator(".katex").count() >= 1
    assert entry.locator(".katex-error").count() == 0
    tex = " ".join(entry.locator(".katex-mathml annotation").all_text_contents())
    assert r"\operatorname{tr}\Lambda" in tex and r"\sum _{d\le m}" in tex
    page.evaluate("document.fonts.ready")
    assert page.evaluate("document.fonts.check('16px KaTeX_Main')")
    entry.screenshot(path=str(ARTIFACTS / "docs-plateau-losses.png"))

    # every tutorial page shows its figure
    for name in TUTORIALS:
        page.goto((site / "tutorials" / f"{name}.html").as_uri())
        images = page.eval_on_selector_all(
            "article img", "els => els.map(e => [e.getAttribute('src'), e.complete && e.naturalWidth])")
        figures = [(src, width) for src, width in images if src.startswith(f"{name}/figure-")]
        assert figures, f"no figure on the {name} tutorial"
        for src, width in figures:
            assert width and width > 0, f"figure not loaded: {src} on {name}"
        assert page.locator("text=assert").count() >= 1  # the theory check is on the page

    # the Benchmarks page shows its bar charts, rendered at build time from the measurement records
    from iclab import measure

    measured = measure.load()
    page.goto((site / "benchmarks.html").as_uri())
    images = page.eval_on_selector_all(
        "article img", "els => els.map(e => [e.getAttribute('src'), e.complete && e.naturalWidth])")
    charts = {src: width for src, width in images if src.startswith("benchmarks/")}
    expected = {f"benchmarks/{kind}.png" for kind in ("speedups", "floors")
                if any(measured.ratios(b)[kind] for b in measured.benches)}
    assert set(charts) == expected
    for src, width in charts.items():
        assert width and width > 0, f"figure not loaded: {src} on the Benchmarks page"
    if expected:
        page.screenshot(path=str(ARTIFACTS / "docs-benchmarks.png"), full_page=True)
    else:
        assert "No benchmark has been measured yet" in page.inner_text("article")
    assert not outside, outside
    assert not errors, errors
