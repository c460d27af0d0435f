"""``python -m tokenselect.policies > docs/settings.md``: the settings tables, from the settings dataclasses."""

from . import settings_markdown

print(settings_markdown(), end="")
