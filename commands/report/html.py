"""One self-contained HTML page: images inlined as base64 PNG, styles inline, no external references.

A tiny inline script sets the page title to "N/M images" once loaded, so a headless browser can tell
whether every image decoded (`--dump-dom` shows the title).
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path
from typing import Any

from .common import Figure

STYLE = " ".join(
    [
        "body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#212529;padding:0 16px}",
        "h1{font-size:1.5em;margin-bottom:0.2em}",
        "h2{font-size:1.2em;border-bottom:1px solid #dee2e6;padding-bottom:4px;margin-top:2em}",
        "img{max-width:100%;height:auto;border:1px solid #e9ecef} .caption{color:#495057;font-size:0.9em}",
        ".note{color:#c92a2a;font-size:0.9em} .missing{color:#868e96;font-style:italic}",
        "table{border-collapse:collapse;font-size:0.9em}",
        "td,th{border:1px solid #dee2e6;padding:3px 8px;text-align:left}",
        "nav a{margin-right:1em}",
    ]
)

COUNT_IMAGES = (
    "window.addEventListener('load',function(){var all=Array.prototype.slice.call(document.images);"
    "var ok=all.filter(function(i){return i.complete&&i.naturalWidth>0;}).length;"
    "document.title=ok+'/'+all.length+' images';document.body.setAttribute('data-images-loaded',ok+'/'+all.length);});"
)


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(path.stem)}">'


def _summary(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def render_page(title: str, summary: list[tuple[str, Any]], figures: list[Figure], notes: list[str]) -> str:
    nav = "".join(f'<a href="#{escape(f.key)}">{escape(f.title)}</a>' for f in figures)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        _summary(summary),
        f"<nav>{nav}</nav>",
    ]
    parts += [f'<p class="note">{escape(n)}</p>' for n in notes]
    for fig in figures:
        parts.append(f'<section id="{escape(fig.key)}"><h2>{escape(fig.title)}</h2>')
        if fig.path is not None:
            parts.append(_image(fig.path))
            if fig.caption:
                parts.append(f'<p class="caption">{escape(fig.caption)}</p>')
        else:
            parts.append('<p class="missing">Not drawn.</p>')
        parts += [f'<p class="{"note" if fig.path else "missing"}">{escape(n)}</p>' for n in fig.notes]
        parts.append("</section>")
    parts.append(f"<script>{COUNT_IMAGES}</script></body></html>")
    return "\n".join(parts)
