"""The notebooks as a person sees them: JupyterLab in headless Chromium, every cell run, the page checked.

Python tests pass while the page a person sees can be broken: a frontend extension missing, a renderer
that does not match, a widget that never updates, a figure with nothing drawn. Here JupyterLab serves
copies of `notebooks/00_quickstart.ipynb` (trains with the progress bar and the live dashboard),
`notebooks/01_memory_hierarchy.ipynb` (a measured CPU session, the planner's tables and figures) and
`notebooks/02_overlap_stalls.ipynb` (figures of the recorded H200 traces in tests/fixtures) on 127.0.0.1
with a token; Debian's Chromium, driven by Playwright, opens each, runs all cells from the Run menu and
reads the DOM: no error output and no stderr output (no warning wall), the progress bar at its end, the
dashboard's numbers changing while training runs, the live dashboard replaced by its static figure when
training ends (saved with the notebook, and drawn again when the saved notebook is reopened, with no "Error
displaying widget"), every plotly figure drawn with at least one trace and a title, no two legend entries of a
figure in one colour, no console error.
Screenshots of the dashboard and of every figure go to `out/browser/` (or $MEGATRAIN_BROWSER_ARTIFACTS).

Needs `/usr/bin/chromium` (Debian's, `apt-get install chromium`; another path with $MEGATRAIN_CHROMIUM) and
the `playwright` package (the dev extra); Playwright's own browser downloads are never used. Without them
these tests SKIP, saying what to install, unless $MEGATRAIN_REQUIRE_BROWSER=1: then they FAIL. `.ci/run`
installs both and sets it, so CI never passes without having looked at the page.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MEGATRAIN_CHROMIUM", "/usr/bin/chromium")
REQUIRED = os.environ.get("MEGATRAIN_REQUIRE_BROWSER", "") not in ("", "0")  # .ci/run sets it: fail, never skip
ENABLE = ("to run them: apt-get install chromium (Debian's, at /usr/bin/chromium) and pip install -e '.[dev]' "
          "(playwright; never `playwright install`); MEGATRAIN_REQUIRE_BROWSER=1 makes them fail instead of skip")


def _missing() -> str | None:
    """What the browser tests lack on this machine, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM}"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=f"browser tests skipped: {MISSING}; {ENABLE}")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("MEGATRAIN_BROWSER_ARTIFACTS", REPO / "out" / "browser"))
STEPS = 40  # what 00_quickstart trains: s.train(batches, steps=40)
NOTEBOOKS = ("00_quickstart.ipynb", "01_memory_hierarchy.ipynb", "02_overlap_stalls.ipynb")
RUN_S = 480  # a notebook's cells must all have run by then (00 takes ~80 s on 2 busy CPU cores)
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DASHBOARD_TITLE = "megatrain dashboard"  # the static figure that replaces the live dashboard (Dashboard.finish)
# JupyterLab settings of the fresh settings dir: every cell kept in the DOM (not windowed out of view)
# so each figure can be read; no news or update checks (there is no network); no autosave (the test
# saves once, after the run, and reads that file).
SETTINGS = {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
            "@jupyterlab/docmanager-extension/plugin": {"autosave": False}}

NB = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"  # the notebook on show, not one in a hidden tab
# One poll of the page: each code cell's prompt ("[3]:", "[*]:", "[ ]:") and dashboard header text.
_CELLS_JS = """() => [...document.querySelectorAll('%NB .jp-CodeCell')].map(c => [
    c.querySelector('.jp-InputArea-prompt')?.textContent.trim() ?? '',
    c.querySelector('.megatrain-header')?.textContent ?? null])""".replace("%NB", NB)
# Every plotly figure: its code cell, whether it is in a widget (the dashboard), title, traces in its
# data, and traces really drawn (SVG groups of class "trace", outside the legend, holding a path with
# a shape: plotly draws a hidden bar as "M0,0Z").
_FIGURES_JS = """() => {
  const cells = [...document.querySelectorAll('%NB .jp-CodeCell')];
  return [...document.querySelectorAll('%NB .js-plotly-plot')].map(el => ({
    cell: cells.indexOf(el.closest('.jp-CodeCell')),
    in_widget: el.closest('.widget-output') !== null,
    title: el.querySelector('.gtitle')?.textContent ?? '',
    renderer: el.classList.contains('jp-RenderedPlotly') ? 'jupyterlab-plotly' : 'html',
    traces: (el.data ?? []).length,
    drawn: [...el.querySelectorAll('g.trace')].filter(g => !g.closest('.legend') && [...g.querySelectorAll('path')]
        .some(p => { const d = p.getAttribute('d') ?? ''; return d.length > 6 && d !== 'M0,0Z'; })).length}));
}""".replace("%NB", NB)
# The progress bars on the page (ipywidgets' IntProgress), width and the text beside each.
_BARS_JS = """[...document.querySelectorAll('%NB .widget-hprogress')].map(el => ({
    width: el.querySelector('.progress-bar')?.style.width ?? '',
    text: el.closest('.widget-hbox')?.innerText ?? ''}))""".replace("%NB", NB)
# Every text a dashboard header showed, and the progress bars beside it, recorded in the page itself as the DOM
# changes: the Python loop below polls, and a screenshot or a busy box can make it miss a whole short run. At each
# header of a step mid-run (1 .. STEPS - 1) the page also keeps a copy of the dashboard's DOM as drawn (plotly
# draws SVG), so the mid-run picture can be taken after the run where no poll caught the live widget.
_WATCH_HEADERS_JS = """() => {
  window.__mtHeaders = [];
  window.__mtLive = null;
  window.__mtBars = [];
  const note = () => document.querySelectorAll('%NB .megatrain-header').forEach(el => {
    const t = el.textContent, h = window.__mtHeaders;
    if (h.length !== 0 && h[h.length - 1] === t) return;
    h.push(t);
    const m = t.match(/step\\s+(\\d+)/), step = m ? Number(m[1]) : 0;
    const dash = document.querySelector('%NB .widget-vbox:has(.megatrain-header)');
    if (dash && step > 0 && step < %STEPS) window.__mtLive = dash.cloneNode(true);
    const bars = %BARS;
    if (bars.length) window.__mtBars = bars;
  });
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, characterData: true});
}""".replace("%NB", NB).replace("%STEPS", str(STEPS)).replace("%BARS", _BARS_JS)
# The kept copy, shown on top of the page at the live widget's width, for its screenshot.
_SHOW_LIVE_COPY_JS = """() => {
  if (!window.__mtLive) return false;
  const box = document.createElement('div');
  box.id = 'mt-live-copy';
  box.className = 'jp-Notebook jp-OutputArea-output';
  box.style.cssText = 'position:fixed;left:0;top:0;width:1200px;background:white;z-index:100000;padding:8px';
  box.appendChild(window.__mtLive);
  document.body.appendChild(box);
  return true;
}"""
_PROGRESS_JS = "() => " + _BARS_JS


@dataclass
class Seen:
    """What the browser saw of one notebook run."""

    prompts: list[str]
    live_headers: list[str] = field(default_factory=list)  # dashboard header texts while its cell ran
    running_shot: str = ""  # where the mid-run picture came from: the live widget, or the page's copy of it
    live_progress: list[dict] = field(default_factory=list)  # the last progress bars seen while a cell ran
    final_header: str | None = None  # the title of the static dashboard that replaced the widget
    figures: list[dict] = field(default_factory=list)
    progress: list[dict] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    saved: dict | None = None  # the notebook as JupyterLab saved it after the run
    reopened: list[dict] = field(default_factory=list)  # figures of the saved notebook opened afresh, not run
    reopened_text: str = ""  # the reopened notebook's text
    screenshots: list[Path] = field(default_factory=list)


@pytest.fixture(autouse=True)
def _watchdog():
    """Overrides conftest's 120 s watchdog: one notebook run may take minutes on a busy machine."""
    faulthandler.dump_traceback_later(900, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, serving a copy of notebooks/ and tests/fixtures/ (so the
    run never writes outputs into the repository), with fresh config, settings and workspace dirs."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    shutil.copytree(REPO / "notebooks", root / "notebooks")
    shutil.copytree(REPO / "tests" / "fixtures", root / "tests" / "fixtures")  # 02 reads ../tests/fixtures
    for name, value in SETTINGS.items():
        path = tmp / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),  # this checkout
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the kernel's python
    log_path = tmp / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True",  # CI runs as root
             "--LabApp.extension_manager=readonly"],  # no PyPI queries
            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 120 s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "root": root, "log": log_path}
    finally:
        proc.terminate()  # the server shuts its kernels down
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's Chromium under Playwright, fresh user data dir. Reached only where both are installed or
    MEGATRAIN_REQUIRE_BROWSER is set (the module skips otherwise); fails when it cannot start."""
    if MISSING is not None:  # only under MEGATRAIN_REQUIRE_BROWSER=1
        pytest.fail(f"MEGATRAIN_REQUIRE_BROWSER is set and {MISSING}; {ENABLE}")
    from playwright.sync_api import sync_playwright
    pw = sync_playwright().start()
    try:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 2400})  # tall: a whole dashboard fits in one screenshot
    except Exception as e:
        pw.stop()
        pytest.fail(f"Chromium ({CHROMIUM}) did not start under Playwright: {type(e).__name__}: {e}")
    try:
        yield ctx
    finally:
        ctx.close()
        pw.stop()


def _step_of(header: str) -> int | None:
    m = re.search(r"step\s+(\d+)", header)
    return int(m.group(1)) if m else None


def _run(lab, ctx, name: str) -> Seen:
    """Open notebook `name`, run all cells, watch the page until every cell has run, read it back."""
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    stem = name.removesuffix(".ipynb")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{stem}-dashboard-running.png").unlink(missing_ok=True)  # an earlier run's says nothing of this one
    seen = Seen(prompts=[])
    # A workspace of its own, reset: only this notebook open (not the one of the previous test).
    page.goto(f"{lab['url']}/lab/workspaces/{stem}/tree/notebooks/{name}?reset&token={lab['token']}")
    page.locator(f"{NB} .jp-CodeCell").first.wait_for(timeout=120_000)
    page.get_by_text("| Idle").wait_for(timeout=120_000)  # the kernel's status in the status bar
    page.evaluate(_WATCH_HEADERS_JS)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    deadline, shot_live = time.monotonic() + RUN_S, False
    while True:
        cells = page.evaluate(_CELLS_JS)
        seen.prompts = [p for p, _ in cells]
        for prompt, header in cells:
            if header is not None and prompt == "[*]:" and (not seen.live_headers or seen.live_headers[-1] != header):
                seen.live_headers.append(header)
                step = _step_of(header)
                if not shot_live and step is not None and 0 < step < STEPS:  # mid-run: the picture for docs/
                    dash = page.locator(f"{NB} .widget-vbox:has(.megatrain-header)").first
                    try:  # the live widget goes when training ends (its static figure replaces it)
                        path = _shot(dash, f"{stem}-dashboard-running.png")
                        after_text = dash.locator(".megatrain-header").inner_text(timeout=2000)
                        after = _step_of(after_text)
                    except Exception:
                        continue
                    if after is not None and after != step:  # the live header moved on while the shot was taken
                        seen.live_headers.append(after_text)
                    shot_live = after is not None and after < STEPS  # else the run ended: try again if it has not
                    if path not in seen.screenshots:
                        seen.screenshots.append(path)
        if any(p == "[*]:" for p in seen.prompts):
            bars = page.evaluate(_PROGRESS_JS)
            if bars:  # the bar sits in the dashboard, which the static figure replaces at the end
                seen.live_progress = bars
        if all(re.fullmatch(r"\[\d+\]:", p) for p in seen.prompts):
            break
        if time.monotonic() > deadline:
            break  # the tests below say which cells never ran
        time.sleep(0.1)
    page.wait_for_timeout(1500)  # let the last figures finish drawing
    drawn = page.evaluate("() => window.__mtHeaders")  # every header the page drew, in order: what the polls
    if drawn:                                            # saw and what they missed
        seen.live_headers = drawn
    if not seen.live_progress:  # no poll caught a bar while the cell ran: the bars the page drew beside a live header
        seen.live_progress = page.evaluate("() => window.__mtBars")
    if not shot_live and page.evaluate(_SHOW_LIVE_COPY_JS):  # no poll caught the live widget mid-run (a short
        path = _shot(page.locator("#mt-live-copy"), f"{stem}-dashboard-running.png")  # run, a busy box): the
        page.evaluate("() => document.getElementById('mt-live-copy').remove()")      # page's copy of it
        seen.screenshots.append(path)
        seen.running_shot = "the page's copy of the live dashboard"
    elif shot_live:
        seen.running_shot = "the live dashboard"
    seen.figures = page.evaluate(_FIGURES_JS)
    seen.progress = page.evaluate(_PROGRESS_JS)
    finals = [f["title"] for f in seen.figures if f["title"].startswith(DASHBOARD_TITLE)]
    seen.final_header = finals[0] if finals else None
    plots = page.locator(f"{NB} .js-plotly-plot")
    for k in range(plots.count()):
        fig = seen.figures[k]
        where = ("dashboard-final" if fig["title"].startswith(DASHBOARD_TITLE)
                 else "dashboard" if fig["in_widget"] else f"cell{fig['cell']}")
        seen.screenshots.append(_shot(plots.nth(k), f"{stem}-fig{k:02d}-{where}.png"))
    seen.saved = _save(page, lab["root"] / "notebooks" / name)
    seen.console_errors = errors
    page.close()
    _shut_down_kernels(lab)
    # The saved notebook opened afresh (a reload: no kernel state, no widget models): what it shows.
    page = ctx.new_page()
    page.on("console", lambda m: errors.append(f"console.{m.type} (reopened): {m.text}") if m.type == "error" else None)
    page.goto(f"{lab['url']}/lab/workspaces/{stem}-reopened/tree/notebooks/{name}?reset&token={lab['token']}")
    page.locator(f"{NB} .jp-CodeCell").first.wait_for(timeout=120_000)
    page.wait_for_timeout(3000)  # let the saved figures draw
    # JupyterLab windows a long notebook (only the cells in view are drawn): scroll it through, keeping every
    # figure seen on the way, the last output's dashboard included
    page.locator(NB).first.hover()
    found, text = [], ""
    for _ in range(80):
        found += [f for f in page.evaluate(_FIGURES_JS) if f not in found]
        text += page.locator(NB).first.inner_text()
        if any(f["title"].startswith(DASHBOARD_TITLE) and f["drawn"] >= 1 for f in found):
            break
        page.mouse.wheel(0, 700)
        page.wait_for_timeout(400)
    seen.reopened, seen.reopened_text = found, text
    page.close()
    _shut_down_kernels(lab)
    return seen


def _shut_down_kernels(lab) -> None:
    """Stop the notebook's kernel through the server's REST API, so the next notebook runs alone."""
    url, auth = f"{lab['url']}/api/sessions", {"Authorization": f"token {lab['token']}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10) as r:
        sessions = json.load(r)
    for sess in sessions:
        req = urllib.request.Request(f"{url}/{sess['id']}", headers=auth, method="DELETE")
        urllib.request.urlopen(req, timeout=60).close()


def _shot(locator, filename: str) -> Path:
    """A screenshot of the element's box. Not `locator.screenshot`, which waits for the element to hold
    still: a dashboard redrawn every second on a busy machine may never do so."""
    path = ARTIFACTS / filename
    locator.page.mouse.move(0, 0)  # no hover: plotly's mode bar stays hidden
    locator.evaluate("el => el.scrollIntoView({block: 'start'})")
    box = locator.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0, f"{filename}: nothing to see ({box})"
    locator.page.screenshot(path=str(path), clip=box, animations="disabled")
    return path


def _save(page, path: Path) -> dict:
    """Save the notebook from the page (what the frontend holds) and read the file back."""
    before = path.stat().st_mtime_ns
    page.locator(NB).first.click(position={"x": 5, "y": 5})
    page.keyboard.press("ControlOrMeta+s")
    deadline = time.monotonic() + 60
    while path.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"JupyterLab did not save {path.name} within 60 s")
        time.sleep(0.2)
    time.sleep(0.5)  # the contents API writes the file in one go; give it a moment to finish
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def seen(browser, lab):  # browser first: a missing Chromium fails before JupyterLab starts
    """notebook name -> Seen, each notebook run once for all the tests of this module (a run that
    failed fails each test that asks for it, without running again)."""
    runs: dict[str, Seen | Exception] = {}

    def get(name: str) -> Seen:
        if name not in runs:
            try:
                runs[name] = _run(lab, browser, name)
            except Exception as e:
                runs[name] = e
        if isinstance(runs[name], Exception):
            raise runs[name]
        return runs[name]

    return get


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_cell_ran_without_an_error_output(seen, name):
    s = seen(name)
    assert s.prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in s.prompts), \
        f"cells that never finished (prompt [ ] or [*]) within {RUN_S} s: {s.prompts}"
    errors = [(k, o.get("ename"), o.get("evalue")) for k, c in enumerate(s.saved["cells"]) if c["cell_type"] == "code"
              for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors
    assert sum(len(c.get("outputs", [])) for c in s.saved["cells"]) > 0  # the saved file does hold the run
    stderr = [(k, "".join(o.get("text", ""))[:300]) for k, c in enumerate(s.saved["cells"]) if c["cell_type"] == "code"
              for o in c["outputs"] if o["output_type"] == "stream" and o.get("name") == "stderr"]
    assert not stderr, f"cells that wrote to stderr (a warning, a log line): {stderr}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_plotly_figure_drew_a_trace_and_has_a_title(seen, name):
    s = seen(name)
    in_cells = sum(1 for c in s.saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]
                   if PLOTLY_MIME in o.get("data", {}))
    assert in_cells > 0
    # the live dashboard's figures are gone: its static figure (one plotly output) replaced them
    assert len(s.figures) == in_cells, "a plotly output did not render as a plotly figure"
    for fig in s.figures:
        assert fig["traces"] >= 1 and fig["drawn"] >= 1, f"figure with nothing drawn: {fig}"
        # JupyterLab's plotly renderer (plotly.js bundled in the labextension, no CDN). Plotly's HTML
        # fallback also draws offline here, but only in a trusted notebook: reopened, it stays blank.
        assert fig["renderer"] == "jupyterlab-plotly", f"drawn by plotly's HTML fallback: {fig}"
        assert fig["title"].strip(), f"figure without a title: {fig}"
    assert all(path.stat().st_size > 5000 for path in s.screenshots)


def _colour_clashes(figure: dict) -> list:
    """Legend entries of one saved plotly figure told apart by colour alone that share a colour.

    Traces are compared within one look (marker symbol, line dash, bar pattern): where a figure varies those
    by another column (px's ``symbol=`` / ``line_dash=``), its traces of one colour are one category under
    different marks. A facet repeats a name with its colour, which is no clash."""
    names: dict = {}
    for t in figure.get("data", []):
        marker, line = t.get("marker") or {}, t.get("line") or {}
        colour = marker.get("color") if isinstance(marker.get("color"), str) else line.get("color")
        if not isinstance(colour, str) or t.get("showlegend") is False:
            continue
        look = (marker.get("symbol"), line.get("dash"), (marker.get("pattern") or {}).get("shape"))
        names.setdefault((look, colour.lower()), set()).add(t.get("legendgroup") or t.get("name"))
    return [(look, colour, sorted(map(str, n))) for (look, colour), n in names.items() if len(n) > 1]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_two_legend_entries_of_a_figure_share_a_colour(seen, name):
    """plotly's default sequence has 10 colours: an 11th category drew in the first one's colour (device memory
    by category read as fp32 master weights). The palette (``view/palette.py``) gives each its own."""
    s = seen(name)
    clashes = [(k, o["data"][PLOTLY_MIME].get("layout", {}).get("title", {}).get("text", ""), _colour_clashes(
        o["data"][PLOTLY_MIME])) for k, c in enumerate(s.saved["cells"]) if c["cell_type"] == "code"
        for o in c["outputs"] if PLOTLY_MIME in o.get("data", {})]
    assert len(clashes) > 0
    assert not [c for c in clashes if c[2]], [c for c in clashes if c[2]]


def test_the_progress_bar_sat_in_the_dashboard_and_reached_its_end(seen):
    s = seen("00_quickstart.ipynb")
    assert len(s.live_progress) == 1, s.live_progress  # one bar, in the dashboard under its header
    assert not s.progress  # gone with the live widget at the end ...
    assert f"{STEPS} of {STEPS} this run" in s.final_header  # ... where the static figure's title counts the run


def test_the_dashboard_numbers_changed_while_training_ran(seen):
    s = seen("00_quickstart.ipynb")
    steps = [_step_of(h) for h in s.live_headers]
    assert len(set(s.live_headers)) >= 2, f"the dashboard header did not change while training: {s.live_headers}"
    assert any(st is not None and 0 < st < STEPS for st in steps), f"no step seen mid-run: {s.live_headers}"
    known = [st for st in steps if st is not None]
    assert known == sorted(known)  # the step only goes up
    assert _step_of(s.final_header) == STEPS and "loss" in s.final_header
    assert (ARTIFACTS / "00_quickstart-dashboard-running.png").exists() and s.running_shot, s.running_shot


def test_the_live_dashboard_became_a_static_figure_the_saved_notebook_keeps(seen):
    """Training ends: the widget's output is replaced by a plotly figure (no widget state needed), so the saved
    file holds it and a reopened notebook draws it instead of "Error displaying widget: model not found"."""
    s = seen("00_quickstart.ipynb")
    outputs = [o for c in s.saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    finals = [o for o in outputs if DASHBOARD_TITLE in str(o.get("data", {}).get(PLOTLY_MIME, {}).get("layout", {})
                                                            .get("title", ""))]
    assert len(finals) == 1, "the static dashboard is not in the saved notebook"
    assert "text/html" in finals[0]["data"]  # nbviewer draws the HTML
    assert not [o for o in outputs if WIDGET_MIME in o.get("data", {})], "a live widget output was saved"
    drawn = [f for f in s.reopened if f["title"].startswith(DASHBOARD_TITLE)]
    assert drawn and drawn[0]["drawn"] >= 1 and drawn[0]["renderer"] == "jupyterlab-plotly", s.reopened
    assert "Error displaying widget" not in s.reopened_text


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_browser_console_shows_no_error(seen, name):
    assert seen(name).console_errors == []
