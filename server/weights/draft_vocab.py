"""Which token ids a trimmed draft head keeps: a frequency ranking of a tokenizer's ids.

The draft's greedy proposal is an argmax over its whole vocabulary; a trimmed head
(server/vllm_plugins/draft_head.py) takes it over the first N ids of this ranking instead,
plus the ids of the request's own context. The ranking is built from data found on
every machine specserve runs on: the Python standard library's sources (code) and the
Markdown and reStructuredText files of the installed packages (prose), tokenized with
the draft's tokenizer. Order: the tokenizer's added and special tokens (end of text
among them) first, then the corpus's tokens by count, then every other id by id.

Written once per tokenizer into the cache (`draft-vocab/<tokenizer digest>.npy`,
atomically), so each start reads a 600 KB file instead of tokenizing megabytes.
"""

import hashlib
import os
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

# Bytes of each kind of text: enough for the ranking's top 32k to settle (doubling it
# moves coverage of held-out code by under half a point), small enough to build in
# seconds.
CORPUS_BYTES_PER_KIND = 4_000_000
_VERSION = "1"  # bump when the corpus or the order changes


def ranking_path(draft: Path, cache_dir: Path) -> Path:
    digest = hashlib.sha256(_VERSION.encode())
    digest.update((draft / "tokenizer.json").read_bytes())
    return cache_dir / "draft-vocab" / f"{digest.hexdigest()[:16]}.npy"


def ranking(draft: Path, cache_dir: Path, report: Callable[[str], None] = print) -> Path:
    """The ranking file of the model folder `draft`'s tokenizer, built unless cached."""
    import numpy as np

    final = ranking_path(draft, cache_dir)
    if final.is_file():
        return final
    report(f"{draft.name}: ranking its vocabulary for the trimmed draft head")
    order = build_order(draft, _corpus())
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=final.parent, suffix=".npy", delete=False) as scratch:
        np.save(scratch, order)
    os.replace(scratch.name, final)
    report(f"{draft.name}: vocabulary ranked")
    return final


def build_order(draft: Path, texts: Iterator[str]) -> "list[int]":
    """Every id of `draft`'s tokenizer, specials first, then by count over `texts`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(draft / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False).ids)
    specials = sorted(tokenizer.get_added_tokens_decoder())
    ranked = [token for token, _ in counts.most_common()]
    first = list(dict.fromkeys(specials + ranked))
    placed = set(first)
    return first + [token for token in range(size) if token not in placed]


def load(path: Path, size: int) -> "list[int]":
    """The first `size` ids of a ranking file."""
    import numpy as np

    return [int(token) for token in np.load(path)[:size]]


def _corpus() -> Iterator[str]:
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    code = sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))
    packages = Path(paths["purelib"])
    prose = sorted(packages.rglob("*.md")) + sorted(packages.rglob("*.rst"))
    for files in (code, prose):
        yield from _read_up_to(files, CORPUS_BYTES_PER_KIND)


def _read_up_to(files: list[Path], budget: int) -> Iterator[str]:
    for path in files:
        if budget <= 0:
            return
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        budget -= len(text)
        yield text
