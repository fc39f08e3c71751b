"""The runbook every gemmd serves: docs/runbook.md at /runbook (HTML, one anchor per
section, as GitHub names them) and /runbook.md (the Markdown as it is).

The alert rules link it by default (``http://<instance>/runbook#<alert>``,
deploy/prometheus/gemmd.rules.yml), so that a runbook_url works wherever gemmd runs, with
nothing to publish. The text travels inside the package (``runbook_guide.TEXT`` and
``runbook_alerts.TEXT``, generated from docs/runbook.md, which stays the one to edit): a
wheel or an image built from ``gemmd/`` alone has it too.

    python3 -m gemmd.exporter.runbook           # rewrite runbook_guide.py, runbook_alerts.py
    python3 -m gemmd.exporter.runbook --check   # exit 1 if it is out of date (the tests run it)
"""

from __future__ import annotations

import functools
import html
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent / "docs" / "runbook.md"  # in a checkout
# The text travels in two generated modules, each under the package's line cap: the guide
# (labels, where to look, scrape config, Alertmanager, dashboards) and, from the first
# alert's section (a "## Gemmd..." heading) on, the alerts.
MODULES = {"guide": HERE / "runbook_guide.py", "alerts": HERE / "runbook_alerts.py"}
_WHAT = {"guide": "the runbook up to the first alert's section",
         "alerts": "the runbook's alert sections"}
_FIRST_ALERT = re.compile(r"^## Gemmd", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading (what the alert rules link)."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")


def _inline(text: str) -> str:
    """Code spans, bold and links of one line of Markdown, as HTML (the rest escaped).
    Links to other files of the repository become text: only the runbook is served."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        code, bold, label, url = m.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{_inline(bold)}</strong>")
        elif url.startswith(("http://", "https://", "#")):
            out.append(f'<a href="{html.escape(url, quote=True)}">{_inline(label)}</a>')
        else:
            out.append(_inline(label))
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def to_html(markdown: str, title: str = "gemmd runbook") -> str:
    """The Markdown of docs/runbook.md as one HTML page: headings (with GitHub's anchors),
    paragraphs, lists, tables, code blocks, code spans, bold and links."""
    body: list[str] = []
    para: list[str] = []
    items: list[str] = []
    lines = markdown.splitlines()

    def flush() -> None:
        if para:
            body.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if items:
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            flush()
            code = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            body.append(f"<pre><code>{html.escape(chr(10).join(code))}</code></pre>")
        elif m := re.match(r"(#{1,6}) (.*)", line):
            flush()
            level, text = len(m.group(1)), m.group(2)
            body.append(f'<h{level} id="{anchor(text)}">{_inline(text)}</h{level}>')
        elif line.startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            i -= 1
            head, rest = rows[0], [r for r in rows[1:] if not all(
                set(c) <= set("-: ") for c in r)]
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head)
                        + "</tr>" + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>"
                                                              for c in r) + "</tr>"
                                            for r in rest) + "</table>")
        elif m := re.match(r"\s*(?:[-*]|\d+\.) (.*)", line):
            if para:
                flush()
            items.append(m.group(1))
        elif not line.strip():
            flush()
        elif items and line.startswith((" ", "\t")):
            items[-1] += " " + line.strip()
        else:
            para.append(line.strip())
        i += 1
    flush()
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em;"
             "line-height:1.45}pre{background:#f4f4f4;padding:.6em;overflow-x:auto}"
             "code{background:#f4f4f4}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .5em;vertical-align:top}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>"
            f"{html.escape(title)}</title><style>{style}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def markdown() -> str:
    from gemmd.exporter.runbook_alerts import TEXT as ALERTS
    from gemmd.exporter.runbook_guide import TEXT as GUIDE

    return GUIDE + ALERTS


@functools.cache
def page() -> bytes:
    """/runbook: rendered once, on first request."""
    return to_html(markdown()).encode("utf-8")


@functools.cache
def source() -> bytes:
    """/runbook.md."""
    return markdown().encode("utf-8")


# ------------------------------------------------------------------ the generated module

def split(text: str) -> dict[str, str]:
    """docs/runbook.md in the parts of ``MODULES``: the guide, then the alerts' sections."""
    m = _FIRST_ALERT.search(text)
    cut = m.start() if m else len(text)
    return {"guide": text[:cut], "alerts": text[cut:]}


def module_text(text: str, what: str = "the runbook") -> str:
    if '"""' in text or text.endswith("\\"):
        body = repr(text)
    else:
        body = 'r"""' + text + '"""'
    return ('"""GENERATED by `python3 -m gemmd.exporter.runbook` from docs/runbook.md: edit '
            f'that file,\nthen run the command. gemmd serves this text ({what}) at '
            '/runbook."""\n'
            "# ruff: noqa: E501\n\n"
            f"TEXT = {body}\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=SOURCE, help=f"default: {SOURCE}")
    p.add_argument("--out", type=Path, default=HERE,
                   help=f"the folder of {', '.join(m.name for m in MODULES.values())} "
                        f"(default: {HERE})")
    p.add_argument("--check", action="store_true",
                   help="don't write; exit 1 if --out is out of date with --source")
    args = p.parse_args(argv)
    try:
        parts = split(args.source.read_text(encoding="utf-8"))
    except OSError as e:
        print(f"runbook: {args.source}: {e.strerror or e}", file=sys.stderr)
        return 2
    wants = {args.out / MODULES[k].name: module_text(v, _WHAT[k]) for k, v in parts.items()}
    if args.check:
        for out, want in wants.items():
            try:
                have = out.read_text(encoding="utf-8")
            except OSError:
                have = ""
            if have != want:
                print(f"runbook: {out} is out of date with {args.source}; run python3 -m "
                      "gemmd.exporter.runbook", file=sys.stderr)
                return 1
        return 0
    for out, want in wants.items():
        out.write_text(want, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
