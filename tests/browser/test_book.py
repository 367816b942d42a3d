"""The built book in a real browser: every page loads cleanly, maths typesets, images load, and the
"next" links walk the course in order."""

from __future__ import annotations

import re

import pytest

from .conftest import HTML, ROOT, unavailable

pytestmark = pytest.mark.browser

SKIP_DIRS = {"_static", "_sources", "_images", "_downloads", "_modules"}
PAGES = sorted(
    str(p.relative_to(HTML)) for p in HTML.rglob("*.html") if not SKIP_DIRS & set(p.relative_to(HTML).parts)
) or [None]  # None: the book is not built, which the test reports (a skip, or a failure under CI)
# Inline maths that MyST did not turn into maths shows up as text such as "$\pi_\theta$".
RAW_INLINE_MATH = re.compile(r"\$[^$\s][^$\n]*\\[A-Za-z]+[^$\n]*\$")


def open_page(browser, url: str, base: str):
    """A new page at `url`, with every console error, failed or 4xx/5xx request and off-site request recorded."""
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"uncaught exception: {exc}"))
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} ({req.failure})"))
    page.on("response", lambda res: problems.append(f"HTTP {res.status}: {res.url}") if res.status >= 400 else None)

    def offline_only(route):
        if route.request.url.startswith(base) or route.request.url.startswith("data:"):
            route.continue_()
        else:  # the book must work offline: anything fetched from elsewhere is a bug
            problems.append(f"off-site request: {route.request.url}")
            route.abort()

    page.route("**/*", offline_only)
    page.goto(url, wait_until="load")
    return page, problems


def wait_for_mathjax(page) -> None:
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
    page.evaluate("() => MathJax.startup.promise")


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_with_maths_and_images(browser, book_url, path, screenshots):
    if path is None:
        unavailable(f"no built book at {HTML}: run `make book` first")
    page, problems = open_page(browser, f"{book_url}/{path}", book_url)
    try:
        n_math = page.locator(".math").count()
        if n_math:
            wait_for_mathjax(page)
            untypeset = page.evaluate(
                "() => [...document.querySelectorAll('.math')].filter(e => !e.querySelector('mjx-container'))"
                ".map(e => e.textContent.slice(0, 80))"
            )
            assert untypeset == [], f"{path}: {len(untypeset)} of {n_math} equations were not typeset: {untypeset[:3]}"
            tex_errors = page.evaluate(
                "() => [...document.querySelectorAll('mjx-merror')].map(e => e.getAttribute('data-mjx-error'))"
            )
            assert tex_errors == [], f"{path}: MathJax could not parse: {tex_errors[:3]}"
        # The reader's text, code blocks left out: no maths left as raw TeX.
        prose = page.evaluate(
            "() => { const main = document.querySelector('main') || document.body;"
            " const copy = main.cloneNode(true); copy.querySelectorAll('pre, code, script, style')"
            ".forEach(e => e.remove()); return copy.innerText; }"
        )
        assert "$$" not in prose, f"{path}: raw $$ display maths left in the page"
        raw = RAW_INLINE_MATH.findall(prose)
        assert raw == [], f"{path}: inline maths left as text: {raw[:3]}"
        page.wait_for_load_state("networkidle")
        broken = page.evaluate(
            "() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src.slice(0, 120))"
        )
        assert broken == [], f"{path}: images that did not load: {broken}"
        assert problems == [], f"{path}: " + "; ".join(problems[:5])
        if path == "chapters/05_ppo.html":  # the README's screenshot of a page with typeset maths
            page.set_viewport_size({"width": 1280, "height": 900})
            page.locator("#importance-sampling-derived").evaluate("e => e.scrollIntoView({block: 'start'})")
            page.screenshot(path=str(screenshots / "book_page_maths.png"))
    finally:
        page.close()


def expected_reading_order() -> list[str]:
    order = []
    for md in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md")):
        order.append(f"chapters/{md.stem}.html")
        if (ROOT / "notebooks" / f"{md.stem}.ipynb").exists():
            order.append(f"notebooks/{md.stem}.html")
    return order


def test_next_links_walk_the_course_in_order(browser, book_url):
    if not (HTML / "index.html").exists():
        unavailable(f"no built book at {HTML}: run `make book` first")
    expected = expected_reading_order()
    page, _ = open_page(browser, f"{book_url}/index.html", book_url)
    visited = []
    try:
        page.locator("a.right-next").first.click()
        for _ in range(len(expected)):
            page.wait_for_load_state("load")
            visited.append(page.url.removeprefix(book_url + "/").split("#")[0])
            nxt = page.locator("a.right-next")
            if visited[-1] == expected[-1] or nxt.count() == 0:
                break
            nxt.first.click()
    finally:
        page.close()
    assert visited == expected, f"the 'next' links go {visited}, but the course reads {expected}"
