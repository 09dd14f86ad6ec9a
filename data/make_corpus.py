"""Write data/corpus.txt: short simple-English stories from a seeded template grammar.

Every word here was written for this project, so the corpus may be shipped with it. The output is a
pure function of the seed (Python's ``random.Random``), so ``python data/make_corpus.py`` regenerates
the committed file byte for byte. One story per line; a story is one training sample.

    python data/make_corpus.py [--stories N] [--seed S] [--out data/corpus.txt]
"""
from __future__ import annotations

import argparse
import os
import random


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1 (functional_dsv41.kernels._bench_common has the benchmarks' one; this
    script stays stdlib-only, so that any Python 3.10+ regenerates the corpus without the package)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v

NAMES = ["Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Lucy", "Leo", "Emma", "Jack", "Rosa",
         "Finn", "Nora", "Omar", "Zoe", "Hugo", "Ivy", "Kai", "Ella"]
ANIMALS = ["cat", "dog", "bird", "frog", "rabbit", "duck", "fox", "bear", "mouse", "owl", "horse",
           "turtle", "goat", "fish", "lamb"]
PLACES = ["the park", "the garden", "the beach", "the forest", "the farm", "the lake", "the hill",
          "the market", "the school", "the river", "the field", "the town", "the zoo", "the library"]
OBJECTS = ["ball", "kite", "hat", "box", "book", "cake", "boat", "drum", "cup", "key", "map", "apple",
           "shell", "bell", "coat", "sock", "toy car", "red ball", "blue kite", "little boat"]
ADJ = ["happy", "sad", "kind", "brave", "tired", "hungry", "shy", "silly", "small", "big", "quiet",
       "busy", "clever", "gentle", "curious"]
WEATHER = ["The sun was warm.", "It was a rainy day.", "The wind was cold.", "The sky was blue.",
           "It was a snowy morning.", "The clouds were grey.", "It was a bright day."]
COLORS = ["red", "blue", "green", "yellow", "pink", "brown", "white", "orange"]
FEEL = ["happy", "glad", "proud", "calm", "safe", "warm"]
REL = ["friend", "sister", "brother", "mom", "dad", "grandma", "grandpa", "teacher"]


def _story(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    an, pl, ob = r.choice(ANIMALS), r.choice(PLACES), r.choice(OBJECTS)
    adj, col, rel = r.choice(ADJ), r.choice(COLORS), r.choice(REL)
    he = r.choice(["he", "she"])
    his = "his" if he == "he" else "her"
    s = []
    s.append(r.choice([
        f"Once upon a time, there was a {adj} {an} named {a}.",
        f"One day, {a} went to {pl}.",
        f"{a} was a {adj} child who liked to play.",
        f"There was a little {an} who lived near {pl}.",
        f"{a} had a {col} {ob}.",
    ]))
    s.append(r.choice(WEATHER))
    s.append(r.choice([
        f"{a} wanted to play with {his} {ob}.",
        f"{a} saw a {an} by the tree.",
        f"{a} and {b} went to {pl} together.",
        f"{a} liked to look at the {col} flowers.",
        f"{his.capitalize()} {rel} gave {a} a {ob}.",
    ]))
    problem = r.randrange(4)
    if problem == 0:
        s += [f"But then, the {ob} was gone.", f"{a} looked under the bed and behind the door.",
              f"{a} felt {r.choice(['sad', 'worried', 'upset'])}.",
              f"{b} said, \"Do not worry. I will help you.\"",
              f"They looked in {pl} and found the {ob} in the grass.",
              f"{a} said, \"Thank you, {b}!\""]
    elif problem == 1:
        s += [f"The {an} was stuck in a {r.choice(['hole', 'tree', 'box', 'fence'])}.",
              f"{a} wanted to help the {an}.",
              f"{he.capitalize()} pulled and pulled, but it was hard.",
              f"Then {b} came to help.",
              f"Together they got the {an} out.",
              f"The {an} was {r.choice(FEEL)} and ran away to {pl}."]
    elif problem == 2:
        s += [f"{a} and {b} both wanted the {ob}.",
              f"They started to fight.",
              f"\"It is mine!\" said {a}.",
              f"\"No, it is mine!\" said {b}.",
              f"Then {his} {rel} said, \"You can share it.\"",
              f"So they took turns, and they had fun together."]
    else:
        s += [f"{a} wanted to {r.choice(['bake a cake', 'build a boat', 'draw a picture', 'sing a song', 'plant a seed'])}.",
              f"{he.capitalize()} tried, but it did not work the first time.",
              f"{a} did not give up.",
              f"{he.capitalize()} tried again, and again.",
              f"At last, it worked!",
              f"{his.capitalize()} {rel} was very proud of {a}."]
    if r.random() < 0.5:
        s.append(r.choice([
            f"After that, they ate {r.choice(['apples', 'bread', 'soup', 'cookies', 'rice'])} and drank {r.choice(['milk', 'water', 'tea', 'juice'])}.",
            f"Then they went home, because it was late.",
            f"The {an} came back the next day to say hello.",
            f"{a} told {his} {rel} all about it.",
        ]))
    s.append(r.choice([
        f"{a} felt {r.choice(FEEL)}.",
        "The end.",
        f"From that day on, {a} and {b} were best friends.",
        f"{a} learned that it is good to help others.",
        f"{a} learned to never give up.",
        "They were happy all day.",
    ]))
    return " ".join(s)


def _short(r: random.Random) -> str:
    """A two-to-four sentence note: short samples let the packer fill the ends of rows."""
    a, an, ob, col = r.choice(NAMES), r.choice(ANIMALS), r.choice(OBJECTS), r.choice(COLORS)
    s = [r.choice([f"{a} has a {col} {ob}.", f"The {an} is {r.choice(ADJ)}.", f"{a} sees a {an}.",
                   f"{a} is at {r.choice(PLACES)}."]),
         r.choice([f"The {an} likes to {r.choice(['run', 'jump', 'sleep', 'eat', 'swim', 'hide'])}.",
                   f"{a} likes the {ob}.", r.choice(WEATHER), f"{a} is {r.choice(FEEL)}."])]
    if r.random() < 0.5:
        s.append(r.choice(["The end.", f"{a} smiles.", f"The {an} says hello.", f"{a} goes home."]))
    return " ".join(s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stories", type=positive_int, default=4000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt"))
    a = ap.parse_args(argv)
    r = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8", newline="\n") as fh:
        for _ in range(a.stories):
            fh.write((_short(r) if r.random() < 0.3 else _story(r)) + "\n")
    print(f"wrote {a.stories} stories, {os.path.getsize(a.out)} bytes -> {a.out}")


if __name__ == "__main__":
    main()
