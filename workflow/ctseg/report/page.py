"""The page around the sections: inline CSS, navigation, the list of files read, and the
inert image-check script that tests/browser_check.py reads back."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ctseg.report.markup import Sources, esc

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1500px;
       padding: 0 1em; color: #222; }
@media (max-width: 1000px) { body { padding: 0 0.4em; } }  /* the tables' room at 900 px */
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; margin-top: 2em; }
.headline { background: #eef4fb; border: 1px solid #9bb8d8; border-radius: 4px;
            padding: 0.3em 1em; margin: 0.6em 0 1em; }
.headline ul { margin: 0.3em 0; padding-left: 1.2em; } .headline li { margin: 0.3em 0; }
.headline .smoke { background: #fbe3c4; padding: 0 4px; font-weight: bold; }
li.hl-better b:first-child { color: #1c6b2d; } li.hl-worse b:first-child { color: #a33; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 11px; max-width: 100%; }
/* Cells wrap at spaces (a number's ± band or remark goes below it) and after the / of a file
   path, never inside a word, a name or a number: every table fits the window from 900 px on
   and still reads. */
th, td { border: 1px solid #ccc; padding: 2px 3px; text-align: right; }
th { background: #f0f0f0; vertical-align: bottom; min-width: 2em; }
.t { text-align: left; } td.t { overflow-wrap: normal; min-width: 3em; }
div.scroll { overflow-x: auto; }
tr.baseline td { color: #555; font-style: italic; }
img { max-width: 100%; display: block; margin: 0.6em 0; }
code { background: #f4f4f4; padding: 0 3px; overflow-wrap: anywhere; }
.source { color: #555; font-size: 12.5px; }
.missing { color: #a33; font-style: italic; } .note { color: #555; font-size: 12.5px; }
ul.verdicts li { margin-bottom: 0.35em; } nav a { margin-right: 1em; }
"""

# Inert for readers: records how many images rendered, how many tables reach past the page's
# width, how many words in table cells are broken across lines and where the headline is, for
# the headless-browser check. Drawing
# each image onto a canvas decodes it synchronously at load, so the count is final before
# chromium's --dump-dom (img.decode() promises may still be pending then). An image counts as
# rendered when it has a size and its pixels are not all one value.
IMAGE_CHECK_SCRIPT = """
window.addEventListener("load", function () {
  function rendered(img) {
    if (!img.complete || img.naturalWidth === 0) return false;
    try {
      var canvas = document.createElement("canvas");
      canvas.width = img.naturalWidth;
      canvas.height = img.naturalHeight;
      var context = canvas.getContext("2d");
      context.drawImage(img, 0, 0);
      var px = context.getImageData(0, 0, canvas.width, canvas.height).data;
      for (var i = 4; i < px.length; i++) if (px[i] !== px[i % 4]) return true;
    } catch (error) {
      document.body.dataset.imagesError = String(error);
    }
    return false;
  }
  // Tables wider than the page (the window less the body's margins), for the width check.
  var page = document.documentElement.clientWidth;
  var tables = Array.prototype.slice.call(document.querySelectorAll("table"));
  var wide = tables.filter(function (t) { return t.getBoundingClientRect().right > page + 0.5; });
  document.body.dataset.tablesTotal = String(tables.length);
  document.body.dataset.tablesWide = String(wide.length);
  document.body.dataset.tablesWidest = String(Math.max.apply(null, [0].concat(
    tables.map(function (t) { return Math.ceil(t.getBoundingClientRect().right); }))));
  document.body.dataset.pageWidth = String(page);
  if (wide.length) {
    var head = wide[0].querySelector("th");
    document.body.dataset.tablesFirstWide = head ? head.textContent.slice(0, 60) : "";
  }
  // Words broken across lines inside a table cell: a word is letters, digits and points (a
  // number stays whole); a line may break at a space, a hyphen or after a slash only.
  var broken = [];
  Array.prototype.forEach.call(document.querySelectorAll("td, th"), function (cell) {
    var walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (var node = walker.nextNode(); node; node = walker.nextNode()) {
      var word = /[A-Za-z0-9.\u00b1\u00d7%]+/g, match;
      while ((match = word.exec(node.data))) {
        var range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        var tops = {};
        Array.prototype.forEach.call(range.getClientRects(), function (r) {
          if (r.width > 0) tops[Math.round(r.top)] = true;
        });
        if (Object.keys(tops).length > 1) broken.push(match[0]);
      }
    }
  });
  document.body.dataset.wordsBroken = String(broken.length);
  document.body.dataset.wordsBrokenFirst = broken.slice(0, 5).join(" ");
  // Where the headline is, for the screenshot check (page coordinates, CSS px).
  var headline = document.getElementById("headline");
  if (headline) {
    var box = headline.getBoundingClientRect();
    document.body.dataset.headlineTop = String(Math.round(box.top + window.scrollY));
    document.body.dataset.headlineBottom = String(Math.round(box.bottom + window.scrollY));
    document.body.dataset.headlineLeft = String(Math.round(box.left));
    document.body.dataset.headlineRight = String(Math.round(box.right));
  }
  var imgs = Array.prototype.slice.call(document.images);
  document.body.dataset.imagesTotal = String(imgs.length);
  document.body.dataset.imagesOk = String(imgs.filter(rendered).length);
  document.body.dataset.imagesChecked = "done";
});
"""


def sources_section(src: Sources) -> str:
    items = "".join(f"<li><code>{esc(name)}</code></li>" for name in src.read)
    return (
        '<h2 id="sources">Files read</h2>'
        f"<p>Every number above comes from one of these files (paths relative to "
        f"<code>{esc(src.root)}</code>).</p><ul>{items}</ul>"
    )


NAV = (
    ("phases", "Phases"),
    ("training", "Training"),
    ("settings", "Settings"),
    ("evaluation", "Evaluation"),
    ("provenance", "Provenance"),
    ("overlays", "Overlays"),
    ("timings", "Timings"),
    ("sources", "Files"),
)


def anchor(name: str) -> str:
    """An HTML id from a run name (fold names carry a dot, which ids allow)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def nest(section: str, run: str) -> str:
    """A section as part of one run's block: headings one level down, ids prefixed by the run,
    so several runs' sections share a page without clashing anchors."""
    section = re.sub(r"<(/?)h3\b", r"<\1h4", section)
    section = re.sub(r'<h2 id="([^"]+)"', lambda m: f'<h3 id="{anchor(run)}-{m.group(1)}"', section)
    return re.sub(r"<(/?)h2\b", r"<\1h3", section)


def page(
    title: str,
    experiment: str,
    sections: Sequence[str],
    *,
    runs: Sequence[str] = (),
    headline: str = "",
) -> str:
    """The page; with `runs`, the header and navigation name the runs (several-run report).
    `headline` comes first, under the title."""
    if runs:
        links = [("comparison", "Comparison"), ("settings", "Settings"), ("overlays", "Overlays")]
        links += [(f"run-{anchor(r)}", r) for r in runs]
        links += [("timings", "Shared timings"), ("sources", "Files")]
        names = ", ".join(f"<b>{esc(r)}</b>" for r in runs)
        heading = f"<p>Runs {names}</p>"
    else:
        links = list(NAV)
        heading = f"<p>Experiment <b>{esc(experiment)}</b></p>"
    nav = " ".join(f'<a href="#{key}">{esc(label)}</a>' for key, label in links)
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>"
        f"<h1>{esc(title)}</h1>{headline}{heading}<nav>{nav}</nav>\n"
        f"{body}\n<script>{IMAGE_CHECK_SCRIPT}</script></body></html>\n"
    )
