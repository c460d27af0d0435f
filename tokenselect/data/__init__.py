"""Data shipped with tokenselect: a public-domain prose corpus and the default trained model."""
import functools
import gzip
from pathlib import Path

_HERE = Path(__file__).resolve().parent

__all__ = ["prose_text", "default_model_path"]


@functools.lru_cache(maxsize=1)
def prose_text() -> str:
    """The vendored public-domain English corpus (Shakespeare and Milton, see prose/SOURCE.md).

    Texts are separated by form feeds (``\\f``)."""
    with gzip.open(_HERE / "prose" / "prose.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def default_model_path() -> Path:
    """Folder of the default model: a small Llama checkpoint trained for tokenselect."""
    return _HERE / "default_model"
