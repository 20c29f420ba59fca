"""Build fnmoe/assets/corpus.jsonl.gz from Debian's python3.11-doc package.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb DOC_ROOT
    python tools/build_corpus.py DOC_ROOT fnmoe/assets/corpus.jsonl.gz

One document per selected HTML page: the text of Sphinx's main <div class="body">, so the
navigation bars, sidebars (search box, table of contents) and footer never enter. Inside it,
permalink pilcrows, toctrees and local contents boxes are dropped; prose is whitespace-collapsed
into paragraphs separated by blank lines, <pre> code blocks are kept verbatim. Output is
byte-for-byte reproducible: pages sorted by path, gzip with mtime 0 and no file name.
Only the stdlib is used.
"""
from __future__ import annotations

import gzip
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

HTML_DIR = "usr/share/doc/python3.11/html"
# Largest text size kept per section: the tutorial, FAQ, HOWTOs and language reference are
# prose, but very long pages are cookbooks and grammar dumps; in library/ only the short module
# pages are mostly prose, the long ones are API listings.
MAX_BYTES = {"tutorial/": 40_000, "faq/": 40_000, "howto/": 40_000, "reference/": 40_000,
             "library/": 7_000}
MIN_BYTES = 2000               # stubs and link lists are not useful text
MAX_CODE_SHARE = 0.4           # the corpus should be mostly prose, not code examples

BLOCK_TAGS = {"p", "div", "section", "pre", "li", "dt", "dd", "dl", "ul", "ol", "blockquote",
              "table", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "figure", "caption", "hr", "br"}
SKIP_CLASSES = {"headerlink", "toctree-wrapper", "contents", "linenos"}


class _BodyText(HTMLParser):
    """Collects paragraphs of the Sphinx main body; `blocks` is the result."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.title = ""
        self._inline: list[str] = []
        self._body_depth = 0          # nesting of <div> since <div class="body">; 0 = outside
        self._skip: tuple[str, int] | None = None   # (tag, nesting) of a dropped element
        self._in_h1 = False
        self.code_chars = 0
        self._bullet = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        classes = set((dict(attrs).get("class") or "").split())
        if self._body_depth == 0:
            if tag == "div" and "body" in classes:
                self._body_depth = 1
            return
        if tag == "div":
            self._body_depth += 1
        if self._skip:
            if tag == self._skip[0]:
                self._skip = (tag, self._skip[1] + 1)
            return
        if tag in ("script", "style") or classes & SKIP_CLASSES:
            self._skip = (tag, 1)
            return
        if tag in BLOCK_TAGS:
            self._flush()
        if tag == "li":
            self._bullet = True    # the item's text usually sits in a nested <p>
        elif tag == "h1" and not self.title:
            self._in_h1 = True
        elif tag in ("td", "th"):
            self._inline.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self._body_depth == 0:
            return
        if tag == "div":
            self._body_depth -= 1
        if self._skip:
            if tag == self._skip[0]:
                n = self._skip[1] - 1
                self._skip = (tag, n) if n else None
            return
        if tag == "pre":
            code = "".join(self._inline)
            self._inline = []
            lines = [line.rstrip() for line in code.strip("\n").split("\n")]
            if any(lines):
                self.blocks.append("\n".join(lines))
                self.code_chars += len(self.blocks[-1])
        elif tag in BLOCK_TAGS:
            if tag == "h1" and self._in_h1:
                self.title = re.sub(r"\s+", " ", "".join(self._inline)).strip()
                self._in_h1 = False
            self._flush()
            self._bullet = self._bullet and tag != "li"

    def handle_data(self, data: str) -> None:
        if self._body_depth and not self._skip:
            self._inline.append(data)

    def _flush(self) -> None:
        text = re.sub(r"\s+", " ", "".join(self._inline).replace("\xa0", " ")).strip()
        self._inline = []
        if text:
            self.blocks.append("- " + text if self._bullet else text)
            self._bullet = False


def page_text(html: str) -> tuple[str, str, float]:
    """(title, text, share of the text that is code blocks) of one Sphinx HTML page."""
    parser = _BodyText()
    parser.feed(html)
    parser.close()
    text = "\n\n".join(parser.blocks)
    return parser.title, text, parser.code_chars / max(len(text), 1)


def selected(html_dir: Path) -> list[Path]:
    """Candidate pages under the sections of MAX_BYTES, sorted by path; section indexes are
    toctrees only."""
    pages = [p for p in html_dir.rglob("*.html")
             if p.relative_to(html_dir).as_posix().startswith(tuple(MAX_BYTES)) and p.name != "index.html"]
    return sorted(pages, key=lambda p: p.as_posix())


def keep(rel: str, text: str, code_share: float) -> bool:
    max_bytes = next(n for prefix, n in MAX_BYTES.items() if rel.startswith(prefix))
    return MIN_BYTES <= len(text.encode("utf-8")) <= max_bytes and code_share <= MAX_CODE_SHARE


def main(doc_root: str, out: str) -> None:
    root = Path(doc_root)
    docs = []
    for path in selected(root / HTML_DIR):
        title, text, code_share = page_text(path.read_text(encoding="utf-8"))
        if keep(path.relative_to(root / HTML_DIR).as_posix(), text, code_share):
            docs.append({"title": title, "source": path.relative_to(root).as_posix(), "text": text})
    lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    with open(out, "wb") as f, gzip.GzipFile("", "wb", 9, f, mtime=0) as gz:
        gz.write(lines)
    n_text = sum(len(d["text"].encode("utf-8")) for d in docs)
    print(f"{len(docs)} documents, {n_text} bytes of text, {Path(out).stat().st_size} bytes compressed")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/build_corpus.py DOC_ROOT OUT")
    main(sys.argv[1], sys.argv[2])
