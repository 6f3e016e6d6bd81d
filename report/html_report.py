"""One self-contained HTML page from a table and captioned figures: PNGs inlined as base64 data
URIs, inline CSS, no scripts and no external resources, so the file can be mailed or archived."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1040px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; }
td.num { text-align: right; font-family: monospace; }
figure { margin: 2em 0; }
figure img { display: block; width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.9em; margin-top: 0.4em; }
p.summary { font-size: 1.25em; background: #eef4ff; border-left: 4px solid #3366cc;
            padding: 0.6em 0.9em; }
"""


def png_bytes(fig: Figure) -> bytes:
    """The figure rendered by Agg as PNG."""
    FigureCanvasAgg(fig)  # attaches itself as the figure's canvas
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


@dataclass(frozen=True)
class Table:
    """Paragraphs of notes, then a table whose first column names the rows."""

    notes: list[str]
    header: list[str]
    rows: list[list[str]]


def render(title: str, summary: str, tables: list[Table],
           figures: list[tuple[Figure, str]]) -> str:
    """The page: title, the summary (first, so it shows without scrolling), the tables with
    their notes and the figures, each with its title as alt text and its caption below."""
    esc = html.escape
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             f"<title>{esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
             f"<h1>{esc(title)}</h1>\n<p class=\"summary\" id=\"summary\">{esc(summary)}</p>\n"]
    # A table of contents: the page is several screens of figures.
    links = [("tables", "Metrics")] * bool(tables) + [
        (f"figure-{k}", fig.get_suptitle()) for k, (fig, _) in enumerate(figures)]
    parts.append("<nav><ul>" + "".join(f'<li><a href="#{anchor}">{esc(text)}</a></li>'
                                       for anchor, text in links) + "</ul></nav>\n")
    parts.append('<section id="tables">\n')
    for table in tables:
        parts += [f"<p>{esc(n)}</p>\n" for n in table.notes]
        head = "".join(f"<th>{esc(h)}</th>" for h in table.header)
        body = "".join("<tr><th>" + esc(row[0]) + "</th>"
                       + "".join(f'<td class="num">{esc(c)}</td>' for c in row[1:]) + "</tr>\n"
                       for row in table.rows)
        parts.append(f"<table>\n<tr>{head}</tr>\n{body}</table>\n")
    parts.append("</section>\n")
    for k, (fig, caption) in enumerate(figures):
        data = base64.b64encode(png_bytes(fig)).decode("ascii")
        width, height = (int(round(x * DPI)) for x in fig.get_size_inches())
        parts.append(f'<figure id="figure-{k}">\n'
                     f'<img src="data:image/png;base64,{data}" width="{width}" '
                     f'height="{height}" alt="{esc(fig.get_suptitle())}">\n'
                     f"<figcaption>{esc(caption)}</figcaption>\n</figure>\n")
    parts.append("</body>\n</html>\n")
    return "".join(parts)
