"""The web page in headless Chromium, driven by Playwright: a search from ?q= draws result images with
labelled boxes, and a person's pointer, keyboard, drop and paste work on it.

Playwright drives Debian's Chromium (/usr/bin/chromium, `executable_path`): it downloads no browser of
its own. Its input is Chromium's input pipeline, not JavaScript: a hover moves the mouse there (CSS
`:hover` applies; the element must be visible, and hit by the pointer, not covered by another), a click
presses and releases a button over it, keys are typed. The drop of a file goes through the same pipeline
(the DevTools `Input.dispatchDragEvent`, which Playwright's API lacks for files) with a real file from
the disk; the paste is a real Control+V of an image the page put on Chromium's clipboard with the
clipboard permissions granted. Every event the page sees is a trusted one (`isTrusted`); none is built
in JavaScript. Nothing here reaches the operating system's pointer or clipboard: headless Chromium has
neither.

Screenshots go to artifacts/screenshots/ (git-ignored: most show data-set images). The one of the
synthetic shapes collection, service-shapes.png, is also the documentation's picture of the page:
copy it to docs/screenshots/ to refresh that (it shows no Flickr8K pixels).
"""

from __future__ import annotations

import re
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import Browser, Page, ViewportSize, sync_playwright

from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from fragsearch.settings import Settings, default_artifacts_dir
from tests import labelled
from tests.conftest_service import make_settings
from tests.uvicorn_thread import uvicorn_server

if TYPE_CHECKING:
    from tests.conftest import ShapesModel
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
        "--disable-component-update", "--disable-sync")
VIEWPORT: ViewportSize = {"width": 1280, "height": 1000}
SCREENSHOTS = default_artifacts_dir() / "screenshots"

# skipped without Chromium, but failed under CI (.ci/run installs it): the page must be tested there
pytestmark = pytest.mark.required(CHROMIUM.is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, headless, started once for the module."""
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(ARGS), timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh context (no cookies, storage, clipboard permission) and its page, 1280x1000."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def show(page: Page, url: str, state: str = "done") -> None:
    """Open `url` and wait for the page's first answer (body data-state `state`)."""
    page.goto(url)
    page.wait_for_function(f"document.body.dataset.state === {state!r}")


def dom(page: Page, url: str, state: str = "done") -> str:
    """The page's DOM once it has answered, as Chromium serialises it."""
    show(page, url, state)
    return page.content()


def shoot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / name
    page.screenshot(path=str(shot))
    return shot


def page_url(base: str, query: str, **params: str) -> str:
    return f"{base}/?" + urllib.parse.urlencode({"q": query, **params})


@pytest.fixture(scope="module")
def served(service_env: ServiceEnv) -> Iterator[str]:
    with uvicorn_server(create_app(service_env.settings, engine=service_env.engine)) as base:
        yield base


@pytest.fixture(scope="module")
def served_calibrated(calibrated_engine: Engine) -> Iterator[str]:
    """A model with the relevance scale: its results carry a relevance and the page a cut-off."""
    with uvicorn_server(create_app(calibrated_engine.settings, engine=calibrated_engine)) as base:
        yield base


@pytest.fixture(scope="module")
def served_labelled(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A model whose regions carry the COCO detector's classes, over the Flickr8K photo of two dogs (extracted
    with the real detector): the regions it finds are named "dog" (tests/labelled.py)."""
    root = tmp_path_factory.mktemp("labelled")
    photo = root / labelled.DOG
    shutil.copyfile(labelled.dog_photo_path(), photo)
    bundle = labelled.labelled_bundle()
    images, _ = labelled.dog_index(root / "images", bundle, photo)
    images.save()
    settings = make_settings(shapes_model, root)
    with uvicorn_server(create_app(settings, engine=Engine(settings, bundle, images, None))) as base:
        yield base


def test_the_detectors_names_of_regions_on_the_page(served_labelled: str, page: Page) -> None:
    """Each drawn region the detector named carries its name in the box's corner, as the API's `label`: in the
    alignment of a search, and in the region search's boxes and captions; unnamed regions carry none."""
    import httpx

    sentence = labelled.DOG_SENTENCE
    answer = httpx.post(f"{served_labelled}/search/images", json={"sentence": sentence, "k": 1}, timeout=60).json()
    alignment = answer["results"][0]["alignment"]
    named = {m["fragment"]: m["label"] for m in alignment}
    # the regions drawn as boxes: those of the matched triplets (the whole-sentence fragment is a frame label)
    aligned = {m["fragment"] for m in alignment if m["score"] > 0 and m["relation"] != "<sentence>"}
    show(page, page_url(served_labelled, sentence, k="1"))
    page.locator(".card .overlay .box").first.wait_for(state="attached")
    boxes = """[...document.querySelectorAll('#results .card .box')].map(b => [Number(b.dataset.fragment),
        b.querySelector('.region-name')?.textContent ?? null])"""
    top = page.evaluate(boxes)
    # each drawn region carries the API's label of its fragment, named or not; with "show all" every aligned one
    assert top and all(named[f] == name for f, name in top), (top, named)
    if page.locator("#results .card .show-all").count():
        page.locator("#results .card .show-all").first.click()
    shown = page.evaluate(boxes)
    assert sorted(f for f, _ in shown) == sorted(f for f, m in named.items() if f in aligned)
    assert all(named[f] == name for f, name in shown) and "dog" in {name for _, name in shown}, (shown, named)

    regions = httpx.post(f"{served_labelled}/search/fragments", json={"phrase": "brown dog", "k": 20},
                         timeout=60).json()["results"]
    assert {r["label"] for r in regions} == {None, "dog"}
    show(page, page_url(served_labelled, "brown dog", mode="regions", k="20"))
    page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.complete)")
    html = page.content()
    captions = re.findall(r"<figcaption><strong>#\d+ </strong>[^<]* · region (\d+)(?: \((\w+)\))?</figcaption>", html)
    assert [(int(f), label or None) for f, label in captions] == [(r["fragment"], r["label"]) for r in regions]
    assert re.findall(r'<span class="region-name"[^>]*>([^<]*)</span>', html) == \
        [r["label"] for r in regions if r["label"]]
    shoot(page, "service-labels.png")


def test_search_from_the_page_draws_images_and_boxes(served: str, page: Page) -> None:
    url = page_url(served, "a red circle beside a blue square", k="4")
    html = dom(page, url)
    assert len(re.findall(r'<figure class="card"', html)) == 4
    assert len(re.findall(r'<img class="result-img" src="/images/\d+/thumbnail\?size=256"', html)) == 4
    assert len(re.findall(r'<button type="button" class="why">', html)) == 4
    assert len(re.findall(r'<button type="button" class="like">', html)) == 4
    boxes = re.findall(r'<div class="box( whole)?"', html)
    assert boxes, "aligned regions are drawn as boxes"
    labels = re.findall(r'<span class="label" title="([^"]*)"[^>]*>([^<]+)</span>', html)
    # a triplet reads as its words ("red circle" for amod(circle, red)); its notation is the label's title
    triplets = [(m.groups(), text.rsplit(" ", 1)) for title, text in labels
                if (m := re.fullmatch(r"(\w+)\((\w+), (\w+)\)", title))]
    assert triplets, labels[:5]
    for (rel, head, dep), (words, score) in triplets:
        assert re.fullmatch(r"-?\d+\.\d\d", score) and "(" not in words
        assert set(words.replace(",", "").split()) >= {head, dep}, (rel, head, dep, words)
        if rel == "amod":
            assert words == f"{dep} {head}", words
    page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.complete)")
    shot = shoot(page, "service-shapes.png")
    assert shot.stat().st_size > 10_000


def test_more_like_this_from_the_page(served: str, service_env: ServiceEnv, page: Page) -> None:
    query = service_env.engine.images.search("a red circle", 1).hits[0]
    html = dom(page, f"{served}/?" + urllib.parse.urlencode({"like": query.image_id, "k": 3}))
    ids = re.findall(r'<figure class="card" data-id="(\d+)"', html)
    assert len(ids) == 3 and str(query.image_id) not in ids
    assert f"images like image {query.image_id} (described as" in html
    assert re.search(r'<div class="box( whole)?"', html), "each result shows the described triplets' regions"


def test_region_search_from_the_page(served: str, page: Page) -> None:
    show(page, page_url(served, "red circle", mode="regions", k="3"))
    # a region's box is drawn once its image has loaded (its natural size places the box)
    page.locator(".card .overlay .box").first.wait_for(state="attached")
    html = page.content()
    assert len(re.findall(r'<figure class="card"', html)) == 3
    assert re.search(r'<div class="box( whole)?"', html)


def test_a_bad_query_shows_the_error(served: str, page: Page) -> None:
    html = dom(page, page_url(served, "zzxqv blorptang"), state="error")
    assert "fragment" in html
    assert '<figure class="card"' not in html


@pytest.mark.slow
def test_screenshot_of_the_flickr8k_page(page: Page) -> None:
    """The page answering "a dog runs through the grass" on the embedded default's dev index (a model
    with the whole-sentence fragment: drawn as a frame label, not as a region)."""
    settings = Settings(_env_file=None, warmup=False)  # type: ignore[call-arg]
    if not (settings.model_path.is_file() and settings.image_index.exists()):
        pytest.skip("the embedded default's model and dev index are not built (python -m fragsearch.service)")
    with uvicorn_server(create_app(settings)) as base:
        import httpx

        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the service did not become ready"
            time.sleep(0.5)
        html = dom(page, page_url(base, "a dog runs through the grass", k="8"))
        assert re.search(r'<div class="box', html)
        # the whole-sentence fragment is a label on the frame, never a region box's label
        assert re.search(r'<div class="frame-label"[^>]*><span class="label"[^>]*>whole sentence \d', html)
        box_labels = re.findall(r'<div class="box[^"]*"[^>]*><div class="labels">(.*?)</div>', html)
        assert box_labels and not any("whole sentence" in b or "&lt;sentence&gt;" in b for b in box_labels)
        page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.complete)")
        assert shoot(page, "service-flickr8k-dog.png").is_file()


def drop_file(page: Page, path: Path, x: float, y: float) -> None:
    """Drag the file at `path` over the point (x, y) of the viewport and drop it there, through
    Chromium's input pipeline (the DevTools Input.dispatchDragEvent: the page gets trusted dragenter,
    dragover and drop events whose DataTransfer holds the file as Chromium read it from the disk)."""
    session = page.context.new_cdp_session(page)
    data = {"items": [], "files": [str(path)], "dragOperationsMask": 1}  # 1: copy
    try:
        for kind in ("dragEnter", "dragOver"):
            session.send("Input.dispatchDragEvent", {"type": kind, "x": x, "y": y, "data": data})
        # while a file is dragged over it, the page shows where it may be dropped
        assert page.evaluate("document.body.classList.contains('dropping')")
        session.send("Input.dispatchDragEvent", {"type": "drop", "x": x, "y": y, "data": data})
    finally:
        session.detach()


def centre(page: Page, selector: str) -> tuple[float, float]:
    """The centre of the first element `selector` finds, scrolled into view, in viewport coordinates."""
    element = page.locator(selector).first
    element.scroll_into_view_if_needed()
    box = element.bounding_box()
    assert box is not None, f"{selector} is not laid out"
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def test_hover_why_drop_paste_and_more_like_this(served: str, service_env: ServiceEnv, browser: Browser,
                                                 tmp_path: Path) -> None:
    """A person's interactions, with real input: "more results" clicked adds the next page; the pointer
    over a triplet lights its region (CSS :hover holds, the box is drawn thicker) and over a region its
    triplets; a folded triplet is invisible until "show all"; "why?" opens the pair table; an image file
    dropped on the page and one pasted with Control+V are described, and "more like this" finds the
    indexed image the upload is a copy of."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=served)
    page = context.new_page()
    try:
        show(page, page_url(served, "a red circle beside a blue square", k="4"))
        page.click("#more")  # the next page joins the grid
        page.wait_for_function("document.querySelectorAll('#results .card').length === 8")
        assert page.locator("#results .card figcaption strong").nth(7).text_content() == "#8 "

        card = page.locator("#results .card").first
        item = card.locator(".legend li[data-fragment]:not(.folded):not(.dup)").first
        fragment = item.get_attribute("data-fragment")
        region = card.locator(f'.box[data-fragment="{fragment}"]')
        assert region.count() == 1
        width = "el => getComputedStyle(el).borderTopWidth"
        assert region.evaluate(width) != "4px"
        item.hover()  # the mouse moves onto the triplet: it must be visible and not covered
        assert item.evaluate("el => el.matches(':hover')")
        assert region.evaluate("el => el.classList.contains('hot')") and region.evaluate(width) == "4px"
        page.mouse.move(2, 2)  # and away: nothing stays lit
        assert not item.evaluate("el => el.matches(':hover')")
        assert card.locator(".hot").count() == 0
        region.hover()  # the pointer on the region (hit by it, not under another box) lights its triplets
        assert region.evaluate("el => el.matches(':hover')")
        assert card.locator(f'.legend li.hot[data-fragment="{fragment}"]').count() >= 1
        page.mouse.move(2, 2)

        folded = card.locator(".legend li.folded").first
        assert folded.count() == 1 and folded.is_hidden()  # a function-word triplet waits under "show all"
        card.locator(".show-all").click()
        assert folded.is_visible()
        folded.hover()
        assert folded.evaluate("el => el.matches(':hover')")
        card.locator(".show-all").click()
        assert folded.is_hidden()

        card.locator(".why").click()
        page.wait_for_function("document.querySelectorAll('#results .card .explain tbody tr').length > 0")
        assert "rank" in (card.locator(".explain p").first.text_content() or "")

        name = service_env.dev[0]
        dropped = tmp_path / "dropped.jpg"
        shutil.copyfile(service_env.image_path(name), dropped)
        x, y = centre(page, "#results .card:nth-child(2) .frame")
        page.mouse.move(x, y)  # the pointer is over a result when the file arrives there
        drop_file(page, dropped, x, y)
        page.wait_for_function("document.querySelectorAll('#annotation .sentences li').length > 0")
        assert not page.evaluate("document.body.classList.contains('dropping')")
        page.click("#similar-upload")
        page.wait_for_function("document.getElementById('search-status').textContent"
                               ".startsWith('4 images like dropped.jpg')")
        found = page.locator("#results .card figcaption").all_text_contents()
        assert any(name in text for text in found), found  # a dropped copy of an indexed image finds it
        shoot(page, "service-interactions.png")

        # paste: the page puts the image on Chromium's clipboard (as PNG, the image type the clipboard
        # takes), then Control+V pastes it
        page.evaluate("document.getElementById('annotation').replaceChildren()")
        image_id = service_env.engine.images.photos.find([service_env.image_path(name)])[
            str(service_env.image_path(name))]
        copied = page.evaluate(f"""fetch('/images/{image_id}').then(r => r.blob()).then(createImageBitmap)
            .then(bitmap => {{ const canvas = document.createElement('canvas');
                canvas.width = bitmap.width; canvas.height = bitmap.height;
                canvas.getContext('2d').drawImage(bitmap, 0, 0);
                return new Promise(done => canvas.toBlob(done, 'image/png')); }})
            .then(png => navigator.clipboard.write([new ClipboardItem({{'image/png': png}})]))
            .then(() => navigator.clipboard.read()).then(items => items[0].types)""")
        assert copied == ["image/png"], copied
        page.click("header h1")  # the page has the focus, as after a person's click
        page.keyboard.press("Control+V")
        page.wait_for_function("document.querySelectorAll('#annotation .sentences li').length > 0")
        page.click("#similar-upload")
        page.wait_for_function("/^4 images like .+\\.png/.test(document.getElementById('search-status').textContent)")
        found = page.locator("#results .card figcaption").all_text_contents()
        assert any(name in text for text in found), found  # the pasted pixels find their image too
    finally:
        context.close()


def test_more_regions_from_the_page(served: str, page: Page) -> None:
    """Region search pages like image search: "more results" adds the next ranks to the grid."""
    show(page, page_url(served, "red circle", mode="regions", k="3"))
    assert page.locator("#results .card").count() == 3
    page.click("#more")
    page.wait_for_function("document.querySelectorAll('#results .card').length === 6")
    ranks = page.locator("#results .card figcaption strong").all_text_contents()
    assert ranks == [f"#{r} " for r in range(1, 7)], ranks
    assert (page.text_content("#search-status") or "").startswith("6 regions")


def _card_labels(page: Page) -> list[dict[str, Any]]:
    """Per card: the labels drawn on boxes, the legend items shown, and whether it has a "show all"."""
    labels: list[dict[str, Any]] = page.evaluate("""[...document.querySelectorAll('#results .card')].map(card => ({
        boxes: [...card.querySelectorAll('.box .label')].map(l => l.textContent),
        listed: [...card.querySelectorAll('.legend li')].filter(li => getComputedStyle(li).display !== 'none')
                 .map(li => li.textContent),
        toggle: !!card.querySelector('.show-all')}))""")
    return labels


def test_cards_are_calm_top_content_triplets_and_show_all(served: str, service_env: ServiceEnv, page: Page) -> None:
    """At most three content triplets label a card, function-word relations (det ...) are folded under
    "show all", a triplet several descriptions share is listed once."""
    show(page, page_url(served, "a red circle beside a blue square", k="4"))
    cards = _card_labels(page)
    assert len(cards) == 4
    for card in cards:
        boxes, listed = card["boxes"], card["listed"]
        assert 1 <= len(boxes) <= 3 and len(listed) <= 3, card
        assert not any(str(t).startswith(("det(", "cc(", "aux(")) for t in boxes + listed), card
    assert any(c["toggle"] for c in cards), "the determiner triplets are folded, not dropped"
    shoot(page, "page-calm-cards.png")
    page.locator("#results .card .show-all").first.click()
    card = page.evaluate("""(() => { const card = document.querySelector('#results .card.all');
        return {boxes: card.querySelectorAll('.box .label').length,
                det: [...card.querySelectorAll('.legend li')].some(li => getComputedStyle(li).display !== 'none'
                      && li.textContent.startsWith('det('))}; })()""")
    assert card["boxes"] > 3 or card["det"], card
    shoot(page, "page-show-all.png")

    query = service_env.engine.images.search("a red circle", 1).hits[0]
    show(page, f"{served}/?" + urllib.parse.urlencode({"like": query.image_id, "k": 4}))
    for card in _card_labels(page):  # 5 descriptions share triplets: each is listed once
        listed = [str(t).rsplit(" ", 1)[0] for t in card["listed"]]
        assert len(listed) == len(set(listed)) and len(card["boxes"]) <= 3, card
    shoot(page, "page-more-like-this.png")


def test_relevance_bars_the_cut_off_and_no_good_match(served_calibrated: str, page: Page) -> None:
    show(page, page_url(served_calibrated, "a red circle", k="6", min_relevance="0"))
    bars = page.evaluate("[...document.querySelectorAll('#results .card .relevance')].map(b => "
                         "[parseFloat(b.querySelector('.fill').style.width), "
                         "parseFloat(b.querySelector('.value').textContent)])")
    assert len(bars) == 6 and all(0 <= w <= 100 and abs(w - 100 * v) < 0.6 for w, v in bars), bars
    assert [v for _, v in bars] == sorted((v for _, v in bars), reverse=True)
    shoot(page, "page-relevance.png")

    show(page, page_url(served_calibrated, "a red circle", k="6"))  # the default cut-off applies
    assert page.input_value("#min-relevance") == "0.5"
    shown = page.evaluate("[...document.querySelectorAll('#results .card:not(.weaker) .relevance .value')]"
                          ".map(v => parseFloat(v.textContent))")
    assert shown and all(v >= 0.5 for v in shown), shown
    weaker = page.evaluate("[...document.querySelectorAll('#results .card.weaker .relevance .value')]"
                           ".map(v => parseFloat(v.textContent))")
    assert all(v < 0.5 for v in weaker), weaker  # under the line, dimmed

    import httpx

    best = httpx.post(f"{served_calibrated}/search/images",
                      json={"sentence": "a red circle", "k": 1}).json()["results"][0]["relevance"]
    if best > 0.998:
        pytest.fail(f"the best relevance {best} leaves no room above it for a cut-off")
    cut = f"{best + 0.001:.4f}"
    show(page, page_url(served_calibrated, "a red circle", k="6", min_relevance=cut))
    assert page.evaluate("document.body.dataset.result") == "nomatch"
    assert page.locator("#results .card:not(.weaker)").count() == 0
    text = page.text_content("#results .no-match") or ""
    assert text.startswith("no good match: no image reaches relevance"), text
    # the ranking is still shown, under a line, dimmed: the page is never empty while images are ranked
    assert page.locator("#results .weaker-line").count() == 1
    assert page.locator("#results .card.weaker").count() == 6
    shoot(page, "page-no-good-match.png")


@pytest.fixture(scope="module")
def served_evidence(evidence_engine: Engine) -> Iterator[str]:
    """A model with phrase evidence over shapes pictures none of which holds a triangle."""
    with uvicorn_server(create_app(evidence_engine.settings, engine=evidence_engine)) as base:
        yield base


def test_a_phrase_not_found_on_the_page(served_evidence: str, page: Page) -> None:
    """"a red triangle" where no picture holds one: the reason names it, the results follow as weaker matches,
    each saying "triangle: not in this photo", its legend marking the triangle's fragments not found and no box
    drawn for them; "a red circle" draws the circle's region."""
    show(page, page_url(served_evidence, "a red triangle", k="4"))  # the page's default cut-off, 0.5
    assert page.evaluate("document.body.dataset.result") == "nomatch"
    assert "triangle" in (page.text_content("#results .no-match") or "")
    assert page.locator("#results .card.weaker").count() == 4
    missing = page.evaluate("[...document.querySelectorAll('#results .card .missing')].map(m => m.textContent)")
    assert len(missing) == 4 and all("triangle: not in this photo" in m for m in missing), missing
    legend = page.evaluate("[...document.querySelectorAll('#results .card .legend li.not-found')]"
                           ".map(li => li.textContent)")
    assert legend and all("not found" in t for t in legend), legend
    drawn = page.evaluate("[...document.querySelectorAll('#results .card .overlay .label')].map(l => l.textContent)")
    assert not any("triangle" in t for t in drawn), drawn
    shoot(page, "page-not-found.png")

    show(page, page_url(served_evidence, "a red circle", k="4", min_relevance="0"))
    drawn = page.evaluate("[...document.querySelectorAll('#results .card:first-child .overlay .label')]"
                          ".map(l => l.textContent)")
    assert any("circle" in t for t in drawn), drawn


def test_filters_on_the_page(served: str, page: Page) -> None:
    """The date and place fields go into the search; photos without EXIF (the shapes) never pass them,
    and the page says so. A model without the relevance scale has the cut-off field disabled. Emptying
    the fields and pressing the search button searches without them."""
    show(page, page_url(served, "a red circle", k="4", taken_after="2024-06-01", near="48.85,2.29,5"))
    assert page.evaluate("document.getElementById('filters').open") is True
    assert page.input_value("#near-km") == "5"
    assert page.is_disabled("#min-relevance")
    assert page.evaluate("document.body.dataset.result") == "nomatch"
    assert "no photo passes the date and place filters" in (page.text_content("#results .no-match") or "")
    shoot(page, "page-filters.png")
    for field in ("#taken-after", "#near-lat", "#near-lon", "#near-km"):
        page.fill(field, "")
    page.click("#search-form button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#results .card').length === 4")
    assert "taken_after" not in page.evaluate("location.search")


def test_each_result_names_its_file_copies_it_and_opens_the_original(served: str, browser: Browser) -> None:
    """A card shows the path the index holds (the API's `path`), its button puts it on the clipboard and
    its link opens the original; region mode loads thumbnails and shows the path too."""
    import httpx

    context = browser.new_context(viewport=VIEWPORT, permissions=["clipboard-read", "clipboard-write"])
    context.set_default_timeout(60_000)
    try:
        page = context.new_page()
        show(page, page_url(served, "a red circle", k="3"))
        api = httpx.post(f"{served}/search/images", json={"sentence": "a red circle", "k": 3}).json()["results"]
        paths = page.evaluate("[...document.querySelectorAll('#results .card .file .path')].map(p => p.textContent)")
        assert paths == [r["path"] for r in api] and all(p.endswith(".jpg") for p in paths), (paths, api)
        page.locator("#results .card .file .copy").first.click()
        page.wait_for_function("document.querySelector('#results .card .file .copy').textContent === 'copied'")
        assert page.evaluate("navigator.clipboard.readText()") == paths[0]
        href = page.get_attribute("#results .card .file a.open", "href")
        assert href == api[0]["url"]
        original = httpx.get(f"{served}{href}")
        assert original.status_code == 200 and original.headers["content-type"].startswith("image/")

        show(page, page_url(served, "red circle", mode="regions", k="3"))
        srcs = page.evaluate("[...document.querySelectorAll('#results .card img')].map(i => i.getAttribute('src'))")
        assert len(srcs) == 3 and all("/thumbnail" in s for s in srcs), srcs
        assert page.locator("#results .card .file .path").count() == 3
    finally:
        context.close()


def test_sort_by_date_taken_from_the_page(served_calibrated: str, page: Page) -> None:
    """The sort control sends `"sort": "taken"` (with the page's cut-off), keeps it in the address, and the
    page shows what the API answers for that request."""
    import httpx

    show(page, page_url(served_calibrated, "a red circle", k="4", min_relevance="0"))
    page.select_option("#sort", "taken")
    page.click("#search-form button[type=submit]")
    page.wait_for_function("new URLSearchParams(location.search).get('sort') === 'taken'")
    page.wait_for_function("document.body.dataset.state === 'done'")
    shown = page.evaluate("[...document.querySelectorAll('#results .card')].map(c => Number(c.dataset.id))")
    api = httpx.post(f"{served_calibrated}/search/images",
                     json={"sentence": "a red circle", "k": 4, "sort": "taken", "min_relevance": 0}).json()
    assert shown == [r["id"] for r in api["results"]] and len(shown) == 4
    show(page, page.url)  # the address keeps the sort
    assert page.input_value("#sort") == "taken"
