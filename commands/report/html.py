"""One self-contained HTML page: SVG pictures inlined (data: URIs, or markup for the plan graph), styles and
scripts inline, no external references.

Click a picture to see it at full size (again, or Escape, to close). Notes are neutral; warnings (what makes
the numbers less trustworthy, what failed) stand out. A small inline script sets the page title to
"N/M figures" once loaded, so a headless browser can tell whether every picture decoded.
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path
from typing import Any

from .common import Figure

STYLE = "\n".join(
    [
        "body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#212529;padding:0 16px}",
        "h1{font-size:1.5em;margin-bottom:0.2em}",
        "h2{font-size:1.2em;border-bottom:1px solid #dee2e6;padding-bottom:4px;margin-top:2em}",
        "h3{font-size:1.05em;margin:1.2em 0 0.3em}",
        "figure{margin:0.5em 0;cursor:zoom-in;overflow-x:auto}",
        "figure img{max-width:100%;height:auto;border:1px solid #e9ecef;display:block}",
        "figure svg.plan-graph{max-width:none;display:block;margin:0 auto}",
        "figure.full{position:fixed;inset:0;margin:0;background:rgba(255,255,255,0.98);z-index:10;overflow:auto;"
        "cursor:zoom-out;padding:16px}",
        "figure.full img{max-width:none;width:auto}",
        ".caption{color:#495057;font-size:0.9em}",
        ".note{color:#495057;font-size:0.9em;background:#f8f9fa;border-left:3px solid #ced4da;padding:4px 8px}",
        ".warning{color:#862e9c;font-size:0.9em;background:#fff0f6;border-left:3px solid #c2255c;padding:4px 8px}",
        ".warning::before{content:'warning: ';font-weight:bold}",
        ".missing{color:#868e96;font-style:italic}",
        ".replayed{background:#e7f5ff;border:1px solid #74c0fc;padding:8px 12px;border-radius:6px}",
        "table{border-collapse:collapse;font-size:0.9em}",
        "td,th{border:1px solid #dee2e6;padding:3px 8px;text-align:left;vertical-align:top}",
        "nav a{margin-right:1em}",
        ".request{border:1px solid #dee2e6;border-radius:6px;padding:8px 12px;margin:8px 0}",
        ".prompt{white-space:pre-wrap;background:#f8f9fa;padding:6px 8px;max-height:12em;overflow:auto;"
        "font-size:0.9em}",
        ".answer{white-space:pre-wrap;line-height:1.7;font-size:0.95em}",
        ".tok{border-radius:3px;padding:1px 0}",
        ".tok:hover{outline:1px solid #212529}",
        ".legend span{display:inline-block;padding:1px 6px;margin-right:4px;border-radius:3px;font-size:0.85em}",
        ".pager button{margin:0 4px 8px 0}",
    ]
)

SCRIPT = """
document.querySelectorAll('figure').forEach(function (f) {
  f.addEventListener('click', function () { f.classList.toggle('full'); });
});
document.addEventListener('keydown', function (e) {
  if (e.key !== 'Escape') return;
  document.querySelectorAll('figure.full').forEach(function (f) { f.classList.remove('full'); });
});
document.querySelectorAll('.pages').forEach(function (box) {
  var pages = box.querySelectorAll('.page'), bar = box.querySelector('.pager');
  if (pages.length < 2) return;
  function show(i) {
    pages.forEach(function (p, j) { p.style.display = i === j ? '' : 'none'; });
    bar.querySelectorAll('button').forEach(function (b, j) { b.disabled = i === j; });
  }
  pages.forEach(function (p, i) {
    var b = document.createElement('button'); b.type = 'button'; b.textContent = p.getAttribute('data-label');
    b.addEventListener('click', function () { show(i); }); bar.appendChild(b);
  });
  show(0);
});
window.addEventListener('load', function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  var svgs = document.querySelectorAll('figure > svg');
  svgs.forEach(function (s) { if (s.getBBox().width > 0) ok += 1; });
  var all = images.length + svgs.length;
  document.title = ok + '/' + all + ' figures';
  document.body.setAttribute('data-figures-loaded', ok + '/' + all);
});
"""


def image(path: Path) -> str:
    """A picture file as a zoomable <figure>: SVG (or PNG) inlined as a data: URI."""
    kind = "svg+xml" if path.suffix == ".svg" else "png"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<figure><img src="data:image/{kind};base64,{data}" alt="{escape(path.stem)}"></figure>'


def remarks(notes: list[str], warnings: list[str]) -> list[str]:
    return [f'<p class="warning">{escape(w)}</p>' for w in warnings] + [
        f'<p class="note">{escape(n)}</p>' for n in notes
    ]


def _summary(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def render_page(
    title: str,
    summary: list[tuple[str, Any]],
    figures: list[Figure],
    notes: list[str],
    warnings: list[str] | None = None,
    banner: str = "",
) -> str:
    nav = "".join(f'<a href="#{escape(f.key)}">{escape(f.title)}</a>' for f in figures)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        banner,
        _summary(summary),
        *remarks(notes, warnings or []),
        f"<nav>{nav}</nav>",
    ]
    for fig in figures:
        parts.append(f'<section id="{escape(fig.key)}"><h2>{escape(fig.title)}</h2>')
        if fig.path is not None:
            parts.append(image(fig.path))
        if fig.html:
            parts.append(fig.html)
        if fig.drawn and fig.caption:
            parts.append(f'<p class="caption">{escape(fig.caption)}</p>')
        if not fig.drawn:
            parts.append('<p class="missing">Not drawn.</p>')
        parts += remarks(fig.notes, fig.warnings)
        parts.append("</section>")
    parts.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(parts)
