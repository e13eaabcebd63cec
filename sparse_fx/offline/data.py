"""Real text that ships with every Python install, split into disjoint train and held-out sets.

Documents are the language reference (`pydoc_data.topics`, English prose) and the standard
library's own `.py` files (code). Each document goes to one split by a stable hash of its name,
so training (signature encoders, calibration) never sees what evaluation reads.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SPLITS = ("train", "heldout")
HELDOUT_SHARE = {"prose": 0.5, "code": 0.1}  # the share of each kind held out for evaluation


@dataclass(frozen=True)
class Document:
    name: str
    kind: str  # "prose" or "code"
    text: str

    @property
    def split(self) -> str:
        bucket = int(hashlib.sha256(self.name.encode()).hexdigest()[:8], 16) / 16**8
        return "heldout" if bucket < HELDOUT_SHARE[self.kind] else "train"


def documents(split: str, kinds: tuple[str, ...] = ("prose", "code")) -> list[Document]:
    """Every document of `split` ("train" or "heldout"), in a stable order."""
    if split not in SPLITS:
        raise ValueError(f"sparse_fx: unknown split {split!r}; valid: {', '.join(SPLITS)}")
    docs = []
    if "prose" in kinds:
        from pydoc_data.topics import topics

        docs += [Document(f"topics/{k}", "prose", v) for k, v in sorted(topics.items())]
    if "code" in kinds:
        root = Path(sysconfig.get_paths()["stdlib"])
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            if rel.parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel.parts:
                continue
            try:
                docs.append(Document(f"stdlib/{rel.as_posix()}", "code", f.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    return [d for d in docs if d.split == split]


def token_windows(
    tokenizer, split: str, length: int, count: int, seed: int = 0, kinds: tuple[str, ...] = ("prose", "code")
) -> torch.Tensor:
    """[count, length] token ids: documents of `split`, shuffled by `seed`, concatenated and cut."""
    docs = documents(split, kinds)
    random.Random(seed).shuffle(docs)
    out, buf = [], []
    for d in docs:
        buf += tokenizer(d.text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(buf) >= length and len(out) < count:
            out.append(buf[:length])
            buf = buf[length:]
        if len(out) == count:
            break
    if len(out) < count:
        raise ValueError(f"sparse_fx: the {split} split holds fewer than {count} windows of {length} tokens")
    return torch.tensor(out, dtype=torch.long)


PASSKEY_INTRO = (
    "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there. "
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> torch.Tensor:
    """[1, ~context] ids of the classic pass-key retrieval prompt (Mohtashami & Jaggi, 2023).

    The key sits after `depth` (0..1) of the filler; the prompt ends with "The pass key is", so
    the answer is the next few tokens.
    """
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    tail = "\nWhat is the pass key? The pass key is"
    fixed = len(tokenizer(PASSKEY_INTRO + needle + tail)["input_ids"])
    reps = max((context - fixed) // len(tokenizer(PASSKEY_FILLER)["input_ids"]), 1)
    cut = round(reps * depth)
    text = PASSKEY_INTRO + PASSKEY_FILLER * cut + needle + PASSKEY_FILLER * (reps - cut) + tail
    return tokenizer(text, return_tensors="pt")["input_ids"]
