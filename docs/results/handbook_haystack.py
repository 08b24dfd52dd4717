"""A haystack no kvcli setting was chosen on: *The Debian Administrator's Handbook* (Raphaël Hertzog and Roland Mas,
GPL-2+ / CC-BY-SA 3.0) as plain text, from Debian's ``debian-handbook`` package (its English HTML).

The pages are read in the book's order, from ``index.html`` along each page's ``rel="next"`` link; the text of every
element is kept but for the navigation, the tables of contents and the code and screen listings (command lines and
program output, not prose); a block element's end becomes a line break. The HTML is parsed as data, nothing in it is
run. Usage, on a machine with Debian's archive, no root needed::

    apt-get download debian-handbook && dpkg-deb -x debian-handbook_*.deb pkg
    python docs/results/handbook_haystack.py pkg/usr/share/doc/debian-handbook/html/en-US > handbook.txt
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

SKIPPED_TAGS = {"pre", "script", "style", "head"}
SKIPPED_CLASSES = ("navheader", "navfooter", "toc", "docnav", "programlisting", "screen")
VOID = {"br", "img", "hr", "meta", "link", "input", "col", "area", "base", "wbr"}
BLOCKS = {"p", "div", "li", "h1", "h2", "h3", "h4", "h5", "tr", "dt", "dd"}
NEXT = re.compile(r'<link rel="next" href="([^"#]+)')


class PageText(HTMLParser):
    """The text of one page, the skipped elements (and everything inside them) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.depth = 0  # > 0 while inside a skipped element

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID:
            return
        classes = dict(attrs).get("class") or ""
        if self.depth or tag in SKIPPED_TAGS or any(name in classes for name in SKIPPED_CLASSES):
            self.depth += 1
        elif tag in BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in VOID:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if not self.depth:
            self.parts.append(data)

    def text(self) -> str:
        body = re.sub(r"[ \t\r\f\v]+", " ", "".join(self.parts))
        return re.sub(r"\n\s*\n+", "\n\n", body).strip()


def book(folder: Path) -> str:
    """Every page from ``index.html`` on, in reading order."""
    pages, page, seen = [], "index.html", set()
    while page and page not in seen:
        seen.add(page)
        source = (folder / page).read_text(encoding="utf-8")
        parser = PageText()
        parser.feed(source)
        pages.append(parser.text())
        found = NEXT.search(source)
        page = found.group(1) if found else None
    return "\n\n".join(pages) + "\n"


if __name__ == "__main__":
    sys.stdout.write(book(Path(sys.argv[1])))
