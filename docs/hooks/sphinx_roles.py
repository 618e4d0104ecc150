"""A griffe extension for the API pages: Sphinx roles in the docstrings render as code.

The docstrings cross-reference in Sphinx's manner (``:class:`KVCache```, ``:func:`~ardiff_modules.warm_up```);
mkdocstrings renders markdown, where a role would print as ``:class: KVCache``. This rewrites each role to its
target in backticks (``~`` keeps the last dotted part, as Sphinx shows it). Used by mkdocs.yml only.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    target = match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles to inline code in every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
