"""Text out of HTML help pages, paragraph by paragraph (standard library only).

Two readers share one parser:
* `extract_paragraphs` keeps the paragraph ids LibreOffice Help puts on every <p>/<h*> (`par_id…`,
  `hd_id…`): the same id in every language marks the same paragraph, which gives exact translation
  pairs for evaluation.
* `extract_text` is the generic reader `marge prepare` uses for an HTML folder: block elements become
  paragraphs separated by blank lines.

Platform- and module-specific alternatives (`<span hidden class="MAC">Command</span>` next to the
default `Ctrl`) are dropped so the default text is not glued to its alternatives.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "td", "th", "dt", "dd", "div", "blockquote",
              "pre", "title", "caption", "tr", "br", "section", "article"}
SKIP_TAGS = {"script", "style", "noscript", "head", "nav", "header", "footer", "aside", "template"}
VOID_TAGS = {"br", "img", "meta", "link", "input", "hr", "area", "base", "col", "embed", "source", "wbr"}
PARAGRAPH_ID = re.compile(r"^(par_id|hd_id)")
_SPACE = re.compile(r"\s+")


def clean_space(text: str) -> str:
    return _SPACE.sub(" ", html.unescape(text)).strip()


@dataclass
class _Element:
    tag: str
    skip: bool
    para_id: str | None


@dataclass
class HtmlDocument:
    title: str = ""
    paragraphs: list[tuple[str | None, str]] = field(default_factory=list)  # (paragraph id or None, text)

    def text(self) -> str:
        return "\n\n".join(t for _, t in self.paragraphs)


class _ParagraphParser(HTMLParser):
    def __init__(self, root_id: str | None):
        super().__init__(convert_charrefs=True)
        self.root_id = root_id
        self.in_root = root_id is None
        self.root_depth = -1
        self.stack: list[_Element] = []
        self.doc = HtmlDocument()
        self.buffer: list[str] = []
        self.current_id: str | None = None
        self.in_title = False
        self.title_parts: list[str] = []

    def _skipping(self) -> bool:
        return any(e.skip for e in self.stack)

    def _flush(self) -> None:
        text = clean_space("".join(self.buffer))
        if text:
            self.doc.paragraphs.append((self.current_id, text))
        self.buffer = []
        self.current_id = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "title":
            self.in_title = True
        if tag in VOID_TAGS:
            if tag == "br" and self.in_root and not self._skipping():
                self.buffer.append(" ")
            return
        if not self.in_root and a.get("id") == self.root_id:
            self.in_root, self.root_depth = True, len(self.stack)
        classes = (a.get("class") or "").split()
        # hidden alternatives carry a module/platform class (MAC, WRITER, CALC, ...); the default has none
        alternative = "hidden" in a and any(c.isupper() for c in classes)
        skip = tag in SKIP_TAGS or alternative or "bascode" in classes or tag == "pre"
        para_id = a.get("id") if PARAGRAPH_ID.match(a.get("id") or "") else None
        if tag in BLOCK_TAGS and self.in_root and not self._skipping() and not skip:
            self._flush()
            self.current_id = para_id
        elif para_id and self.in_root:
            self.current_id = self.current_id or para_id
        self.stack.append(_Element(tag, skip, para_id))

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
            self.doc.title = clean_space("".join(self.title_parts))
        if tag in VOID_TAGS:
            return
        # pop to the matching tag (tolerates unclosed children)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].tag == tag:
                closing_block = tag in BLOCK_TAGS and not self._skipping()
                del self.stack[i:]
                if self.in_root and closing_block:
                    self._flush()
                if self.in_root and self.root_id is not None and len(self.stack) <= self.root_depth:
                    self.in_root = False
                break

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title_parts.append(data)
        if self.in_root and not self._skipping() and not self.in_title:
            self.buffer.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def parse_html(markup: str, root_id: str | None = None) -> HtmlDocument:
    """Paragraphs of `markup`, only inside the element with id `root_id` when given."""
    parser = _ParagraphParser(root_id)
    parser.feed(markup)
    parser.close()
    return parser.doc


def extract_paragraphs(markup: str) -> HtmlDocument:
    """LibreOffice Help: the page's content area, keyed by paragraph id."""
    doc = parse_html(markup, root_id="DisplayArea")
    doc.paragraphs = [(pid, text) for pid, text in doc.paragraphs if pid is not None]
    return doc


def extract_text(markup: str) -> HtmlDocument:
    """Any HTML page: visible block text, paragraphs separated by blank lines."""
    return parse_html(markup)
