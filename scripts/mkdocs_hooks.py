"""mkdocs hooks of aiote's documentation site (mkdocs.yml ``hooks:``).

The docstrings name other objects with Sphinx roles (``:class:`~aiote.InvalidArgument```),
which Markdown renders as a role name before a code span. This turns each into a
cross-reference that mkdocs-autorefs resolves to the object's entry in the API reference
(``aiote.X`` for a bare public name), or into plain code where there is no entry: an optional
reference, so an unresolved one is never a warning.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|attr|exc|data|obj|mod|const):<code>(~?)([A-Za-z_][\w.]*)</code>")


def _reference(match: re.Match[str]) -> str:
    short, name = match[1] == "~", match[2]
    identifier = name if "." in name else f"aiote.{name}"
    shown = name.rsplit(".", 1)[-1] if short else name
    return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_reference, html)
