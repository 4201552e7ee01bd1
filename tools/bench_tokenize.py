"""Benchmark (not a test): segmented parallel encoding against one `encode` call on a long text.

    python tools/bench_tokenize.py                          # 1 MB, both tokenizers, segments of 4096 and 16384
    python tools/bench_tokenize.py --mb 4 --segment-chars 4096 16384 65536 --repeats 5

The text is generated deterministically: prose, code, CJK and emoji paragraphs. Each measurement is
the best of --repeats runs; both modes must give the same ids. Prints one JSON line per measurement.
`encode_batch` runs on tokenizers' Rust thread pool, one thread per core (RAYON_NUM_THREADS caps
it), so the speed-up is bounded by the core count, reported in the first line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = (
    "the of and to in is was for that with as on by at from it his an were are which be this has or had "
    "not but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made model tokenizer engine cache kernel it's don't we'll"
).split()
CODE = [
    "def {name}(self, x, y=None):\n    if y is None:\n        return x * 2\n    return [i + y for i in range(x)]\n",
    "for (int i = 0; i < n; ++i) {{\n\tsum += a[i] * b[i];\n}}\n",
    '{{\n  "{name}": [1, 2, 3],\n  "ok": true,\n  "nested": {{"a": null}}\n}}\n',
    "class {Name}:\n    def __init__(self):\n        self.{name} = {{}}  # cache\n\n",
    "SELECT id, {name} FROM users WHERE age >= 18 ORDER BY {name} DESC;\r\n",
    "    return {name}.map(x => x ** 2).filter(Boolean); // {name}\n",
]
EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤️", "🔥", "✨", "🎉", "🚀", "🐍", "🏳️\u200d🌈"]


def prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 6)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?", ";", ":"]))
    return " ".join(sentences) + "\n\n"


def code(rng: random.Random) -> str:
    name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(3, 10)))
    return "".join(rng.choice(CODE).format(name=name, Name=name.title()) for _ in range(rng.randint(2, 5))) + "\n"


def cjk(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(1, 4)):
        chars = [chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(10, 60))]
        for _ in range(len(chars) // 8):
            chars.insert(rng.randrange(len(chars)), rng.choice("，。、！？「」"))
        lines.append("".join(chars))
    if rng.random() < 0.5:
        lines.append("".join(chr(rng.randint(0x3041, 0x30F6)) for _ in range(rng.randint(5, 30))))
    if rng.random() < 0.5:
        lines.append("".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(rng.randint(5, 30))))
    return "\n".join(lines) + "\n\n"


def emoji(rng: random.Random) -> str:
    groups = ["".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(3, 15))]
    return " ".join(groups) + "\n"


def mixed_text(megabytes: float, seed: int = 0) -> str:
    """At least `megabytes` MB of UTF-8: paragraphs drawn 50% prose, 25% code, 15% CJK, 10% emoji."""
    rng = random.Random(seed)
    kinds = [prose] * 10 + [code] * 5 + [cjk] * 3 + [emoji] * 2
    parts, size = [], 0
    while size < megabytes * 1e6:
        part = rng.choice(kinds)(rng)
        parts.append(part)
        size += len(part.encode())
    return "".join(parts)


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def emit(record: dict) -> None:
    print(json.dumps(record, ensure_ascii=False), flush=True)


def load_tokenizers(names: list[str]):
    from jaxinfer.tokenizer import load

    paths = {
        "smollm2": "smollm2-135m",
        "llama3": os.environ.get("JAXINFER_LLAMA3_TOKENIZER", str(REPO / ".cache" / "llama3" / "tokenizer.json")),
    }
    return {name: load(paths[name]) for name in names}


def main() -> None:
    import tokenizers

    from jaxinfer.tokenizer.segmented import SegmentedEncoder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=1.0)
    parser.add_argument("--segment-chars", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizers", nargs="+", default=["smollm2", "llama3"], choices=["smollm2", "llama3"])
    args = parser.parse_args()

    text = mixed_text(args.mb)
    megabytes = len(text.encode()) / 1e6
    emit(dict(what="env", cores=os.cpu_count(), tokenizers=tokenizers.__version__,
              rayon_threads=os.environ.get("RAYON_NUM_THREADS"), parallelism=os.environ.get("TOKENIZERS_PARALLELISM"),
              text_mb=round(megabytes, 3), text_chars=len(text), lines=text.count("\n")))
    for name, tok in load_tokenizers(args.tokenizers).items():
        backend = tok._user  # what encode_user encodes with: special-token matching off
        backend.encode(text[:100_000], add_special_tokens=False)  # warm the BPE cache a little, both modes alike
        single_s, single = best_of(args.repeats, lambda b=backend: b.encode(text, add_special_tokens=False).ids)
        emit(dict(what="tokenize", tokenizer=name, mode="single", seconds=round(single_s, 4),
                  mb_per_s=round(megabytes / single_s, 2), tokens=len(single)))
        for segment_chars in args.segment_chars:
            encoder = SegmentedEncoder(backend, segment_chars=segment_chars)
            cuts_s, cuts = best_of(args.repeats, lambda e=encoder: e.cuts(text))
            seg_s, ids = best_of(args.repeats, lambda e=encoder: e.encode(text))
            if ids != single:
                raise SystemExit(f"{name}: segmented ids differ from the single call (segment_chars={segment_chars})")
            emit(dict(what="tokenize", tokenizer=name, mode="segmented", segment_chars=segment_chars,
                      segments=len(cuts) + 1, seconds=round(seg_s, 4), cut_search_s=round(cuts_s, 4),
                      mb_per_s=round(megabytes / seg_s, 2), tokens=len(ids), speedup=round(single_s / seg_s, 2)))


if __name__ == "__main__":
    main()
